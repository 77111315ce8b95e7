"""Qwen3-Next in MLX, following mlx-lm's order of operations so logits match it bit for bit.

The routed experts are not parameters of this module tree: each MoE block asks an
`ExpertSource` (qnpipe.model.experts) to run the experts its router picked, so the
pool that holds them can be swapped without touching the model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import precise_swiglu, swiglu
from mlx_lm.models.base import create_attention_mask, create_ssm_mask, scaled_dot_product_attention
from mlx_lm.models.cache import ArraysCache, KVCache
from mlx_lm.models.gated_delta import gated_delta_update, normalize_qk
from mlx_lm.models.rope_utils import initialize_rope

from qnpipe.model.args import ModelArgs
from qnpipe.model.experts import ExpertSource
from qnpipe.model.kvquant import RotatedQuantizedKVCache
from qnpipe.model.stage import Remote
from qnpipe.model.step_cache import StepCache


class RMSNormGated(nn.Module):
    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = mx.ones(dims)

    def __call__(self, x: mx.array, gate: mx.array) -> mx.array:
        return precise_swiglu(x, gate, mx.fast.rms_norm(x, self.weight, self.eps))


class Attention(nn.Module):
    """Gated full attention: per-head [query | gate] projection, q/k norms, partial RoPE."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = hd = args.head_dim
        self.scale = hd**-0.5
        bias = args.attention_bias
        self.q_proj = nn.Linear(args.hidden_size, self.n_heads * hd * 2, bias=bias)
        self.k_proj = nn.Linear(args.hidden_size, self.n_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(args.hidden_size, self.n_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * hd, args.hidden_size, bias=bias)
        self.q_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
        self.rope = initialize_rope(
            int(hd * args.partial_rotary_factor),
            base=args.rope_theta,
            traditional=False,
            scaling_config=args.rope_scaling,
            max_position_embeddings=args.max_position_embeddings,
        )

    def __call__(self, x: mx.array, mask: Any, cache: KVCache | RotatedQuantizedKVCache | None) -> mx.array:
        B, L, _ = x.shape
        q, gate = mx.split(self.q_proj(x).reshape(B, L, self.n_heads, -1), 2, axis=-1)
        gate = gate.reshape(B, L, -1)
        k, v = self.k_proj(x), self.v_proj(x)
        q = self.q_norm(q).transpose(0, 2, 1, 3)
        k = self.k_norm(k.reshape(B, L, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        v = v.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        if cache is not None:
            q = self.rope(q, offset=cache.offset)
            k = self.rope(k, offset=cache.offset)
            if isinstance(cache, RotatedQuantizedKVCache):  # attention on the packed cache
                o = cache.attend(q, k, v, scale=self.scale, mask=mask)
                return self.o_proj(o.transpose(0, 2, 1, 3).reshape(B, L, -1) * mx.sigmoid(gate))
            k, v = cache.update_and_fetch(k, v)
        else:
            q, k = self.rope(q), self.rope(k)
        o = scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
        o = o.transpose(0, 2, 1, 3).reshape(B, L, -1)
        return self.o_proj(o * mx.sigmoid(gate))


class GatedDeltaNet(nn.Module):
    """Linear attention with a causal depthwise conv and a gated delta-rule state (docs/model.md, "Forward pass")."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_v = args.linear_num_value_heads
        self.n_k = args.linear_num_key_heads
        self.d_k = args.linear_key_head_dim
        self.d_v = args.linear_value_head_dim
        self.key_dim = self.d_k * self.n_k
        self.value_dim = self.d_v * self.n_v
        self.conv_kernel_size = args.linear_conv_kernel_dim
        self.conv_dim = self.key_dim * 2 + self.value_dim
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, self.conv_kernel_size,
            groups=self.conv_dim, padding=0, bias=False,
        )
        self.in_proj_qkvz = nn.Linear(args.hidden_size, self.key_dim * 2 + self.value_dim * 2, bias=False)
        self.in_proj_ba = nn.Linear(args.hidden_size, self.n_v * 2, bias=False)
        self.dt_bias = mx.ones(self.n_v)
        self.A_log = mx.zeros(self.n_v)
        self.norm = RMSNormGated(self.d_v, eps=args.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, args.hidden_size, bias=False)

    def _split(self, qkvz: mx.array, ba: mx.array) -> tuple[mx.array, ...]:
        # Both projections are grouped by key head (docs/model.md, "Forward pass").
        nk, dk, nv, dv = self.n_k, self.d_k, self.n_v, self.d_v
        qkvz = qkvz.reshape(*qkvz.shape[:-1], nk, -1)
        ba = ba.reshape(*ba.shape[:-1], nk, -1)
        q, k, v, z = mx.split(qkvz, [dk, 2 * dk, 2 * dk + nv // nk * dv], axis=-1)
        b, a = mx.split(ba, [nv // nk], axis=-1)
        return (
            q, k,
            v.reshape(*v.shape[:2], -1, dv),
            z.reshape(*z.shape[:2], -1, dv),
            b.reshape(*b.shape[:2], nv),
            a.reshape(*a.shape[:2], nv),
        )

    def __call__(self, x: mx.array, mask: Any, cache: ArraysCache | None) -> mx.array:
        B, S, _ = x.shape
        q, k, v, z, b, a = self._split(self.in_proj_qkvz(x), self.in_proj_ba(x))
        if cache is not None and cache[0] is not None:
            conv_state = cache[0]
        else:
            conv_state = mx.zeros((B, self.conv_kernel_size - 1, self.conv_dim), dtype=x.dtype)
        mixed = mx.concatenate([q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)], axis=-1)
        if mask is not None:
            mixed = mx.where(mask[..., None], mixed, 0)
        conv_in = mx.concatenate([conv_state, mixed], axis=1)
        if cache is not None:
            cache[0] = mx.contiguous(conv_in[:, -(self.conv_kernel_size - 1):, :])
        conv_out = nn.silu(self.conv1d(conv_in))
        q, k, v = [
            t.reshape(B, S, h, d)
            for t, h, d in zip(
                mx.split(conv_out, [self.key_dim, 2 * self.key_dim], -1),
                [self.n_k, self.n_k, self.n_v],
                [self.d_k, self.d_k, self.d_v], strict=True,
            )
        ]
        state = cache[1] if cache else None
        q, k = normalize_qk(q, k, inv_scale=self.d_k**-0.5, eps=1e-6)
        if isinstance(cache, StepCache) and cache.recording:  # a speculative verify keeps every token's state
            out, state = cache.record(conv_in, q, k, v, a, b, self.A_log, self.dt_bias, state, mask)
        else:
            out, state = gated_delta_update(
                q, k, v, a, b, self.A_log, self.dt_bias, state, mask, use_kernel=not self.training
            )
        if cache is not None:
            cache[1] = state
            cache.advance(S)
        out = self.norm(out, z)
        return self.out_proj(out.reshape(B, S, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class SparseMoeBlock(nn.Module):
    """Router (softmax over all experts, top-k, renormalise), routed experts from a pool, gated shared expert."""

    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.layer = layer
        self.top_k = args.num_experts_per_tok
        self.norm_topk_prob = args.norm_topk_prob
        self.gate = nn.Linear(args.hidden_size, args.num_experts, bias=False)
        self.shared_expert = MLP(args.hidden_size, args.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(args.hidden_size, 1, bias=False)
        # Set by the loader; kept out of the parameter tree (the pool owns the expert arrays).
        self._experts: ExpertSource | None = None

    def route(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """Expert indices [..., k] and their weights [..., k], exactly as mlx-lm computes them."""
        gates = mx.softmax(self.gate(x), axis=-1, precise=True)
        k = self.top_k
        inds = mx.argpartition(gates, kth=-k, axis=-1)[..., -k:]
        scores = mx.take_along_axis(gates, inds, axis=-1)
        if self.norm_topk_prob:
            scores = scores / scores.sum(axis=-1, keepdims=True)
        return inds, scores

    def __call__(self, x: mx.array) -> mx.array:
        inds, scores = self.route(x)
        assert self._experts is not None, "no ExpertSource attached (load the model with qnpipe.model.load)"
        return self.combine(x, self._experts(self.layer, x, inds), scores)

    def combine(self, x: mx.array, y: mx.array, scores: mx.array, shared: mx.array | None = None) -> mx.array:
        """The block's output from the routed experts' outputs `y [..., k, H]` and the shared expert
        (`shared`: `self.shared(x)` made earlier, the same array)."""
        y = (y * scores[..., None]).sum(axis=-2)
        return y + (self.shared(x) if shared is None else shared)

    def shared(self, x: mx.array) -> mx.array:
        """The gated shared expert's output: it does not depend on the route."""
        return mx.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.is_linear = args.is_linear(layer)
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(args)
        else:
            self.self_attn = Attention(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        if args.is_moe(layer):
            self.mlp: nn.Module = SparseMoeBlock(args, layer)
        else:
            self.mlp = MLP(args.hidden_size, args.intermediate_size)

    def __call__(self, x: mx.array, mask: Any, cache: Any) -> mx.array:
        h = self.mix(x, mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))

    def mix(self, x: mx.array, mask: Any, cache: Any) -> mx.array:
        """The token mixer's residual step (attention or Gated DeltaNet), before the MLP."""
        mixer = self.linear_attn if self.is_linear else self.self_attn
        return x + mixer(self.input_layernorm(x), mask, cache)


class Qwen3NextModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        kinds = [args.is_linear(i) for i in range(args.num_hidden_layers)]
        self.ssm_idx = kinds.index(True) if True in kinds else None
        self.fa_idx = kinds.index(False) if False in kinds else None

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None) -> mx.array:
        """Post-final-norm hidden states [B, L, H]."""
        h = self.embed_tokens(inputs)
        if cache is None:
            cache = [None] * len(self.layers)
        fa_mask, ssm_mask = self.masks(h, cache)
        for layer, c in zip(self.layers, cache, strict=True):
            h = layer(h, ssm_mask if layer.is_linear else fa_mask, c)
        return self.norm(h)

    def masks(self, h: mx.array, cache: list[Any]) -> tuple[Any, Any]:
        """The (full-attention, linear-attention) masks for embedded inputs `h`."""
        fa_mask = create_attention_mask(h, cache[self.fa_idx]) if self.fa_idx is not None else None
        ssm_mask = create_ssm_mask(h, cache[self.ssm_idx]) if self.ssm_idx is not None else None
        return fa_mask, ssm_mask


class Model(nn.Module):
    """Qwen3-Next causal LM: `model(tokens[B, L], cache) -> logits[B, L, V]`."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = Qwen3NextModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def head(self, hidden: mx.array) -> mx.array:
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(hidden)
        return self.lm_head(hidden)

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None) -> mx.array:
        return self.head(self.model(inputs, cache))

    @property
    def layers(self) -> list[DecoderLayer]:
        return self.model.layers

    # Set by the engine when kv.quantize is on: makes each full-attention layer's cache.
    kv_factory: Callable[[], Any] | None = None

    def make_cache(self) -> list[Any]:
        kv = self.kv_factory or KVCache
        # A layer another rank runs (pipeline parallel) has no cache here.
        return [None if isinstance(layer, Remote) else ArraysCache(size=2) if layer.is_linear else kv()
                for layer in self.layers]

    def attach_experts(self, source: ExpertSource) -> None:
        """Route every MoE block's expert calls to `source`."""
        for layer in self.layers:
            if isinstance(layer.mlp, SparseMoeBlock):
                layer.mlp._experts = source
