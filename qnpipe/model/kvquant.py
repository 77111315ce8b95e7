"""KV-cache quantization of the full-attention layers: rotated keys and values, affine groups, K and V bits apart.

Keys and values are multiplied by a fixed random rotation R (block-diagonal, one SO(4) block
per 4 dims of the head, drawn from `kv.rot_seed`) before they are quantized: a rotation
spreads an outlier dimension over its block, so a group's scale fits the rest better. It
cancels in the scores, (qR)(kR)ᵀ = qkᵀ; the attention output is computed against the
rotated values and rotated back, (p·vR)Rᵀ = p·v. Attention runs on the packed cache with
MLX's quantized matmul (no dequantized copy of the cache); keys and values may use different
bits (default 4 and 3), which mlx-lm's QuantizedKVCache (one `bits` for both) cannot.

The Gated DeltaNet layers' state is never quantized. `bytes_per_token` is the arithmetic of
the cache's size; tests/model/test_kvquant.py checks it against the arrays held.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.base import create_causal_mask

from qnpipe.config import KvCfg
from qnpipe.errors import ConfigError
from qnpipe.model.snapshots import LayerState, register_kind

BLOCK = 4
STEP = 256  # tokens of cache allocated at a time (as mlx-lm)


def check_kv_cfg(kv_cfg: KvCfg, head_dim: int) -> None:
    """ConfigError when the settings do not fit a head of `head_dim` dimensions."""
    if head_dim % kv_cfg.group_size:
        allowed = [g for g in (32, 64, 128) if head_dim % g == 0]
        raise ConfigError(f"kv.group_size={kv_cfg.group_size} must divide the model's head_dim {head_dim} "
                          f"(allowed here: {', '.join(map(str, allowed)) or 'none: set kv.quantize=false'})")
    if kv_cfg.group_size not in (32, 64, 128):
        raise ConfigError(f"kv.group_size={kv_cfg.group_size}: MLX quantizes in groups of 32, 64 or 128")
    if kv_cfg.rotate and head_dim % BLOCK:
        raise ConfigError(f"kv.rotate=true needs a head_dim divisible by {BLOCK}, the model's is {head_dim}")


def rotation(head_dim: int, seed: int) -> np.ndarray:
    """The `[head_dim, head_dim]` float32 block-diagonal rotation: a random SO(4) block per 4 dimensions."""
    rng = np.random.default_rng(seed)
    r = np.zeros((head_dim, head_dim), dtype=np.float64)
    for b in range(0, head_dim, BLOCK):
        q, upper = np.linalg.qr(rng.standard_normal((BLOCK, BLOCK)))
        q = q * np.sign(np.diag(upper))  # Haar-distributed
        if np.linalg.det(q) < 0:
            q[:, 0] = -q[:, 0]
        r[b:b + BLOCK, b:b + BLOCK] = q
    return r.astype(np.float32)


def packed_dim(dim: int, bits: int) -> int:
    """uint32 words per `dim` values at `bits` bits (mx.quantize packs them densely)."""
    return dim * bits // 32


def bytes_per_token(n_full_attn_layers: int, n_kv_heads: int, head_dim: int, dtype_bytes: int,
                    kv_cfg: KvCfg | None) -> int:
    """Bytes of KV cache per token of context over the full-attention layers (None = unquantized)."""
    if kv_cfg is None:
        per_head = 2 * head_dim * dtype_bytes
    else:
        groups = head_dim // kv_cfg.group_size
        scales = 2 * groups * dtype_bytes  # a scale and a bias per group
        per_head = sum(4 * packed_dim(head_dim, b) + scales for b in (kv_cfg.k_bits, kv_cfg.v_bits))
    return n_full_attn_layers * n_kv_heads * per_head


def model_bytes_per_token(model: Any, kv_cfg: KvCfg | None) -> int:
    """`bytes_per_token` of a loaded Model (its activations' dtype: the final norm's); a generic-tier
    model (qnpipe.model.family.load.FamilyModel) says its own."""
    if hasattr(model, "kv_bytes_per_token"):
        return int(model.kv_bytes_per_token())
    args = model.args
    n_fa = sum(not args.is_linear(i) for i in range(args.num_hidden_layers))
    norm = model.model.norm
    if "weight" not in norm:  # a rank without the final norm (pipeline parallel): its layers' dtype is the same
        norm = next(layer.input_layernorm for layer in model.model.layers if "input_layernorm" in layer)
    return bytes_per_token(n_fa, args.num_key_value_heads, args.head_dim, norm.weight.dtype.size, kv_cfg)


class RotatedQuantizedKVCache:
    """One full-attention layer's cache of rotated, group-quantized keys (`k_bits`) and values (`v_bits`)."""

    def __init__(self, k_bits: int, v_bits: int, group_size: int, rot: mx.array | None):
        self.k_bits, self.v_bits, self.group_size = k_bits, v_bits, group_size
        self.rot = rot
        self.keys: tuple[mx.array, mx.array, mx.array] | None = None
        self.values: tuple[mx.array, mx.array, mx.array] | None = None
        self.offset = 0

    @classmethod
    def from_cfg(cls, kv_cfg: KvCfg, head_dim: int) -> RotatedQuantizedKVCache:
        rot = mx.array(rotation(head_dim, kv_cfg.rot_seed)) if kv_cfg.rotate else None
        return cls(kv_cfg.k_bits, kv_cfg.v_bits, kv_cfg.group_size, rot)

    def _rotate(self, x: mx.array, back: bool = False) -> mx.array:
        # In float32: R in bf16 is orthogonal only to ~3 digits, and the rotation must cancel.
        if self.rot is None:
            return x
        r = self.rot.T if back else self.rot
        return (x.astype(mx.float32) @ r).astype(x.dtype)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[tuple[mx.array, ...], tuple[mx.array, ...]]:
        """Quantize and append `keys`/`values [B, H, L, D]`; the packed cache so far."""
        B, H, L, D = keys.shape
        prev = self.offset
        kq = mx.quantize(self._rotate(keys), group_size=self.group_size, bits=self.k_bits)
        vq = mx.quantize(self._rotate(values), group_size=self.group_size, bits=self.v_bits)
        if self.keys is None or self.values is None or prev + L > self.keys[0].shape[-2]:
            n = (STEP + L - 1) // STEP * STEP

            def grow(old: tuple[mx.array, ...] | None, new: tuple[mx.array, ...]) -> tuple[mx.array, ...]:
                parts = tuple(mx.zeros((B, H, n, a.shape[-1]), dtype=a.dtype) for a in new)
                if old is None:
                    return parts
                return tuple(mx.concatenate([o[..., :prev, :], p], axis=-2) for o, p in zip(old, parts, strict=True))

            self.keys, self.values = grow(self.keys, kq), grow(self.values, vq)  # type: ignore[assignment]
        assert self.keys is not None and self.values is not None
        self.offset += L
        for buf, new in ((self.keys, kq), (self.values, vq)):
            for b, a in zip(buf, new, strict=True):
                b[..., prev:self.offset, :] = a
        return self.fetch()

    def fetch(self) -> tuple[tuple[mx.array, ...], tuple[mx.array, ...]]:
        assert self.keys is not None and self.values is not None
        n = self.offset
        return tuple(a[..., :n, :] for a in self.keys), tuple(a[..., :n, :] for a in self.values)

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any) -> mx.array:
        """Attention output `[B, Hq, L, D]` of `queries` over the cache after appending `keys`/`values`."""
        qk, qv = self.update_and_fetch(keys, values)
        B, Hq, L, D = queries.shape
        Hkv = qk[0].shape[1]
        rep = Hq // Hkv
        q = self._rotate(queries) * scale
        if rep > 1:
            q = q.reshape(B, Hkv, rep, L, D)
            qk = tuple(mx.expand_dims(a, -3) for a in qk)
            qv = tuple(mx.expand_dims(a, -3) for a in qv)
        scores = mx.quantized_matmul(q, *qk, transpose=True, group_size=self.group_size, bits=self.k_bits)
        if mask is not None:
            if isinstance(mask, str):
                kL = scores.shape[-1]
                mask = mx.arange(kL - L, kL)[:, None] >= mx.arange(kL)[None]
            elif rep > 1 and mask.ndim > 3:
                mask = mx.expand_dims(mask, -3)
            if mask.dtype == mx.bool_:
                scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
            else:
                scores = scores + mask
        p = mx.softmax(scores, axis=-1, precise=True)
        out = mx.quantized_matmul(p, *qv, transpose=False, group_size=self.group_size, bits=self.v_bits)
        if rep > 1:
            out = out.reshape(B, Hq, L, D)
        return self._rotate(out, back=True)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> Any:
        if window_size is not None or (return_array and N > 1):
            return create_causal_mask(N, self.offset, window_size=window_size)
        return None if N == 1 else "causal"

    @property
    def state(self) -> list[mx.array]:
        return [*(self.keys or ()), *(self.values or ())]

    def size(self) -> int:
        return self.offset

    @property
    def nbytes(self) -> int:
        """Bytes held for the tokens so far (the preallocated tail not counted)."""
        if self.keys is None:
            return 0
        k, v = self.fetch()
        return sum(a.nbytes for a in (*k, *v))

    # -- prefix snapshots (qnpipe.model.snapshots)
    def snapshot(self) -> LayerState:
        k, v = self.fetch()
        rot = () if self.rot is None else (self.rot,)
        return LayerState(f"qkv:{self.k_bits}:{self.v_bits}:{self.group_size}", (*k, *v, *rot), self.offset)

    @classmethod
    def restore(cls, state: LayerState) -> RotatedQuantizedKVCache:
        _, kb, vb, g = state.kind.split(":")
        a = [mx.array(x) for x in state.arrays]
        c = cls(int(kb), int(vb), int(g), a[6] if len(a) == 7 else None)
        c.keys, c.values = (a[0], a[1], a[2]), (a[3], a[4], a[5])
        c.offset = state.offset
        return c


register_kind("qkv", RotatedQuantizedKVCache)


def kv_factory(kv_cfg: KvCfg, head_dim: int) -> Any:
    """A maker of full-attention caches for `Model.make_cache` (checked against `head_dim` now)."""
    check_kv_cfg(kv_cfg, head_dim)
    rot = mx.array(rotation(head_dim, kv_cfg.rot_seed)) if kv_cfg.rotate else None
    return lambda: RotatedQuantizedKVCache(kv_cfg.k_bits, kv_cfg.v_bits, kv_cfg.group_size, rot)
