"""`vllm-jsonl`: the vLLM MoE-logger files (weiran0129/vLLM-MoE-Logger, TotaniYash/vllm_moe_routelogging_patch).

Line 1 is `{"type": "meta", "model_id", "top_k", "layers_logged", ...}`; every later line is
`{"type": "route", "token_idx", "layer", "topk_ids", "topk_weights", "req_id"}`, where
`token_idx` is the row inside one forward batch: it restarts at 0 with each layer's pass, and
a layer not above the previous pass's layer starts the next forward pass. `req_id` is the
logger's constant, not a request.

A forward pass whose rows all chose the same experts is one of vLLM's profiling (dummy) passes:
dropped; one that follows real passes starts a new run (the logger appends runs to one file).
In a run, the batch width B is the most common pass size: B requests decoding together. Rows
map to requests only in the first unbroken stretch of B-row passes (row i = request i, one
token per pass), so those passes become the B requests, one after another in the log. The
larger passes before them (the batched prefill, warm-up) cannot be split among the requests
(unless B = 1) and the smaller ones after (requests finished, rows re-packed) cannot be
attributed: both are dropped and counted in the summary's `skipped`.

Batched (`Options.batched`, `--batched`): every pass but the profiling ones is one step of all
its rows, in row order, the run one request: the batch as the engine ran it (prefill, warm-up
and the narrower passes at the end included), not its requests one after another.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import msgspec

from qnpipe.errors import TraceImportError
from qnpipe.trace.importers.common import (
    VLLM_MODELS,
    Budget,
    Imported,
    LayerRoute,
    Options,
    Progress,
    Request,
    check_route,
    decode_line,
    jsonl_lines,
    known_shape,
    resolve_shape,
)

DUMMY = "rows of vLLM profiling (dummy) passes"
BEFORE = "rows of passes wider than the batch (prefill, warm-up: not attributable to one request)"
AFTER = "rows of passes after the first request finished (rows re-packed: not attributable)"


class VllmMeta(msgspec.Struct, frozen=True, tag_field="type", tag="meta"):
    model_id: str
    top_k: int
    layers_logged: list[int] = []


class VllmRoute(msgspec.Struct, frozen=True, tag_field="type", tag="route"):
    token_idx: int
    layer: int
    topk_ids: list[int]
    topk_weights: list[float]


_DECODER = msgspec.json.Decoder(VllmMeta | VllmRoute)

Pass = list[tuple[int, list[tuple[tuple[int, ...], tuple[float, ...]]]]]  # [(layer, rows of (ids, weights))]


def import_vllm_jsonl(src: Path, progress: Progress | None = None, budget: Budget | None = None,
                      opts: Options | None = None) -> Imported:
    lines = jsonl_lines(src, progress, budget)
    first = next(lines, None)
    if first is None:
        raise TraceImportError(f"{src}: empty: no meta line")
    n, line = first
    meta = decode_line(src, n, line, _DECODER)
    if not isinstance(meta, VllmMeta):
        raise TraceImportError(f"{src}: line {n}: the first record must be the meta line (\"type\": \"meta\")")
    known = known_shape(meta.model_id, VLLM_MODELS)  # a quantized or renamed variant of a known id too
    # no layers from layers_logged: the per-layer files of one run each list their own, and merge wants one shape
    shape = resolve_shape(f"{src}: line {n}", known[1] if known else None, opts, model=meta.model_id,
                          field="model_id")
    if meta.top_k != shape.top_k:
        raise TraceImportError(f"{src}: line {n}: top_k={meta.top_k}, {meta.model_id} routes to {shape.top_k}"
                               + (" (--top-k)" if opts is not None and opts.shape is not None else ""))
    logged = set(meta.layers_logged)  # a set: the meta line may list many layers, each row looks one up
    passes: list[Pass] = []
    for n, line in lines:
        r = decode_line(src, n, line, _DECODER)
        if isinstance(r, VllmMeta):
            raise TraceImportError(f"{src}: line {n}: a second meta line")
        if logged and r.layer not in logged:
            raise TraceImportError(f"{src}: line {n}: layer {r.layer} is not in the meta line's layers_logged "
                                   f"{meta.layers_logged}")
        check_route(src, f"line {n}", shape, r.layer, r.topk_ids, r.topk_weights)
        row = (tuple(r.topk_ids), tuple(r.topk_weights))
        if r.token_idx == 0:
            if passes and len(passes[-1][-1][1]) != len(passes[-1][0][1]):
                raise TraceImportError(f"{src}: line {n - 1}: layer {passes[-1][-1][0]}'s pass has "
                                       f"{len(passes[-1][-1][1])} rows, layer {passes[-1][0][0]}'s "
                                       f"{len(passes[-1][0][1])}: one forward pass has one batch")
            if not passes or r.layer <= passes[-1][-1][0]:
                passes.append([])
            passes[-1].append((r.layer, [row]))
        elif passes and r.token_idx == len(passes[-1][-1][1]):
            passes[-1][-1][1].append(row)
        else:
            want = len(passes[-1][-1][1]) if passes else 0
            raise TraceImportError(f"{src}: line {n}: token_idx {r.token_idx}, expected {want} or 0 "
                                   f"(rows of a pass count from 0)")
    if passes and len(passes[-1][-1][1]) != len(passes[-1][0][1]):
        raise TraceImportError(f"{src}: the last pass of layer {passes[-1][-1][0]} has {len(passes[-1][-1][1])} "
                               f"rows, layer {passes[-1][0][0]}'s {len(passes[-1][0][1])}: truncated?")
    requests, skipped = _requests(passes, batched=bool(opts and opts.batched))
    return Imported(shape=shape, requests=requests, skipped={k: v for k, v in skipped.items() if v}, sources=[src])


def _rows(p: Pass) -> int:
    return len(p[0][1])


def _is_dummy(p: Pass) -> bool:
    return _rows(p) > 1 and all(len({frozenset(ids) for ids, _ in rows}) == 1 for _, rows in p)


def _requests(passes: list[Pass], *, batched: bool = False) -> tuple[list[Request], dict[str, int]]:
    skipped: dict[str, int] = dict.fromkeys((DUMMY, BEFORE, AFTER), 0)
    runs: list[list[Pass]] = [[]]
    for p in passes:
        if _is_dummy(p):
            skipped[DUMMY] += _rows(p) * len(p)
            if runs[-1]:
                runs.append([])
        else:
            runs[-1].append(p)
    requests: list[Request] = []
    if batched:
        return [Request(f"run {r}", [[_join(layer, rows) for layer, rows in p] for p in run])
                for r, run in enumerate(x for x in runs if x)], skipped
    for r, run in enumerate(x for x in runs if x):
        sizes = Counter(_rows(p) for p in run)
        width = max(sizes, key=lambda s: (sizes[s], s))
        start = next(i for i, p in enumerate(run) if _rows(p) == width)
        end = next((i for i in range(start, len(run)) if _rows(run[i]) != width), len(run))
        before = [] if width == 1 else run[:start]
        skipped[BEFORE] += sum(_rows(p) * len(p) for p in before)
        skipped[AFTER] += sum(_rows(p) * len(p) for p in run[end:])
        lead = [] if width > 1 else [[_join(layer, rows) for layer, rows in p] for p in run[:start]]
        for row in range(width):
            steps = [[LayerRoute(layer, *rows[row]) for layer, rows in p] for p in run[start:end]]
            requests.append(Request(f"run {r} row {row}", lead + steps))
    return requests, skipped


def _join(layer: int, rows: list[tuple[tuple[int, ...], tuple[float, ...]]]) -> LayerRoute:
    return LayerRoute(layer, tuple(e for ids, _ in rows for e in ids), tuple(w for _, ws in rows for w in ws))
