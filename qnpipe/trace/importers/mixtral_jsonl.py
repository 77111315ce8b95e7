"""`mixtral-jsonl`: the Mario928/speculative-moe logs of Mixtral-8x7B (one JSON record per (token, layer)).

Two layouts, told apart by their position key:

- `token_idx` (`humaneval_2_routing.jsonl`): decode tokens only, grouped by (problem, layer);
  `token_idx` counts each (problem, layer)'s records from 0. Each problem is a request; step i
  holds token i of every layer that has one.
- `token_pos` (`routing_raw.jsonl`): the raw log in time order. A layer's block of records with
  rising `token_pos` is one forward pass of that layer; a layer not above the previous one
  starts the next step. The first step is the prefill (all prompt tokens), then one step per
  decoded token.

The logger skipped tokens whose two gates were exactly [0.5, 0.5] (SOURCES.md), so a layer can
lack a few tokens. With `token_pos` the gap is exact (that layer's route has fewer tokens, or
that layer is absent from that step); with `token_idx` it is not (the layer's later tokens
shift by the tokens it lacks, and its last step(s) have no route). Both are counted in the
summary's `skipped`.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from qnpipe.errors import TraceImportError
from qnpipe.trace.importers.common import (
    MIXTRAL_8X7B,
    Budget,
    Imported,
    LayerRoute,
    Options,
    Progress,
    Request,
    check_route,
    decode_line,
    jsonl_lines,
    resolve_shape,
)

MISSING = "(token, layer) routes missing from the source (its logger drops [0.5, 0.5] gates)"
# A forward pass's positions: the tokens a gap in them stands for are counted as missing, so an absurd
# position would report absurd counts. Far beyond any context length.
MAX_POSITION = 1 << 24


class MixtralRecord(msgspec.Struct, frozen=True):
    layer: int
    experts: list[int]
    gating_probs: list[float]
    problem_id: int | str = 0
    dataset: str = ""
    token_idx: int | None = None
    token_pos: int | None = None


_DECODER = msgspec.json.Decoder(MixtralRecord)


def import_mixtral_jsonl(src: Path, progress: Progress | None = None, budget: Budget | None = None,
                         opts: Options | None = None) -> Imported:
    if opts is not None and opts.batched:
        raise TraceImportError(f"{src}: --batched does not apply to mixtral-jsonl: the source does not record which "
                               f"requests ran together (routing_raw.jsonl is one request, its prefill one step)")
    shape = resolve_shape(str(src), MIXTRAL_8X7B, opts)  # Mixtral-8x7B's unless --shape or --num-experts/--top-k
    layout: str | None = None
    per_layer: dict[tuple[str, int | str], dict[int, list[LayerRoute]]] = {}  # token_idx layout
    timed: list[tuple[str, list[dict[int, list[tuple[int, LayerRoute]]]]]] = []  # token_pos layout
    key_prev: tuple[str, int | str] | None = None
    prev: tuple[int, int] = (-1, -1)  # (layer, token_pos) of the previous record
    for n, line in jsonl_lines(src, progress, budget):
        r = decode_line(src, n, line, _DECODER)
        mine = "token_idx" if r.token_idx is not None else "token_pos" if r.token_pos is not None else None
        if mine is None:
            raise TraceImportError(f"{src}: line {n}: neither token_idx nor token_pos: not a mixtral-jsonl record")
        if layout is None:
            layout = mine
        elif mine != layout:
            raise TraceImportError(f"{src}: line {n}: has {mine}, the lines before have {layout}: mixed layouts")
        check_route(src, f"line {n}", shape, r.layer, r.experts, r.gating_probs)
        lr = LayerRoute(r.layer, tuple(r.experts), tuple(r.gating_probs))
        key = (r.dataset, r.problem_id)
        if r.token_idx is not None:
            layers = per_layer.setdefault(key, {})
            got = layers.setdefault(r.layer, [])
            if r.token_idx != len(got):
                raise TraceImportError(f"{src}: line {n}: token_idx {r.token_idx} at layer {r.layer} of problem "
                                       f"{r.problem_id}, expected {len(got)} (each (problem, layer) counts from 0)")
            got.append(lr)
            continue
        assert r.token_pos is not None
        if not 0 <= r.token_pos < MAX_POSITION:
            raise TraceImportError(f"{src}: line {n}: token_pos {r.token_pos}: outside 0..{MAX_POSITION - 1}")
        if key != key_prev:
            timed.append((_name(key), []))
            key_prev, prev = key, (-1, -1)
        steps = timed[-1][1]
        same_block = r.layer == prev[0] and r.token_pos > prev[1]
        if not steps or not (same_block or r.layer > prev[0]):
            steps.append({})
        steps[-1].setdefault(r.layer, []).append((r.token_pos, lr))
        prev = (r.layer, r.token_pos)
    if layout == "token_idx":
        requests, missing = _from_counters(per_layer, len(shape.moe_layers))
    else:
        requests, missing = _from_blocks(timed, len(shape.moe_layers))
    return Imported(shape=shape, requests=requests, skipped={MISSING: missing} if missing else {}, sources=[src])


def _name(key: tuple[str, int | str]) -> str:
    dataset, pid = key
    return f"{dataset}/{pid}" if dataset else str(pid)


def _from_counters(per_layer: dict[tuple[str, int | str], dict[int, list[LayerRoute]]],
                   moe: int) -> tuple[list[Request], int]:
    requests, missing = [], 0
    for key, layers in per_layer.items():
        n = max(len(v) for v in layers.values())
        missing += sum(n - len(v) for v in layers.values()) + n * (moe - len(layers))
        steps = [[layers[layer][i] for layer in sorted(layers) if i < len(layers[layer])] for i in range(n)]
        requests.append(Request(_name(key), steps))
    return requests, missing


def _from_blocks(timed: list[tuple[str, list[dict[int, list[tuple[int, LayerRoute]]]]]],
                 moe: int) -> tuple[list[Request], int]:
    requests, missing = [], 0
    for name, steps in timed:
        out = []
        for step in steps:
            tokens = max(pos for block in step.values() for pos, _ in block) + 1
            missing += sum(tokens - len(block) for block in step.values()) + tokens * (moe - len(step))
            out.append([LayerRoute(layer, tuple(e for _, lr in step[layer] for e in lr.experts),
                                   tuple(w for _, lr in step[layer] for w in lr.weights))
                        for layer in sorted(step)])
        requests.append(Request(name, out))
    return requests, missing
