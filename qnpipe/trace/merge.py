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
from qnpipe.trace.format import SCHEMA_VERSION, Header, Record, TraceWriter, read_all

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


def _ranks(paths: Sequence[Path]) -> list[int]:
    named = [rank_of(p) for p in paths]
    if all(r is not None for r in named):
        ranks = [r for r in named if r is not None]
        if len(set(ranks)) != len(ranks):
            dup = next(r for r in ranks if ranks.count(r) > 1)
            raise TraceSchemaError(f"{', '.join(str(p) for p, r in zip(paths, ranks, strict=True) if r == dup)}: "
                                   f"two logs of rank {dup}")
        return ranks
    return list(range(len(paths)))  # names without a rank: the order given is the ranks' order


def _check_same_run(paths: Sequence[Path], headers: Sequence[Header]) -> None:
    first, h0 = paths[0], headers[0]
    seen: dict[int, Path] = {}
    for path, h in zip(paths, headers, strict=True):
        if h.model != h0.model:
            raise TraceSchemaError(f"{path}: its model shape differs from {first}'s: not logs of one run")
        if h.contents != h0.contents:
            raise TraceSchemaError(f"{path}: holds {h.contents!r} where {first} holds {h0.contents!r}")
        for layer in h.capacities:
            if layer in seen:
                raise TraceSchemaError(f"{path}: layer {layer} is also in {seen[layer]}: "
                                       "each rank's log holds its own layers")
            seen[layer] = path


def merge(paths: Sequence[str | Path], out: str | Path) -> Merged:
    """Write `out`, the merge of `paths` (one log per rank of one run); TraceSchemaError names a log that does not fit."""
    ps = [Path(p) for p in paths]
    if len(ps) < 2:
        raise TraceSchemaError(f"{', '.join(map(str, ps)) or 'no log'}: merging needs the logs of two ranks or more")
    logs = [read_all(p) for p in ps]
    headers = [h for h, _, _ in logs]
    _check_same_run(ps, headers)
    ranks = _ranks(ps)
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
