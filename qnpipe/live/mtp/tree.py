"""Verify several draft paths in one forward (greedy): tree verify, top-2 rescue, adaptive rescue.

Path 0 is the drafter's greedy chain. Every other path forces one position to the drafter's
`rank`-th choice and continues greedily from there (`Branch`): `mtp.tree_verify` takes
ranks 1 … tree_branches − 1 at the first position, `mtp.tree_top2` rank 1 at the first
position (and `tree_top2_p1` at the second too), `mtp.adaptive_rescue` rank 1 at the first
position at the depth adaptive depth chose. Each path drafts on a copy of the MTP cache, so
no provisional entry reaches the real one.

The main model verifies all paths as a batch of P rows over copies of its caches (the
committed prefix repeated P times, Gated DeltaNet states recorded per token); the path
with the most accepted drafts wins (the first one on a tie) and the real caches take its
row, trimmed to its accepted tokens. Each row is plain greedy decoding of its own tokens, so
the committed tokens are those of plain greedy decoding: exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from qnpipe.model.step_cache import StepCache


@attrs.frozen
class Branch:
    """A path that takes the drafter's `rank`-th choice (0 = best) at draft position `pos`."""

    pos: int
    rank: int


def branches(tree_verify: bool, tree_branches: int, top2: bool, top2_p1: bool, rescue: bool) -> tuple[Branch, ...]:
    """The extra paths `cfg.mtp` asks for (empty: one path, no tree)."""
    if tree_verify:
        return tuple(Branch(0, r) for r in range(1, tree_branches))
    out = []
    if top2 or rescue:
        out.append(Branch(0, 1))
    if top2_p1:
        out.append(Branch(1, 1))
    return tuple(out)


def copy_kv(c: KVCache, reps: int = 1) -> KVCache:
    """An independent KVCache holding `c`'s entries, repeated `reps` times along the batch."""
    n = KVCache()
    if c.keys is not None and c.values is not None:
        k, v = c.keys[..., :c.offset, :], c.values[..., :c.offset, :]
        n.keys, n.values = (mx.repeat(k, reps, axis=0), mx.repeat(v, reps, axis=0)) if reps > 1 else (k, v)
        n.offset = c.offset
    return n


def batch_caches(main: Sequence[Any], reps: int) -> list[Any]:
    """`reps` copies of the main model's caches as one batch, Gated DeltaNet layers recording per token."""
    out: list[Any] = []
    for c in main:
        if isinstance(c, StepCache):
            n = StepCache()
            n[0], n[1] = mx.repeat(c[0], reps, axis=0), mx.repeat(c[1], reps, axis=0)
            n.recording = True
            out.append(n)
        else:
            out.append(copy_kv(c, reps))
    return out


def take_row(main: Sequence[Any], big: Sequence[Any], row: int, keep: int) -> None:
    """Set each real cache (untouched by the batch step) to row `row` of the batch, the first `keep`
    verified tokens kept."""
    for c, b in zip(main, big, strict=True):
        if isinstance(c, StepCache):
            assert b.conv_in is not None
            width = b.conv_in.shape[1] - len(b.states)
            c[0] = mx.contiguous(b.conv_in[row:row + 1, keep:keep + width, :])
            c[1] = b.states[keep - 1][row:row + 1]
            c.forget()
        else:
            n = c.offset + keep  # the committed prefix plus `keep` tokens
            c.keys = b.keys[row:row + 1, :, :n, :]
            c.values = b.values[row:row + 1, :, :n, :]
            c.offset = n


def best_path(paths: Sequence[Sequence[int]], main: np.ndarray) -> tuple[int, int]:
    """(path index, accepted drafts) of the path with the longest greedy-matching prefix."""
    best, best_a = 0, -1
    for j, path in enumerate(paths):
        a = 0
        while a < len(path) and path[a] == int(main[j, a]):
            a += 1
        if a > best_a:
            best, best_a = j, a
    return best, best_a
