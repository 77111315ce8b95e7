"""One rank's share of the model in pipeline parallel: a contiguous range of decoder layers.

Rank 0 embeds, the last rank applies the final norm and the LM head, and each rank holds only
its own layers' weights: the others are `Remote` placeholders, so layer ids, cache indices and
MoE layer ids stay those of the whole model (docs/distributed.md).
"""

from __future__ import annotations

import re
from typing import Any

import attrs
import mlx.nn as nn


@attrs.frozen
class Stage:
    """Rank `rank` of `size` runs decoder layers `lo..hi-1`; `mtp`: the last rank runs the MTP head;
    `run_id`: the run's, the same on every rank (`Ring.run_id`), for the headers of the rank's logs."""

    rank: int
    size: int
    lo: int
    hi: int
    mtp: bool = False
    run_id: str = ""

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.size - 1

    @property
    def prev(self) -> int:
        return (self.rank - 1) % self.size

    @property
    def next(self) -> int:
        return (self.rank + 1) % self.size

    def holds(self, layer: int) -> bool:
        return self.lo <= layer < self.hi

    def keeps(self, name: str, tied_embeddings: bool) -> bool:
        """Whether this rank loads the tensor `name` (mlx-lm naming)."""
        m = _LAYER.match(name)
        if m is not None:
            return self.holds(int(m.group(1)))
        if name.startswith("model.embed_tokens."):
            # Tied embeddings are also the LM head's weight; the MTP head embeds the tokens it reads.
            return self.first or (self.last and (tied_embeddings or self.mtp))
        if name.startswith(("model.norm.", "lm_head.")):
            return self.last
        return True


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


class Remote(nn.Module):
    """A decoder layer another rank runs: no weights; its kind still makes the cache list's shape."""

    def __init__(self, is_linear: bool):
        super().__init__()
        self.is_linear = is_linear
        self.mlp = None  # what loops over the layers' MoE blocks skip


class Passthrough(nn.Module):
    """The final norm on a rank that is not the last: the hidden state goes on as it is."""

    def __call__(self, x: Any) -> Any:
        return x


def prune(model: Any, stage: Stage) -> None:
    """Drop from `model` (qnpipe.model.qwen3_next.Model, before its weights load) what `stage` does not run."""
    m = model.model
    for i, layer in enumerate(m.layers):
        if not stage.holds(i):
            m.layers[i] = Remote(layer.is_linear)
    if not (stage.first or (stage.last and (model.args.tie_word_embeddings or stage.mtp))):
        del m["embed_tokens"]
    if not stage.last:
        m.norm = Passthrough()
        if "lm_head" in model:
            del model["lm_head"]
    # The masks come from the first local layer of each kind: the others' caches stay empty here.
    kinds = [(i, layer.is_linear) for i, layer in enumerate(m.layers) if stage.holds(i)]
    m.ssm_idx = next((i for i, lin in kinds if lin), None)
    m.fa_idx = next((i for i, lin in kinds if not lin), None)
