"""One rank's side of MTP verify steps over the ring: its caches and their rollback. MLX thread only.

A verify step runs `[y_n, d_1 … d_K]` through every rank's layers; only the last rank learns
how many drafts were accepted. Each rank's Gated DeltaNet layers (`StepCache`) record every
token's state during the step, and the rollback to "the first `keep` rows processed" comes
with the next step's header (`Header.keep`): every rank applies it to its own layers before
it runs that step (docs/distributed.md, "MTP speculation").
"""

from __future__ import annotations

from typing import Any

from mlx_lm.models.cache import ArraysCache, KVCache

from qnpipe.errors import DistributedError, SnapshotError
from qnpipe.model import snapshots
from qnpipe.model.qwen3_next import Model
from qnpipe.model.stage import Remote
from qnpipe.model.step_cache import StepCache


def spec_cache(model: Model) -> list[Any]:
    """A sequence's cache list as MTP speculation keeps it (qnpipe.live.mtp.state.SpecCaches.main)."""
    return [StepCache() if layer.is_linear else KVCache() for layer in model.layers]


def spec_restore(model: Model, snap: snapshots.Snapshot) -> list[Any]:
    """A `spec_cache` in the state of a prefix snapshot of this rank's layers (its Gated DeltaNet
    layers stay `StepCache`s; the other ranks' layers keep their unused caches)."""
    cache = spec_cache(model)
    layers = snapshots.restore(snap)
    if len(layers) != len(cache):
        raise SnapshotError(f"a snapshot of {len(layers)} layers, this model has {len(cache)}")
    for i, c in enumerate(layers):
        if c is None:
            continue
        own = cache[i]
        if isinstance(own, StepCache) and isinstance(c, ArraysCache):
            own.cache = c.cache
        else:
            cache[i] = c
    return cache


def own_layers(model: Model, cache: list[Any]) -> list[Any]:
    """`cache` with None for the layers other ranks run (what a prefix snapshot of this rank holds);
    entries past the model's layers (the MTP layer's) are this rank's."""
    n = len(model.layers)
    return [None if i < n and isinstance(model.layers[i], Remote) else c for i, c in enumerate(cache)]


class Verifying:
    """The verify step this rank ran last on a sequence, until the next step says what it kept."""

    def __init__(self, model: Model, cache: list[Any]) -> None:
        self.cache = cache
        self.own = [c for layer, c in zip(model.layers, cache, strict=True) if not isinstance(layer, Remote)]
        self.rows = 0  # rows of the last verify step not yet rolled back (0: none)

    def before(self, keep: int, verify_rows: int) -> None:
        """Before a step: roll the last verify step back to its first `keep` rows; start recording
        when this step is a verify step of `verify_rows` rows (0: it is not)."""
        if self.rows:
            if not 1 <= keep <= self.rows:
                raise DistributedError(f"a step after a verify step of {self.rows} rows keeps {keep} of them")
            for c in self.own:
                if isinstance(c, StepCache):
                    if keep < self.rows:
                        c.rollback(keep)
                    c.forget()
                else:
                    c.trim(self.rows - keep)
        elif keep:
            raise DistributedError(f"a step keeps {keep} rows of a verify step this rank did not run")
        self.rows = verify_rows
        if verify_rows:
            for c in self.own:
                if isinstance(c, StepCache):
                    c.recording = True
