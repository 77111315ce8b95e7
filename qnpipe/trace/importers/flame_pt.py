"""`flame-pt`: FLAME-MoE routing captures (`.pt` files, one layer each), read without torch.

Each file is a dict: `model`, `layer` (the source's decoder-layer number), `samples` (int64 [N]
token ids), `scores` (float32 [N, k], the chosen experts' softmax probabilities) and `indices`
(int64 [N, k]), plus its layout:

- `num_sequences` S and `sequence_length` T (the "encoder" captures): N = S x T tokens,
  sequence-major. Each sequence is a request of T steps, one token each (a causal model routes
  a teacher-forced sequence as it would decode it).
- `token_position` p (the "decoder" captures): N sequences at position p. The files of
  positions 0..P-1 stack into N requests of P steps.

SRC is one file or a directory searched for `*.pt`; its files must share one layout, and every
step must have every layer (layers are kept as the source numbers them).

Batched (`Options.batched`): the sequences decode together, one step per position routing
every sequence's token of that position (S tokens a step), as one request.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np

from qnpipe.errors import TraceImportError
from qnpipe.trace.format import ModelShape
from qnpipe.trace.importers import torch_zip
from qnpipe.trace.importers.common import (
    FLAME_MOE_290M,
    MAX_BYTES,
    Budget,
    Imported,
    LayerRoute,
    Options,
    Progress,
    Request,
    known_shape,
    lockstep,
    resolve_shape,
)

# FLAME-MoE-290M-1.3B (cmu-flame; CMU-FLAME/FLAME-MoE-Traces README, its release launcher): 9 layers of hidden
# size 1024, layer 1 dense and 2..9 MoE (Megatron numbers them from 1, as the captures do), 64 routed experts
# top-6 plus 2 shared (not logged). num_layers = 10 so that the source's numbers are valid indices.
FLAME_MODELS = {"flame-moe-290m": FLAME_MOE_290M}


class FlameMeta(msgspec.Struct, frozen=True):
    model: str
    layer: int
    num_sequences: int | None = None
    sequence_length: int | None = None
    token_position: int | None = None


class _Capture(msgspec.Struct, frozen=True):
    path: Path
    meta: FlameMeta
    samples: np.ndarray
    scores: np.ndarray
    indices: np.ndarray


def _read(path: Path, budget: Budget) -> _Capture:
    obj = torch_zip.load(path, budget)
    if not isinstance(obj, dict):
        raise TraceImportError(f"{path}: holds a {type(obj).__name__}, a FLAME capture is a dict")
    arrays = {k: obj.get(k) for k in ("samples", "scores", "indices")}
    try:
        meta = msgspec.convert({k: v for k, v in obj.items() if k not in arrays and isinstance(k, str)}, FlameMeta)
    except msgspec.ValidationError as e:
        raise TraceImportError(f"{path}: {e}") from None
    for k, v in arrays.items():
        if not isinstance(v, np.ndarray):
            raise TraceImportError(f"{path}: key {k!r} is missing or not a tensor")
    samples, scores, indices = (np.asarray(arrays[k]) for k in ("samples", "scores", "indices"))
    if samples.ndim != 1 or indices.ndim != 2 or scores.shape != indices.shape or len(indices) != len(samples):
        raise TraceImportError(f"{path}: shapes samples {samples.shape}, scores {scores.shape}, indices "
                               f"{indices.shape}: want [N], [N, k], [N, k]")
    # ids cast from floats would be truncated silently: the captures hold integer ids and float scores
    for k, v, kinds in (("samples", samples, "iu"), ("indices", indices, "iu"), ("scores", scores, "f")):
        if v.dtype.kind not in kinds or v.dtype == np.bool_:
            raise TraceImportError(f"{path}: {k} are {v.dtype}: want {'integers' if kinds == 'iu' else 'floats'}")
    for name in ("num_sequences", "sequence_length"):
        if (v := getattr(meta, name)) is not None and v < 1:
            raise TraceImportError(f"{path}: {name} {v}: want at least 1")
    if meta.token_position is not None and meta.token_position < 0:
        raise TraceImportError(f"{path}: token_position {meta.token_position}: want at least 0")
    # the widened copies are held until the requests are built: charged like the tensors they come from
    budget.take(scores.size * 8 + indices.size * 8, f"{path}: scores and indices as float64 and int64")
    return _Capture(path, meta, samples, scores.astype(np.float64), indices.astype(np.int64))


def _check(c: _Capture, shape: ModelShape) -> None:
    why = None
    if c.meta.layer not in shape.moe_layers:
        why = f"layer {c.meta.layer} is not a MoE layer of {c.meta.model} {list(shape.moe_layers)}"
    elif c.indices.shape[1] != shape.top_k:
        why = f"indices {c.indices.shape}: {c.meta.model} routes each token to top_k={shape.top_k}"
    elif c.indices.size and (c.indices.min() < 0 or c.indices.max() >= shape.num_experts):
        row = int(np.nonzero((c.indices < 0).any(1) | (c.indices >= shape.num_experts).any(1))[0][0])
        why = f"token {row}: expert ids {c.indices[row].tolist()} outside 0..{shape.num_experts - 1}"
    elif dup := np.nonzero((np.sort(c.indices, axis=1)[:, 1:] == np.sort(c.indices, axis=1)[:, :-1]).any(1))[0].tolist():
        why = f"token {dup[0]}: expert ids {c.indices[dup[0]].tolist()}: an expert chosen twice"
    if why is not None:
        raise TraceImportError(f"{c.path}: {why}")


def import_flame_pt(src: Path, progress: Progress | None = None, budget: Budget | None = None,
                    opts: Options | None = None) -> Imported:
    budget = budget or Budget(MAX_BYTES)
    files = sorted(src.rglob("*.pt")) if src.is_dir() else [src]
    if not files:
        raise TraceImportError(f"{src}: no .pt files")
    caps = []
    for f in files:
        caps.append(_read(f, budget))
        if progress is not None:
            progress(f.stat().st_size)
    models = {c.meta.model for c in caps}
    if len(models) > 1:
        raise TraceImportError(f"{src}: captures of several models {sorted(models)}")
    model = models.pop()
    known = known_shape(model, FLAME_MODELS)
    shape = resolve_shape(str(caps[0].path), known[1] if known else None, opts, model=model,
                          layers=sorted({c.meta.layer for c in caps}))
    for c in caps:
        _check(c, shape)
    encoder = [c for c in caps if c.meta.sequence_length is not None]
    decoder = [c for c in caps if c.meta.token_position is not None and c.meta.sequence_length is None]
    if encoder and decoder:
        raise TraceImportError(f"{src}: mixes sequence captures ({encoder[0].path.name}) and token-position "
                               f"captures ({decoder[0].path.name}): import each folder on its own")
    if not encoder and not decoder:
        raise TraceImportError(f"{caps[0].path}: neither sequence_length nor token_position: unknown layout")
    requests = _sequences(encoder) if encoder else _positions(decoder)
    if opts is not None and opts.batched:
        requests = [lockstep(requests, f"{len(requests)} sequences")]
    return Imported(shape=shape, requests=requests, skipped={}, sources=files)


def _by_layer(caps: list[_Capture]) -> dict[int, _Capture]:
    out: dict[int, _Capture] = {}
    for c in caps:
        if c.meta.layer in out:
            raise TraceImportError(f"{c.path}: layer {c.meta.layer} again (also in {out[c.meta.layer].path})")
        out[c.meta.layer] = c
    first = next(iter(out.values()))
    for c in out.values():
        if not np.array_equal(c.samples, first.samples):
            raise TraceImportError(f"{c.path}: its token ids differ from {first.path.name}'s: not the same tokens")
    return dict(sorted(out.items()))


def _sequences(caps: list[_Capture]) -> list[Request]:
    layers = _by_layer(caps)
    first = next(iter(layers.values()))
    s, t = first.meta.num_sequences, first.meta.sequence_length
    for c in layers.values():
        if (c.meta.num_sequences, c.meta.sequence_length) != (s, t) or s is None or t is None or s * t != len(c.samples):
            raise TraceImportError(f"{c.path}: {c.meta.num_sequences} sequences x {c.meta.sequence_length} tokens "
                                   f"do not fit its {len(c.samples)} tokens or {first.path.name}'s layout")
    assert s is not None and t is not None
    return [Request(f"sequence {q}", [[_route(c, q * t + i) for c in layers.values()] for i in range(t)])
            for q in range(s)]


def _positions(caps: list[_Capture]) -> list[Request]:
    by_pos: dict[int, list[_Capture]] = {}
    for c in caps:
        assert c.meta.token_position is not None
        by_pos.setdefault(c.meta.token_position, []).append(c)
    if sorted(by_pos) != list(range(len(by_pos))):
        raise TraceImportError(f"token positions {sorted(by_pos)}: want 0..{len(by_pos) - 1}, each once")
    steps = [_by_layer(by_pos[p]) for p in range(len(by_pos))]
    first = next(iter(steps[0].values()))
    for p, layers in enumerate(steps):
        c = next(iter(layers.values()))
        if list(layers) != list(steps[0]) or len(c.samples) != len(first.samples):
            raise TraceImportError(f"{c.path}: position {p} has layers {list(layers)} of {len(c.samples)} "
                                   f"sequences, position 0 has {list(steps[0])} of {len(first.samples)}")
    return [Request(f"sequence {q}", [[_route(c, q) for c in layers.values()] for layers in steps])
            for q in range(len(first.samples))]


def _route(c: _Capture, row: int) -> LayerRoute:
    return LayerRoute(c.meta.layer, tuple(c.indices[row].tolist()), tuple(c.scores[row].tolist()))
