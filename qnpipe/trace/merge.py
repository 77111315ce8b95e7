"""One log from the per-rank logs of a distributed run (`qnpipe trace merge`).

Each rank of a run started with `--distributed` writes its own event or routing log
(`FILE.rank<N>.qtrace`, docs/distributed.md) holding the records of its own layers, timed by
its own trio clock. Merged, they read as the log of one process: every rank's times moved
onto the first rank's clock through the wall-clock reading each header holds, records
interleaved by (time, rank), the header's layers and capacities the union of the ranks'.
The result is an ordinary log: `trace stats`, `trace plot`, `replay` and `sweep` take it.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from pathlib import Path

import msgspec

from qnpipe.errors import TraceSchemaError
from qnpipe.trace.format import SCHEMA_VERSION, Header, Record, RunPart, TraceWriter, read_all

_RANK = re.compile(r"\.rank(\d+)(\.[^.]*)?$")


class Merged(msgspec.Struct, frozen=True, kw_only=True):
    """What `merge` wrote: the ranks in the order their logs were taken, and the record count."""

    path: str
    ranks: tuple[int, ...]
    records: int
    dropped: int


def rank_of(path: Path) -> int | None:
    """The rank a distributed run wrote `path` for (`...rank<N>.<ext>`), or None."""
    m = _RANK.search(path.name)
    return int(m.group(1)) if m else None


def _ranks(paths: Sequence[Path], headers: Sequence[Header]) -> list[int]:
    runs = [_run(h) for h in headers]
    if all(r is not None for r in runs):
        return [r.rank for r in runs if r is not None]  # checked once each by _check_runs
    named = [rank_of(p) for p in paths]
    if all(r is not None for r in named):
        ranks = [r for r in named if r is not None]
        if len(set(ranks)) != len(ranks):
            dup = next(r for r in ranks if ranks.count(r) > 1)
            raise TraceSchemaError(f"{', '.join(str(p) for p, r in zip(paths, ranks, strict=True) if r == dup)}: "
                                   f"two logs of rank {dup}")
        return ranks
    return list(range(len(paths)))  # names without a rank: the order given is the ranks' order


def _run(header: Header) -> RunPart | None:
    return header.run if isinstance(header.run, RunPart) else None


def _check_files(paths: Sequence[Path]) -> None:
    """Each file once: the same path twice, or a link to a file already given, is one rank's log twice."""
    seen: dict[tuple[int, int], Path] = {}
    for p in paths:
        try:
            st = p.stat()
        except OSError:
            continue  # read_all names what is wrong with it
        key = (st.st_dev, st.st_ino)
        if key in seen:
            q = seen[key]
            if q == p:
                raise TraceSchemaError(f"{p}: given twice: merge takes each rank's log once")
            raise TraceSchemaError(f"{p}: the same file as {q} (a link to it): merge takes each rank's log once")
        seen[key] = p


def _check_same_run(paths: Sequence[Path], headers: Sequence[Header]) -> None:
    first, h0 = paths[0], headers[0]
    for path, h in zip(paths, headers, strict=True):
        if h.model != h0.model:
            raise TraceSchemaError(f"{path}: its model shape differs from {first}'s: not logs of one run")
        if h.contents != h0.contents:
            raise TraceSchemaError(f"{path}: holds {h.contents!r} where {first} holds {h0.contents!r}")
    _check_runs(paths, headers)


def _check_runs(paths: Sequence[Path], headers: Sequence[Header]) -> None:
    """The run ids one, each rank of the run once, their layers each once and all of them."""
    runs = [_run(h) for h in headers]
    if all(r is None for r in runs):
        return  # logs written before runs had ids: the layer checks alone (_check_layers)
    wp, w = next((p, r) for p, r in zip(paths, runs, strict=True) if r is not None)
    by_rank: dict[int, tuple[Path, RunPart]] = {}
    for p, r in zip(paths, runs, strict=True):
        if r is None:
            raise TraceSchemaError(f"{p}: has no run id, {wp} is rank {w.rank} of run {w.id}: not logs of one run")
        if r.id != w.id:
            raise TraceSchemaError(f"{p}: is rank {r.rank} of run {r.id}, {wp} of run {w.id}: not logs of one run")
        if r.ranks != w.ranks:
            raise TraceSchemaError(f"{p}: says run {r.id} has {r.ranks} ranks, {wp} says {w.ranks}")
        if r.rank in by_rank:
            raise TraceSchemaError(f"{p}: is rank {r.rank} of run {r.id}, as {by_rank[r.rank][0]} is: merge takes "
                                   f"each rank's log once")
        by_rank[r.rank] = (p, r)
    if missing := [r for r in range(w.ranks) if r not in by_rank]:
        raise TraceSchemaError(f"{', '.join(map(str, paths))}: run {w.id} has {w.ranks} ranks: the log of "
                               f"rank {', '.join(map(str, missing))} is missing (merge takes every rank's log)")
    owner: dict[int, tuple[Path, RunPart]] = {}
    for rank in range(w.ranks):
        p, r = by_rank[rank]
        for layer in range(r.lo, r.hi):
            if layer in owner:
                q, o = owner[layer]
                raise TraceSchemaError(f"{p}: rank {rank} holds layers {r.lo}..{r.hi - 1}: layer {layer} is also "
                                       f"in {q} (rank {o.rank}, layers {o.lo}..{o.hi - 1})")
            owner[layer] = (p, r)
    m = headers[0].model
    if m is not None and (none := [layer for layer in range(m.num_layers) if layer not in owner]):
        raise TraceSchemaError(f"{', '.join(map(str, paths))}: layer {', '.join(map(str, none))} of run {w.id} is "
                               f"in none of the logs (each rank's layers are in its header)")


def _held(header: Header, records: Sequence[Record]) -> set[int]:
    """The layers a log holds: those it has capacities for and those its records name."""
    held = set(header.capacities)
    held.update(layer for r in records if isinstance(layer := getattr(r, "layer", None), int))
    return held


def _check_layers(paths: Sequence[Path], headers: Sequence[Header], records: Sequence[Sequence[Record]]) -> None:
    """Each layer in one log only; without run ids, every layer the logs are of in one of them."""
    held = [_held(h, rs) for h, rs in zip(headers, records, strict=True)]
    seen: dict[int, Path] = {}
    for path, layers in zip(paths, held, strict=True):
        for layer in sorted(layers):
            if layer in seen:
                raise TraceSchemaError(f"{path}: layer {layer} is also in {seen[layer]}: "
                                       "each rank's log holds its own layers")
            seen[layer] = path
    h0 = headers[0]
    # A log that names no layer (an event log of a run with every layer resident) cannot be placed: then
    # only the run ids tell whether a rank is missing.
    if _run(h0) is not None or h0.model is None or not all(held):
        return
    wanted = h0.layers or h0.model.moe_layers
    if none := [layer for layer in wanted if layer not in seen]:
        raise TraceSchemaError(f"{', '.join(map(str, paths))}: layer {', '.join(map(str, none))} is in none of the "
                               f"logs: a rank's log is missing (merge takes every rank's log)")


def merge(paths: Sequence[str | Path], out: str | Path) -> Merged:
    """Write `out`, the merge of `paths` (one log per rank of one run); TraceSchemaError names a log that does not fit.

    Refused: a file given twice, logs of other model shapes or contents, of two runs (`Header.run`), a
    rank twice or missing, a layer in two logs or, when the logs say which layers they hold, in none.
    """
    ps = [Path(p) for p in paths]
    if len(ps) < 2:
        raise TraceSchemaError(f"{', '.join(map(str, ps)) or 'no log'}: merging needs the logs of two ranks or more")
    _check_files(ps)
    logs = [read_all(p) for p in ps]
    headers = [h for h, _, _ in logs]
    _check_same_run(ps, headers)
    _check_layers(ps, headers, [rs for _, rs, _ in logs])
    ranks = _ranks(ps, headers)
    base = headers[ranks.index(min(ranks))]
    timed: list[tuple[float, int, int, Record]] = []
    end = base.clock_start_t
    for rank, (h, records, footer) in zip(ranks, logs, strict=True):
        # This rank's clock reading t is wall time h.wall + (t - h.clock): put it on the base rank's clock.
        shift = (h.wall_start_unix_s - base.wall_start_unix_s) + (base.clock_start_t - h.clock_start_t)
        end = max(end, footer.clock_end_t + shift)
        for n, r in enumerate(records):
            timed.append((r.t + shift, rank, n, msgspec.structs.replace(r, t=r.t + shift) if shift else r))
    timed.sort(key=lambda x: x[:3])
    layers: tuple[int, ...] = ()
    if all(h.layers for h in headers):  # an empty `layers` means every layer: the union is then every layer too
        layers = tuple(sorted({layer for h in headers for layer in h.layers}))
    header = Header(schema_version=SCHEMA_VERSION,
                    fingerprint=hashlib.sha256("".join(h.fingerprint for h in headers).encode()).hexdigest()[:16],
                    model=base.model, clock_start_t=base.clock_start_t,
                    wall_start_unix_s=min(h.wall_start_unix_s for h in headers), contents=base.contents,
                    layers=layers, capacities=dict(sorted((k, v) for h in headers for k, v in h.capacities.items())))
    writer = TraceWriter(out, header)
    try:
        for *_, r in timed:
            writer.write(r)
        dropped = sum(f.dropped for _, _, f in logs)
        writer.close(dropped, end)
    finally:
        writer.abandon()  # a no-op once closed
    return Merged(path=str(out), ranks=tuple(ranks), records=len(timed), dropped=dropped)
