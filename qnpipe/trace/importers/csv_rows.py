"""`csv`: a generic routing table, one row per (step, layer, chosen expert), for logs of any other tool.

    step,layer,expert,score
    0,0,5,0.61
    0,0,2,0.39
    0,1,7,0.55
    ...

The header line is required; it names the columns `step`, `layer`, `expert` and, optionally,
`score` (the gate weight), in any order. The rows of one (step, layer) are one token's top-k, in
the router's order; k must be the same for every (step, layer) of the file (a log has one
top_k). Rows may come in any order: steps are ordered by their value and renumbered from 1,
and a step may lack some layers. The model's shape is inferred: the layers seen are its MoE
layers, `num_experts` is the largest expert id + 1 unless given (`experts=`, `--experts N`:
then every id must be below it), `hidden_size` 0 (unknown). The file is one request.
Values may be quoted; a `.csv.gz` is read gunzipped (no further than MAX_RATIO times its compressed
bytes: qnpipe.trace.importers.common). Each row also takes ROW_BYTES from the import's byte budget
(`--max-bytes`) as it is read, each (step, layer) group ROUTE_BYTES: a row is a few bytes, its
columns in memory ~200, its route ~150, and the budget bounds the import's memory.

Several files (`import_csv_files`) are one table split in files, e.g. one per layer: their rows
are matched by their step values (a layer may lack a step another has), and no layer may be in
two files.
"""

from __future__ import annotations

import math
from array import array
from pathlib import Path
from typing import NamedTuple

import numpy as np

from qnpipe.errors import TraceImportError
from qnpipe.trace.format import MAX_EXPERTS, MAX_LAYERS, ModelShape
from qnpipe.trace.importers.common import (
    MAX_BYTES,
    Budget,
    Imported,
    LayerRoute,
    Options,
    Progress,
    Request,
    jsonl_lines,
    resolve_shape,
)

COLUMNS = ("step", "layer", "expert", "score")
# A step value's bounds: it orders rows only, but a sane range keeps the numpy keys in int64.
MAX_STEP = 1 << 40
# What one (step, layer)'s route costs in memory (its LayerRoute, tuples, list slot), taken from the import's budget.
ROUTE_BYTES = 160
# What one row costs in memory at the peak of the import (its columns as read, concatenated, sorted and
# reordered: ~25 int64s; 1M rows measured 220 MB), taken from the budget as each row is read, so that the
# budget bounds the memory.
ROW_BYTES = 200


def _fields(line: bytes) -> list[str]:
    return [f.strip().strip('"').strip() for f in line.decode("utf-8", "replace").lstrip("\ufeff").split(",")]


def import_csv(src: Path, progress: Progress | None = None, budget: Budget | None = None,
               opts: Options | None = None) -> Imported:
    return import_csv_files([src], progress, budget, opts)


def import_csv_files(srcs: list[Path], progress: Progress | None = None, budget: Budget | None = None,
                     opts: Options | None = None) -> Imported:
    """The files' rows as one table (their steps matched by value); a layer in two files is an error naming both."""
    opts = opts or Options()
    budget = budget or Budget(MAX_BYTES)
    if opts.batched:
        raise TraceImportError(f"{srcs[0]}: --batched does not apply to csv: its steps are already the log's steps "
                               f"(one token per (step, layer))")
    parts = [_rows(src, progress, budget, opts) for src in srcs]
    owner: dict[int, Path] = {}
    for src, part in zip(srcs, parts, strict=True):
        for layer in np.unique(part.layer).tolist():
            if layer in owner:
                raise TraceImportError(f"{src}: layer {layer} is also in {owner[layer]}: the files of one run must "
                                       f"hold different layers")
            owner[layer] = src
    scores = [p.score for p in parts if p.score is not None]
    if 0 < len(scores) < len(parts):
        bare = next(s for s, p in zip(srcs, parts, strict=True) if p.score is None)
        scored = next(s for s, p in zip(srcs, parts, strict=True) if p.score is not None)
        raise TraceImportError(f"{bare}: no score column, {scored} has one")
    whole = _Rows(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("step", "layer", "expert", "line")),
                  score=np.concatenate(scores) if scores else None)
    fileno = np.repeat(np.arange(len(parts)), [len(p.step) for p in parts])
    return _group(srcs, fileno, whole, opts.experts, budget, opts)


class _Rows(NamedTuple):
    """A file's rows, column by column; `line` is each row's line number, `score` None without that column."""

    step: np.ndarray
    layer: np.ndarray
    expert: np.ndarray
    line: np.ndarray
    score: np.ndarray | None


def _rows(src: Path, progress: Progress | None, budget: Budget | None, opts: Options) -> _Rows:
    budget = budget or Budget(MAX_BYTES)
    lines = jsonl_lines(src, progress, budget)
    first = next(lines, None)
    if first is None:
        raise TraceImportError(f"{src}: empty: no header line (step,layer,expert[,score])")
    n, line = first
    names = [f.lower() for f in _fields(line)]
    for f in names:
        if f not in COLUMNS:
            raise TraceImportError(f"{src}: line {n}: column {f!r}: unknown; the header names step, layer, expert "
                                   f"and optionally score (the header line is required)")
    if len(set(names)) != len(names):
        raise TraceImportError(f"{src}: line {n}: a column named twice in {names}")
    if missing := [c for c in COLUMNS[:3] if c not in names]:
        raise TraceImportError(f"{src}: line {n}: no {' or '.join(missing)} column (the header line is required: "
                               f"step,layer,expert[,score])")
    col = {c: names.index(c) for c in names}
    scored = "score" in col
    steps, layers, experts, rows = array("q"), array("q"), array("q"), array("q")
    scores = array("d")
    limit = opts.experts if opts.experts is not None else MAX_EXPERTS
    for n, line in lines:
        f = _fields(line)
        if len(f) != len(names):
            raise TraceImportError(f"{src}: line {n}: {len(f)} fields, the header has {len(names)}")
        try:
            step, layer, expert = (int(f[col[c]]) for c in COLUMNS[:3])
        except ValueError:
            bad = next(c for c in COLUMNS[:3] if not _is_int(f[col[c]]))
            raise TraceImportError(f"{src}: line {n}: {bad} {f[col[bad]]!r}: not an integer") from None
        if not 0 <= layer < MAX_LAYERS:
            raise TraceImportError(f"{src}: line {n}: layer {layer}: outside 0..{MAX_LAYERS - 1}")
        if not 0 <= expert < limit:
            given = " (--experts)" if opts.experts is not None else ""
            raise TraceImportError(f"{src}: line {n}: expert {expert}: outside 0..{limit - 1}{given}")
        if not -MAX_STEP <= step <= MAX_STEP:
            raise TraceImportError(f"{src}: line {n}: step {step}: outside -2**40..2**40")
        if scored:
            try:
                score = float(f[col["score"]])
            except ValueError:
                raise TraceImportError(f"{src}: line {n}: score {f[col['score']]!r}: not a number") from None
            if not math.isfinite(score):
                raise TraceImportError(f"{src}: line {n}: score {score}: not finite")
            scores.append(score)
        budget.take(ROW_BYTES, f"{src}: line {n} (its columns)")
        steps.append(step)
        layers.append(layer)
        experts.append(expert)
        rows.append(n)
    if not steps:
        raise TraceImportError(f"{src}: no rows after the header")
    return _Rows(np.frombuffer(steps, np.int64), np.frombuffer(layers, np.int64), np.frombuffer(experts, np.int64),
                 np.frombuffer(rows, np.int64), np.frombuffer(scores, np.float64) if scored else None)


def _is_int(s: str) -> bool:
    try:
        int(s)
    except ValueError:
        return False
    return True


def _group(srcs: list[Path], fileno: np.ndarray, rows: _Rows, experts: int | None, budget: Budget,
           opts: Options | None = None) -> Imported:
    step, layer, expert, row, score = rows
    order = np.lexsort((row, layer, step))  # by (step, layer), each group's rows in file order (one file per layer)
    step, layer, expert, row, fileno = step[order], layer[order], expert[order], row[order], fileno[order]
    new = np.ones(len(step), dtype=bool)
    new[1:] = (step[1:] != step[:-1]) | (layer[1:] != layer[:-1])
    starts = np.flatnonzero(new)
    sizes = np.diff(np.append(starts, len(step)))
    k = int(sizes[0])
    if (other := np.flatnonzero(sizes != k)).size:
        g = int(other[0])
        there = "" if fileno[starts[g]] == fileno[0] else f" of {srcs[fileno[0]].name}"
        raise TraceImportError(f"{srcs[fileno[starts[g]]]}: line {row[starts[g]]}: (step {step[starts[g]]}, layer "
                               f"{layer[starts[g]]}) has {sizes[g]} experts, (step {step[0]}, layer {layer[0]}) at line "
                               f"{row[0]}{there} has {k}: a log has one top-k, the same for every (step, layer)")
    grid = expert.reshape(-1, k)
    srt = np.sort(grid, axis=1)
    if (dup := np.flatnonzero((srt[:, 1:] == srt[:, :-1]).any(axis=1))).size:
        g = int(dup[0])
        ids = grid[g].tolist()
        i = next(i for i, e in enumerate(ids) if e in ids[:i])
        again, where = int(row.reshape(-1, k)[g][i]), srcs[fileno.reshape(-1, k)[g][i]]
        raise TraceImportError(f"{where}: line {again}: (step {step[starts[g]]}, layer {layer[starts[g]]}): expert "
                               f"ids {grid[g].tolist()}: an expert chosen twice")
    # a row of a few bytes becomes a route of ~150: charged, so that the budget still bounds the memory
    budget.take(len(starts) * ROUTE_BYTES, f"{srcs[0]}: the routes of {len(starts)} (step, layer) groups")
    moe = tuple(int(x) for x in np.unique(layer))
    shape = ModelShape(num_layers=moe[-1] + 1, moe_layers=moe, num_experts=experts or int(expert.max()) + 1, top_k=k,
                       hidden_size=0)
    if opts is not None and opts.shape is not None:  # --shape or --num-experts/--top-k: the rows must fit it
        shape = resolve_shape(str(srcs[0]), shape, opts)
        if k != shape.top_k or (bad := sorted(set(moe) - set(shape.moe_layers))) or expert.max() >= shape.num_experts:
            why = (f"{k} experts per (step, layer), the shape routes to top_k={shape.top_k}" if k != shape.top_k
                   else f"layers {bad} are not MoE layers of the shape" if bad
                   else f"expert id {int(expert.max())} outside 0..{shape.num_experts - 1}")
            raise TraceImportError(f"{srcs[0]}: {why} (--shape, --num-experts, --top-k, --num-layers)")
    weights = score[order].reshape(-1, k) if score is not None else None
    out: list[list[LayerRoute]] = []
    group_step = step[starts]
    group_layer = layer[starts].tolist()
    for g, ids in enumerate(grid.tolist()):
        if g == 0 or group_step[g] != group_step[g - 1]:
            out.append([])
        w = tuple(weights[g].tolist()) if weights is not None else ()
        out[-1].append(LayerRoute(group_layer[g], tuple(ids), w))
    return Imported(shape=shape, requests=[Request(srcs[0].name, out)], skipped={}, sources=srcs)
