"""Splitting one step's tokens at a layer into parts whose experts fit the layer's pool.

A long prefill chunk (and later an MTP verify batch) can route to more distinct experts
than a layer has slots. The step then runs the layer in parts: consecutive token ranges,
each with a union of experts that fits, every token still getting exactly its own
experts. Never an alias, never a dropped expert.
"""

from __future__ import annotations

import numpy as np

from qnpipe.errors import CapacityError

Part = tuple[int, int, tuple[int, ...]]  # tokens lo:hi and their distinct experts, ascending


def plan_parts(ids: np.ndarray, capacity: int, *, layer: int = -1) -> list[Part]:
    """Greedy in token order: each part takes tokens while its expert union fits `capacity`.

    `ids [N, k]` are the router's expert ids per token. One part when the whole union fits.
    """
    n, k = ids.shape
    if k > capacity:
        raise CapacityError(f"layer {layer}: a token routes to {k} experts, the layer has {capacity} usable slots")
    union = sorted(set(ids.reshape(-1).tolist()))  # plain ints: far cheaper than np.unique at a step's size
    if len(union) <= capacity:
        return [(0, n, tuple(union))]
    parts: list[Part] = []
    lo = 0
    cur: set[int] = set()
    for t in range(n):
        row = {int(e) for e in ids[t]}
        if len(cur | row) > capacity:
            parts.append((lo, t, tuple(sorted(cur))))
            lo, cur = t, set()
        cur |= row
    parts.append((lo, n, tuple(sorted(cur))))
    return parts
