"""Prefix snapshots over the ring: rank 0's PrefixCache decides, every rank keeps its own layers' state.

Rank 0's `qnpipe.live.prefix.PrefixCache` keeps the keys, the LRU and rank 0's layers; `RingPeers`
tells the other ranks, one SNAP message each (a frame: the header and `SNAP_WORDS` uint32, the
words `encode` makes), what to do under the same key:

- CAPTURE, sent right after the step that reached the state: messages on a link keep their
  order, so each rank captures after it has run that step. One way.
- RESTORE, when a prompt resumes: each rank starts a new sequence in that state (from memory,
  or from its own head file when rank 0 read its own) and passes the message on, marking the
  first rank that could not; the last rank's copy is rank 0's answer. Rank 0's next step then
  continues that sequence (`Lead.adopt`). With MTP speculation the header's `depth` says the
  sequence is an MTP one: the last rank's state also holds its MTP layer's cache.
- DROP, for each state rank 0's LRU evicts. One way.

The other ranks keep exactly what rank 0 told them to (`RankStates`), no policy of their own:
rank 0's LRU alone decides, including after a head file that one rank lacks. Head files get the
rank's layer range in their name (`layers_tag`) and their fingerprint
(qnpipe.model.snapshots.engine_fingerprint): a file of another split is never restored.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from qnpipe.config import PrefixCfg
from qnpipe.errors import SnapshotError
from qnpipe.live.mlx_thread import MLXThread, run_on
from qnpipe.live.parallel.lead import Lead
from qnpipe.live.parallel.ring import SNAP_WORDS, SnapAction
from qnpipe.live.prefix import SnapshotFileWarning, snapshot_path
from qnpipe.model import snapshots
from qnpipe.model.stage import Stage

HEAD = 1  # flag: a head state (a rank with prefix.snapshot_dir writes it to a file)
DISK = 2  # flag: a restore may read the rank's head file


@attrs.frozen
class SnapWords:
    """A SNAP message's payload: the state's key, its flags, and on a restore's way round the ring the
    first rank that could not restore it (-1: none so far)."""

    key: str
    flags: int = 0
    lacking: int = -1


def encode(w: SnapWords) -> np.ndarray:
    """`SNAP_WORDS` uint32: the key's 32 bytes (a sha256 in hex), the flags, the lacking rank + 1."""
    try:
        raw = bytes.fromhex(w.key)
    except ValueError:
        raw = b""
    if len(raw) != 32:
        raise ValueError(f"a snapshot key is a sha256 in hex, not {w.key!r}")
    return np.concatenate([np.frombuffer(raw, dtype="<u4"), np.array([w.flags, w.lacking + 1], dtype="<u4")])


def decode(words: np.ndarray) -> SnapWords:
    if words.shape != (SNAP_WORDS,):
        raise ValueError(f"a SNAP payload is {SNAP_WORDS} words, not {words.shape}")
    u = words.astype("<u4")
    return SnapWords(u[:8].tobytes().hex(), int(u[8]), int(u[9]) - 1)


def layers_tag(stage: Stage) -> str:
    """The rank's layer range as files name it (`layers0-3`): ranks may share a disk."""
    return f"layers{stage.lo}-{stage.hi - 1}"


class RingPeers:
    """Rank 0's `qnpipe.live.prefix.Peers`: the other ranks, told over the ring. `mtp_depth` (MTP
    speculation: the drafts per round) > 0: the sequences are MTP ones (the last rank's state
    holds its MTP layer's)."""

    def __init__(self, lead: Lead, thread: MLXThread, mtp_depth: int = 0) -> None:
        self.lead = lead
        self.thread = thread
        self.mtp_depth = mtp_depth

    async def capture(self, key: str, n_tokens: int, head: bool) -> None:
        await run_on(self.thread, self.lead.snap, SnapAction.CAPTURE, n_tokens, encode(SnapWords(key, HEAD if head else 0)))

    async def restore(self, key: str, n_tokens: int, disk: bool) -> int | None:
        back = await run_on(self.thread, self.lead.snap, SnapAction.RESTORE, n_tokens,
                            encode(SnapWords(key, DISK if disk else 0)), self.mtp_depth)
        assert back is not None
        got = decode(back)
        if got.key != key:
            raise AssertionError(f"a restore of {key[:12]} answered for {got.key[:12]}")
        return None if got.lacking < 0 else got.lacking

    async def drop(self, keys: Sequence[str]) -> None:
        for key in keys:
            await run_on(self.thread, self.lead.snap, SnapAction.DROP, 0, encode(SnapWords(key)))

    async def adopt(self, cache: list[Any]) -> None:
        await run_on(self.thread, self.lead.adopt, cache)


class RankStates:
    """The states a rank after rank 0 keeps of its own layers, by rank 0's keys. MLX thread only."""

    def __init__(self, prefix_cfg: PrefixCfg, fingerprint: Callable[[], str], tag: str, rank: int) -> None:
        self.dir = Path(prefix_cfg.snapshot_dir) if prefix_cfg.snapshot_dir else None
        self.tag = tag
        self.rank = rank
        self._fingerprint_fn = fingerprint
        self._fingerprint: str | None = None
        self.states: dict[str, snapshots.Snapshot] = {}
        self._write_warned = False

    def fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = self._fingerprint_fn()
        return self._fingerprint

    def capture(self, cache: list[Any] | None, key: str, n_tokens: int, head: bool) -> None:
        """Keep `cache` (the current sequence's; None: none yet) as `key`; a head also in its file."""
        self.states.pop(key, None)
        try:
            if cache is None:
                raise SnapshotError("no sequence has run on this rank")
            snap = snapshots.capture(cache, n_tokens)
            offsets = {s.offset for s in snap.layers if s.kind not in ("arrays", snapshots.REMOTE)}
            if offsets - {n_tokens}:  # this rank's sequence is not where rank 0's is: keep nothing
                raise SnapshotError(f"this rank's sequence holds {sorted(offsets)} tokens, not {n_tokens}")
        except SnapshotError as e:  # a restore of it names this rank (never a wrong state)
            warnings.warn(f"rank {self.rank}: prefix snapshot of {n_tokens} tokens not kept: {e}",
                          SnapshotFileWarning, stacklevel=2)
            return
        self.states[key] = snap
        if head and self.dir is not None:
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                snapshots.save(snapshot_path(self.dir, key, self.tag), snap, key, self.fingerprint())
            except OSError as e:  # a full or read-only disk costs the next run its head, not this answer
                if not self._write_warned:
                    self._write_warned = True
                    warnings.warn(f"rank {self.rank}: prefix snapshot not written to {e.filename or self.dir}: "
                                  f"{e.strerror or e}", SnapshotFileWarning, stacklevel=2)

    def find(self, key: str, n_tokens: int, disk: bool) -> snapshots.Snapshot | None:
        """The state `key` of `n_tokens` tokens (`disk`: or its head file's); None when this rank has neither."""
        snap = self.states.get(key)
        if snap is None and disk and self.dir is not None:
            path = snapshot_path(self.dir, key, self.tag)
            if path.exists():
                try:
                    snap = snapshots.load(path, key, self.fingerprint())
                except SnapshotError as e:
                    warnings.warn(f"rank {self.rank}: prefix snapshot ignored: {e}", SnapshotFileWarning, stacklevel=2)
            if snap is not None:
                self.states[key] = snap
        return snap if snap is not None and snap.n_tokens == n_tokens else None

    def drop(self, key: str) -> None:
        self.states.pop(key, None)
