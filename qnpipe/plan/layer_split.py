"""Which decoder layers each rank of a ring runs: contiguous ranges, even by parameter bytes. Pure
(qnpipe.live.parallel.join splits with it; qnpipe.plan.ranks with the memory account's bytes)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from qnpipe.errors import ConfigError


def split_layers(layer_bytes: Sequence[int], ranks: int, *, first_extra: int = 0,
                 last_extra: int = 0) -> list[tuple[int, int]]:
    """`ranks` contiguous ranges `(lo, hi)` covering every layer, at least one each, that minimise
    the largest rank's bytes (`first_extra` counts on rank 0: the embedding; `last_extra` on the
    last: the final norm and LM head). Ties go to the earliest split.

    ConfigError when there are fewer layers than ranks.
    """
    n = len(layer_bytes)
    if ranks < 1 or n < ranks:
        raise ConfigError(f"{ranks} ranks for a model of {n} decoder layers: each rank needs at least one layer")
    prefix = [0]
    for b in layer_bytes:
        prefix.append(prefix[-1] + int(b))

    def cost(r: int, lo: int, hi: int) -> int:
        return prefix[hi] - prefix[lo] + (first_extra if r == 0 else 0) + (last_extra if r == ranks - 1 else 0)

    # best[r][i]: the smallest max-bytes of ranks 0..r-1 over layers 0..i-1 (n, ranks are small).
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(ranks + 1)]
    cut = [[0] * (n + 1) for _ in range(ranks + 1)]
    best[0][0] = 0
    for r in range(1, ranks + 1):
        for i in range(r, n - (ranks - r) + 1):
            for j in range(r - 1, i):
                v = max(best[r - 1][j], cost(r - 1, j, i))
                if v < best[r][i]:
                    best[r][i], cut[r][i] = v, j
    out, hi = [], n
    for r in range(ranks, 0, -1):
        lo = cut[r][hi]
        out.append((lo, hi))
        hi = lo
    return out[::-1]


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def tensor_bytes(nbytes: Mapping[str, int], num_layers: int) -> tuple[list[int], int, int, int]:
    """Tensors' bytes by where a split puts them: (each decoder layer's, the embedding's, the final norm
    and LM head's, the rest's)."""
    per = [0] * num_layers
    embed = head = rest = 0
    for name, n in nbytes.items():
        if (m := _LAYER.match(name)) is not None and int(m.group(1)) < num_layers:
            per[int(m.group(1))] += n
        elif name.startswith("model.embed_tokens."):
            embed += n
        elif name.startswith(("model.norm.", "lm_head.")):
            head += n
        else:
            rest += n
    return per, embed, head, rest


def model_layer_bytes(model_dir: Path, num_layers: int, expert_dir: Path | None = None
                      ) -> tuple[list[int], int, int]:
    """(bytes of each decoder layer, embedding bytes, final norm + LM head bytes) of a model directory,
    from its safetensors headers and, for a qnpipe directory, its expert store's index."""
    from qnpipe.model.checkpoint import scan

    per, embed, head, _ = tensor_bytes({name: info.nbytes for name, info in scan(model_dir).items()}, num_layers)
    root = expert_dir or model_dir
    if (root / "index.json").exists() or (root / "experts" / "index.json").exists():
        from qnpipe.io.store import read_index

        _, index = read_index(root)
        for lf in index.layers:
            if lf.layer < num_layers:
                per[lf.layer] += lf.record_nbytes * lf.num_experts
    return per, embed, head
