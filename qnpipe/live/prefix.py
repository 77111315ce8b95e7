"""Prefix snapshots: resume a prompt from a saved state of its head instead of prefilling it again.

The prefill of a prompt of L tokens runs in spans whose boundaries are the multiples of
`forward.prefill_chunk_tokens` below L, plus `prefix.snapshot_head_tokens` (N) when L > N.
Those boundaries do not depend on L, so the state at any of them is the state every longer
prompt with the same tokens reaches there, computed the same way. Two snapshots are taken:

- the head: the state after the first N tokens (a long system prompt with its tools),
  kept in the LRU and, with `prefix.snapshot_dir`, in a file another process reuses;
- the turn: the state at the last boundary before L, kept in the LRU only, so the next
  turn of a conversation (whose prompt starts with this one) prefills only what is new.

A prompt of at most N tokens is prefilled from the start and leaves no snapshot.

A later prompt resumes from the longest kept state whose tokens it starts with; what it
computes is then bit-identical to a prefill from the start (tests/live/test_prefix.py).
With N a multiple of the chunk (the defaults: both 2048) that is also the prefill of an
engine without snapshots. The LRU holds `prefix.max_entries` states, heads and turns alike.

With MTP speculation (`lookahead`) a state at n also holds the MTP layer's rows 0..n-1, and
row n-1 pairs hidden n-1 with token n: the snapshot records that token and resumes only a
prompt whose token n is the same (qnpipe.live.mtp.loop.prefill, docs/model.md).

Pipeline parallel (`peers`, on rank 0 of a ring): this cache decides everything (keys, LRU,
which state a prompt resumes from) and holds rank 0's layers; every other rank keeps its own
layers' state under the same keys, told what to capture, restore and drop
(qnpipe.live.parallel.snap). Files get the rank's layer range in their name (`tag`).
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import attrs
import msgspec

from qnpipe.config import PrefixCfg
from qnpipe.errors import DistributedError, SnapshotError
from qnpipe.live.mlx_thread import MLXThread, run_on
from qnpipe.model import snapshots
from qnpipe.stats import PrefixStats

SUFFIX = ".qnsnap"


class SnapshotFileWarning(UserWarning):
    """A snapshot file was stale or corrupt and was ignored (the prompt is prefilled instead), or could not be written."""


def snapshot_path(directory: Path, key: str, tag: str = "") -> Path:
    """The file of the head state `key` in `directory`; `tag` (a rank's layer range) names a rank's share."""
    return directory / (f"{key}.{tag}{SUFFIX}" if tag else f"{key}{SUFFIX}")


class Peers(Protocol):
    """The other ranks of a ring, each keeping its own layers' states under rank 0's keys."""

    async def capture(self, key: str, n_tokens: int, head: bool) -> None:
        """Each keeps the state its current sequence has now (after the step just sent), as `key`."""
        ...

    async def restore(self, key: str, n_tokens: int, disk: bool) -> int | None:
        """Each starts a new sequence in the state `key` (`disk`: or in its head file's); None when every
        rank did, else the first rank that could not."""
        ...

    async def drop(self, keys: Sequence[str]) -> None:
        """Each forgets these states."""
        ...

    async def adopt(self, cache: list[Any]) -> None:
        """`cache`, restored here, continues the sequences the ranks just restored (not a new one)."""
        ...


def boundaries(n: int, chunk: int, head: int) -> list[int]:
    """The span ends of the prefill of `n` tokens: multiples of `chunk` below n, `head` when n > head, and n."""
    ends = set(range(chunk, n, chunk)) if chunk > 0 else set()
    if 0 < head < n:
        ends.add(head)
    return sorted(ends) + [n]


@attrs.frozen
class Plan:
    """How one prompt is prefilled: resume from `state` (None = fresh) at `start`, then `spans`;
    after the span ending at each of `capture` (key by end), take a snapshot; `after` (by end) is the
    token there, for a state that depends on it (MTP)."""

    start: int
    state: snapshots.Snapshot | None
    spans: list[tuple[int, int]]
    capture: dict[int, str]
    after: dict[int, int] = attrs.field(factory=dict)


@attrs.define
class _Entry:
    snap: snapshots.Snapshot
    head: bool


class PrefixCache:
    """The engine's snapshots: an LRU of states by token key and the optional directory of head states.

    Used from the engine's trio loop, one request at a time; the MLX work (capture, restore,
    files) runs on the MLX thread. `fingerprint` is computed there on first use.
    """

    def __init__(self, prefix_cfg: PrefixCfg, fingerprint: Callable[[], str], lookahead: bool = False,
                 tag: str = "", peers: Peers | None = None):
        self.head = prefix_cfg.snapshot_head_tokens
        self.lookahead = lookahead  # a state at n depends on token n too (the MTP layer's rows)
        self.max_entries = prefix_cfg.max_entries
        self.dir = Path(prefix_cfg.snapshot_dir) if prefix_cfg.snapshot_dir else None
        self._fingerprint_fn = fingerprint
        self._fingerprint: str | None = None
        self.tag = tag
        self.peers = peers
        self._lru: OrderedDict[str, _Entry] = OrderedDict()
        self._bad: set[tuple[str, int, int]] = set()  # (file, size, mtime) already warned about
        self._write_warned = False
        self.stats = PrefixStats()

    @property
    def enabled(self) -> bool:
        return self.head > 0

    def _count(self, **kw: int) -> None:
        self.stats = msgspec.structs.replace(self.stats, **{k: getattr(self.stats, k) + v for k, v in kw.items()})

    async def plan(self, thread: MLXThread, tokens: Sequence[int], chunk: int) -> Plan:
        """The prefill of `tokens`: from the longest kept state they start with, snapshots where new."""
        n = len(tokens)
        ends = boundaries(n, chunk, self.head if self.enabled else 0)
        if not self.enabled or n <= self.head:  # a short prompt is cheap to prefill: nothing kept
            return Plan(0, None, _spans(0, ends), {})
        start, state = await self._find(thread, tokens, set(ends[:-1]))
        capture: dict[int, str] = {}
        if start < self.head < n:
            capture[self.head] = snapshots.token_key(tokens[:self.head])
        if len(ends) > 1 and ends[-2] > start and ends[-2] != self.head:
            capture[ends[-2]] = snapshots.token_key(tokens[:ends[-2]])
        after = {e: tokens[e] for e in capture} if self.lookahead else {}
        return Plan(start, state, _spans(start, ends), capture, after)

    async def _find(self, thread: MLXThread, tokens: Sequence[int], ends: set[int]
                    ) -> tuple[int, snapshots.Snapshot | None]:
        lengths = {e.snap.n_tokens for e in self._lru.values()} & ends
        if self.head in ends:
            lengths.add(self.head)
        for n in sorted(lengths, reverse=True):
            key = snapshots.token_key(tokens[:n])
            entry = self._lru.get(key)
            if entry is not None and entry.snap.n_tokens == n and entry.snap.follows(tokens):
                self._lru.move_to_end(key)
                if self.peers is not None and (lacking := await self.peers.restore(key, n, False)) is not None:
                    # The ranks were told to keep and drop what this LRU keeps and drops: a bug, or
                    # a rank whose capture failed. Never a silently wrong state: forget it everywhere.
                    del self._lru[key]
                    await self.peers.drop([key])
                    raise DistributedError(f"rank {lacking} does not hold the prefix snapshot of {n} tokens "
                                           f"(key {key[:12]}) that rank 0 resumes from; it was dropped on every rank")
                self._count(hits=1, tokens_reused=n)
                return n, entry.snap
            if n == self.head and self.dir is not None:
                snap = await self._read(thread, key)
                if snap is not None and snap.follows(tokens):  # another next token: valid, not this prompt's
                    if self.peers is not None and not await self._peers_load(key, n):
                        continue
                    await self._put(key, snap, head=True)
                    self._count(hits=1, disk_loads=1, tokens_reused=n)
                    return n, snap
        self._count(misses=1)
        return 0, None

    async def _peers_load(self, key: str, n: int) -> bool:
        """Whether every other rank restored the head `key` too (from memory or its own file)."""
        assert self.peers is not None
        lacking = await self.peers.restore(key, n, True)
        if lacking is None:
            return True
        await self.peers.drop([key])  # the ranks that did restore it: this LRU does not keep it
        self._count(ignored_files=1)
        warnings.warn(f"prefix snapshot ignored, the prompt head is prefilled instead: rank {lacking} has no "
                      f"usable file of its layers' state ({key[:12]}…) in its prefix.snapshot_dir",
                      SnapshotFileWarning, stacklevel=3)
        return False

    def _path(self, key: str) -> Path:
        assert self.dir is not None
        return snapshot_path(self.dir, key, self.tag)

    async def fingerprint(self, thread: MLXThread) -> str:
        if self._fingerprint is None:
            self._fingerprint = await run_on(thread, self._fingerprint_fn)
        return self._fingerprint

    async def _read(self, thread: MLXThread, key: str) -> snapshots.Snapshot | None:
        path = self._path(key)
        try:
            st = path.stat()
        except OSError:  # absent, or the directory is not one (reported when a head is written)
            return None
        fp = await self.fingerprint(thread)
        try:
            return await run_on(thread, snapshots.load, path, key, fp)
        except SnapshotError as e:
            mark = (str(path), st.st_size, st.st_mtime_ns)
            if mark not in self._bad:
                self._bad.add(mark)
                self._count(ignored_files=1)
                warnings.warn(f"prefix snapshot ignored, the prompt head is prefilled instead: {e}",
                              SnapshotFileWarning, stacklevel=2)
            return None

    async def _put(self, key: str, snap: snapshots.Snapshot, head: bool) -> None:
        self._lru[key] = _Entry(snap, head)
        self._lru.move_to_end(key)
        evicted = []
        while len(self._lru) > self.max_entries:
            evicted.append(self._lru.popitem(last=False)[0])
            self._count(evictions=1)
        if evicted and self.peers is not None:
            await self.peers.drop(evicted)

    async def reached(self, thread: MLXThread, plan: Plan, end: int, cache: list[Any]) -> None:
        """Called after the span ending at `end`: snapshot `cache` there if the plan says so."""
        key = plan.capture.get(end)
        if key is None:
            return
        try:
            snap = await run_on(thread, snapshots.capture, cache, end, plan.after.get(end, -1))
        except SnapshotError as e:  # a cache kind without snapshots: answer without them from now on
            self.head = 0
            warnings.warn(f"prefix snapshots turned off for this engine: {e}", SnapshotFileWarning, stacklevel=2)
            return
        head = end == self.head
        if self.peers is not None:
            # Before this LRU keeps it (its evictions are dropped after): the ranks see capture,
            # then drops, in this order. run_on is not cancelled, so both sides keep it or neither.
            await self.peers.capture(key, end, head)
        await self._put(key, snap, head)
        self._count(captures=1)
        if head and self.dir is not None:
            fp = await self.fingerprint(thread)
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                await run_on(thread, snapshots.save, self._path(key), snap, key, fp)
            except OSError as e:  # a full or read-only disk costs the next process its head, not this answer
                if not self._write_warned:
                    self._write_warned = True
                    warnings.warn(f"prefix snapshot not written to {e.filename or self.dir}: {e.strerror or e}",
                                  SnapshotFileWarning, stacklevel=2)
                return
            self._count(disk_writes=1)

    def current_stats(self) -> PrefixStats:
        """The counters, with what the LRU holds now."""
        return msgspec.structs.replace(self.stats, entries=len(self._lru),
                                       bytes=sum(e.snap.nbytes for e in self._lru.values()))

    async def clear(self) -> None:
        """Forget the in-memory states (files stay), on every rank."""
        keys = list(self._lru)
        self._lru.clear()
        if keys and self.peers is not None:
            await self.peers.drop(keys)

    def entries(self) -> list[tuple[int, bool]]:
        """(tokens, is head) of each kept state, least recently used first."""
        return [(e.snap.n_tokens, e.head) for e in self._lru.values()]


def _spans(start: int, ends: list[int]) -> list[tuple[int, int]]:
    out, lo = [], start
    for e in ends:
        if e > lo:
            out.append((lo, e))
            lo = e
    return out


@attrs.frozen
class Prefill:
    """A prompt's prefill as a generate driver runs it: the saved state to start from, `plan.spans` in
    order, and after each span `reached` (the snapshot the plan takes there, the progress callback).
    Plain, MTP and ring MTP differ only in what one span's step is."""

    thread: MLXThread
    plan: Plan
    prefix: PrefixCache | None
    n_tokens: int
    on_prefill: Callable[[int, int], None] | None = None

    @property
    def start(self) -> int:
        """Tokens resumed from a saved state (0: prefilled from the start)."""
        return self.plan.start

    def spans(self, split_last: bool = False) -> list[tuple[int, int, bool]]:
        """`(lo, hi, last)` of each span: `last` is the one whose step makes the first new token.

        `split_last`: the prompt's last token is a step of its own, as mlx-lm's `generate_step`
        prefills (every token but the last in chunks, then the last): the steps before it only
        settle the cache, so the last layer's MoE of their rows, which no later row reads, is
        never computed (on the trained tiny model's few layers a quarter of a chunk's work).
        The spans' ends stay those of the plan: no snapshot moves."""
        spans = list(self.plan.spans)
        if split_last and spans and spans[-1][1] - spans[-1][0] > 1:
            lo, hi = spans.pop()
            spans += [(lo, hi - 1), (hi - 1, hi)]
        n = len(spans)
        return [(lo, hi, i == n - 1) for i, (lo, hi) in enumerate(spans)]

    async def restore(self, restore: Callable[[snapshots.Snapshot], Any], cache: list[Any]) -> None:
        """The plan's saved state (if any) put in place by `restore` on the MLX thread; on rank 0 of a ring,
        `cache` (this rank's, after `restore`) then continues the sequence the other ranks restored."""
        if self.plan.state is None:
            return
        await run_on(self.thread, restore, self.plan.state)
        if self.prefix is not None and self.prefix.peers is not None:
            await self.prefix.peers.adopt(cache)

    async def reached(self, end: int, cache: list[Any] | Callable[[], list[Any]]) -> None:
        """After the span ending at `end`: the plan's snapshot of `cache` there (a callable: called only
        for a snapshot), then the progress callback."""
        if self.prefix is not None and end in self.plan.capture:
            await self.prefix.reached(self.thread, self.plan, end, cache() if callable(cache) else cache)
        if self.on_prefill is not None and any(end == hi for _, hi in self.plan.spans):  # not a split's end
            self.on_prefill(end, self.n_tokens)


async def prefill(thread: MLXThread, tokens: Sequence[int], chunk: int, prefix: PrefixCache | None,
                  on_prefill: Callable[[int, int], None] | None = None, plan: Plan | None = None) -> Prefill:
    """The prefill of `tokens`: `plan`, else `prefix`'s plan, else from the start in spans of `chunk`
    tokens (0 = one span) with nothing kept."""
    if plan is None:
        plan = await prefix.plan(thread, tokens, chunk) if prefix is not None else \
            Plan(0, None, _spans(0, boundaries(len(tokens), chunk, 0)), {})
    return Prefill(thread, plan, prefix, len(tokens), on_prefill)


async def resume(thread: MLXThread, plan: Plan, cache: list[Any], prefix: PrefixCache | None = None) -> None:
    """Put the plan's saved state into `cache` (in place: the list keeps its identity); on rank 0 of a
    ring (`prefix` with peers), `cache` then continues the sequence the other ranks restored."""
    if plan.state is not None:
        cache[:] = await run_on(thread, snapshots.restore, plan.state)
        if prefix is not None and prefix.peers is not None:
            await prefix.peers.adopt(cache)
