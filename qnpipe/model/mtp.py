"""The MTP head: one gated-attention + MoE decoder layer that drafts the token after next.

Built from the HF-named `mtp.*` tensors the loader keeps aside (`LoadedModel.mtp_weights`:
zero-centred norms stored as `w`, per-expert tensors, float or affine-quantized). Row t
reads a hidden state of the main model at t and the token at t+1 and gives logits for
t+2 (docs/model.md, "MTP head"). Its KV cache is one `KVCache`, kept as the last entry of
the speculative loop's cache list (qnpipe.live.mtp.loop) so a snapshot of the list includes it.

The head's MoE is a layer of its own, id `num_hidden_layers` (one past the main model's
last layer), served by its own `ResidentExperts`.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from qnpipe.errors import CheckpointError
from qnpipe.model.args import ModelArgs
from qnpipe.model.experts import PROJS, LayerExperts, ProjWeights, ResidentExperts
from qnpipe.model.load import quant_params
from qnpipe.model.qwen3_next import Attention, Model, SparseMoeBlock

# Zero-centred norms (HF stores w, the model applies 1 + w), under the head's module names.
_ZC_NORMS = ("pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "norm.weight",
             "input_layernorm.weight", "post_attention_layernorm.weight",
             "self_attn.q_norm.weight", "self_attn.k_norm.weight")


class MtpHead(nn.Module):
    """`head(hidden [B, L, H], next_tokens [B, L], cache) -> (logits [B, L, V], hidden after mtp.norm, before it)`."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        H, eps = args.hidden_size, args.rms_norm_eps
        self.layer_id = args.num_hidden_layers
        self.pre_fc_norm_embedding = nn.RMSNorm(H, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(H, eps=eps)
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.input_layernorm = nn.RMSNorm(H, eps=eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = nn.RMSNorm(H, eps=eps)
        self.mlp = SparseMoeBlock(args, self.layer_id)
        self.norm = nn.RMSNorm(H, eps=eps)

    def __call__(self, model: Model, hidden: mx.array, next_tokens: mx.array,
                 cache: KVCache, *, last_only: bool = False) -> tuple[mx.array, mx.array, mx.array]:
        h = self.mix(model, hidden, next_tokens, cache)
        return self.finish(model, h + self.mlp(self.post_attention_layernorm(h)), last_only=last_only)

    def mix(self, model: Model, hidden: mx.array, next_tokens: mx.array, cache: KVCache) -> mx.array:
        """Everything before the MoE: fc over [embedding, hidden], then the attention's residual step."""
        e = self.pre_fc_norm_embedding(model.model.embed_tokens(next_tokens))
        u = self.fc(mx.concatenate([e, self.pre_fc_norm_hidden(hidden)], axis=-1))  # embedding half first
        mask = create_attention_mask(u, cache)
        return u + self.self_attn(self.input_layernorm(u), mask, cache)

    def finish(self, model: Model, h: mx.array, *, last_only: bool = False) -> tuple[mx.array, mx.array, mx.array]:
        """(draft logits, hidden after mtp.norm, hidden before it) from the layer's output `h`.

        `last_only`: the logits of the last row alone (`[B, 1, V]`), all a draft reads. The rows
        before it only fill the MTP layer's cache, and the LM head over a prefill's rows would
        cost more than the MTP layer itself.
        """
        out = self.norm(h)
        return model.head(out[:, -1:] if last_only else out), out, h

    def make_cache(self) -> KVCache:
        return KVCache()


def _module_names(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    out = {}
    for name, a in weights.items():
        short = name.removeprefix("mtp.").replace("layers.0.", "", 1)
        out[short] = a + 1.0 if short in _ZC_NORMS else a
    return out


def _stack_experts(args: ModelArgs, w: dict[str, mx.array], source: str) -> LayerExperts:
    """`mlp.experts.E.proj.*` -> one stacked `[E, ...]` projection each (the loader's layout)."""
    dims = args.expert_dims
    projs = {}
    for proj in PROJS:
        parts: dict[str, list[mx.array]] = {}
        for suffix in ("weight", "scales", "biases"):
            names = [f"mlp.experts.{e}.{proj}.{suffix}" for e in range(args.num_experts)]
            found = [n for n in names if n in w]
            if not found:
                continue
            if len(found) != len(names):
                missing = next(n for n in names if n not in w)
                raise CheckpointError(f"{source}: missing tensor mtp.layers.0.{missing}")
            parts[suffix] = [w.pop(n) for n in names]
        if "weight" not in parts:
            raise CheckpointError(f"{source}: missing tensor mtp.layers.0.mlp.experts.0.{proj}.weight")
        weight = mx.stack(parts["weight"])
        if "scales" not in parts:
            want = (args.num_experts, *dims[proj])
            if tuple(weight.shape) != want:
                raise CheckpointError(f"{source}: mtp.layers.0.mlp.experts.*.{proj}.weight has shape "
                                      f"{list(weight.shape[1:])}, expected {list(want[1:])}")
            projs[proj] = ProjWeights(weight)
            continue
        scales = mx.stack(parts["scales"])
        biases = mx.stack(parts["biases"]) if "biases" in parts else None
        q = quant_params(proj, None, tuple(scales.shape), tuple(weight.shape), dims[proj][1])
        assert q is not None
        projs[proj] = ProjWeights(weight, scales, biases, q["group_size"], q["bits"], q["mode"])
    return LayerExperts(**projs)


def load_mtp(args: ModelArgs, weights: dict[str, mx.array], source: str, *,
             resident_experts: bool = True) -> MtpHead | None:
    """The MTP head of `weights` (HF names), its experts resident; None when there are none.

    `resident_experts` False checks the experts and drops them: the pool streams them from
    the file (qnpipe.live.mtp.mtp_store).

    Raises CheckpointError naming `source` and the tensor for missing, unexpected or
    misshapen tensors.
    """
    if not weights:
        return None
    if args.num_experts <= 0:
        raise CheckpointError(f"{source}: MTP heads without a MoE are not supported")
    w = _module_names(weights)
    experts = _stack_experts(args, w, source)
    head = MtpHead(args)

    def predicate(path: str, module: nn.Module) -> bool | dict[str, Any]:
        if not hasattr(module, "to_quantized") or f"{path}.scales" not in w:
            return False
        q = quant_params(path, None, tuple(w[f"{path}.scales"].shape), tuple(w[f"{path}.weight"].shape),
                         module["weight"].shape[-1])
        return q if q is not None else False

    if any(n.endswith(".scales") for n in w):
        nn.quantize(head, class_predicate=predicate)
    expected = dict(_flat(head))
    for name in sorted(w):
        if name not in expected:
            raise CheckpointError(f"{source}: unexpected tensor mtp.{name} (not part of this model's MTP head)")
    for name, arr in expected.items():
        if name not in w:
            raise CheckpointError(f"{source}: missing tensor mtp.{name}")
        if tuple(w[name].shape) != tuple(arr.shape):
            raise CheckpointError(f"{source}: tensor mtp.{name} has shape {list(w[name].shape)}, "
                                  f"expected {list(arr.shape)}")
    head.load_weights(list(w.items()), strict=True)
    head.eval()
    if resident_experts:
        head.mlp._experts = ResidentExperts({head.layer_id: experts})
        mx.eval([a for p in (experts.gate_proj, experts.up_proj, experts.down_proj)
                 for a in (p.weight, p.scales, p.biases) if a is not None])
    mx.eval(head.parameters())
    return head


def _flat(module: nn.Module) -> list[tuple[str, mx.array]]:
    from mlx.utils import tree_flatten

    flat = tree_flatten(module.parameters())
    assert isinstance(flat, list)
    return flat
