"""Splitting one step at a layer into parts whose experts fit the layer's pool.

A long prefill chunk (and later an MTP verify batch) can route to more distinct experts
than a layer has slots. The step then runs the layer in parts, either token-major
(`plan_parts`: consecutive token ranges, each with a union of experts that fits) or
expert-major (`plan_parts_by_expert`, forward.parts=experts: sets of experts, each run on
all the pairs routed to it, so an expert is read once per layer-step). Every token still
gets exactly its own experts. Never an alias, never a dropped expert.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from qnpipe.errors import CapacityError

Part = tuple[int, int, tuple[int, ...]]  # tokens lo:hi and their distinct experts, ascending (or in router order)


def plan_parts(ids: np.ndarray, capacity: int, *, layer: int = -1) -> list[Part]:
    """Greedy in token order: each part takes tokens while its expert union fits `capacity`.

    `ids [N, k]` are the router's expert ids per token. One part when the whole union fits.
    """
    return plan_parts_flat(ids.reshape(-1).tolist(), ids.shape[1], capacity, layer=layer)


def plan_parts_flat(experts: Sequence[int], k: int, capacity: int, *, layer: int = -1,
                    router_order: bool = False) -> list[Part]:
    """`plan_parts` of the ids given flat, token-major (`k` per token): what replay's logs hold.

    A part's experts are served (looked up, then loaded) in ascending id; `router_order`: in the order
    the router first names them, token after token (replay.step_order=router)."""
    if router_order:
        return _parts_in_router_order(experts, k, capacity, layer)
    n = len(experts) // k
    if k > capacity:
        raise CapacityError(f"layer {layer}: a token routes to {k} experts, the layer has {capacity} usable slots")
    union = sorted(set(experts))  # plain ints: far cheaper than np.unique at a step's size
    if len(union) <= capacity:
        return [(0, n, tuple(union))]
    parts: list[Part] = []
    lo = 0
    cur: set[int] = set()
    for t in range(n):
        row = set(experts[t * k:(t + 1) * k])
        if len(cur | row) > capacity:
            parts.append((lo, t, tuple(sorted(cur))))
            lo, cur = t, set()
        cur |= row
    parts.append((lo, n, tuple(sorted(cur))))
    return parts


def _parts_in_router_order(experts: Sequence[int], k: int, capacity: int, layer: int) -> list[Part]:
    """`plan_parts_flat`'s parts, each part's experts in first-named order."""
    if k > capacity:
        raise CapacityError(f"layer {layer}: a token routes to {k} experts, the layer has {capacity} usable slots")
    parts: list[Part] = []
    lo = 0
    cur: dict[int, None] = {}
    for t in range(len(experts) // k):
        row = experts[t * k:(t + 1) * k]
        if len(cur.keys() | row) > capacity:
            parts.append((lo, t, tuple(cur)))
            lo, cur = t, {}
        cur.update(dict.fromkeys(row))
    parts.append((lo, len(experts) // k, tuple(cur)))
    return parts


def plan_parts_by_expert(experts: Sequence[int], k: int, capacity: int, *, layer: int = -1,
                         router_order: bool = False, first: Sequence[int] = ()) -> tuple[list[Part], list[int]]:
    """Expert-major parts of one step at a layer: each part a set of at most `capacity` of the step's
    experts, run on every (token, expert) pair routed to them, so each expert is read once per
    layer-step however many tokens name it. Every part spans all the tokens (`0, n`). Returns the parts
    and each part's count of pairs. One part, the same as `plan_parts_flat`'s, when the union fits.

    The union is served in ascending id (`router_order`: as the router first names them) except that
    the experts of `first` (the last part of the layer's previous split step, still in the pool unless
    evicted since) come first, and the first part takes the remainder so the last is full: the next
    split step of the layer then starts with what this one leaves in memory."""
    if k > capacity:
        raise CapacityError(f"layer {layer}: a token routes to {k} experts, the layer has {capacity} usable slots")
    n = len(experts) // k
    union = list(dict.fromkeys(experts)) if router_order else sorted(set(experts))
    if len(union) <= capacity:
        return [(0, n, tuple(union))], [len(experts)]
    if first:
        keep = set(first)
        union = [e for e in union if e in keep] + [e for e in union if e not in keep]
    cuts = list(range(len(union) % capacity or capacity, len(union), capacity))
    groups = [union[a:b] for a, b in zip([0, *cuts], [*cuts, len(union)], strict=True)]
    named = {e: i for i, e in enumerate(dict.fromkeys(experts))} if router_order else None
    parts: list[Part] = [(0, n, tuple(sorted(g, key=named.__getitem__) if named else sorted(g))) for g in groups]
    owner = {e: i for i, g in enumerate(groups) for e in g}
    pairs = [0] * len(groups)
    for e in experts:
        pairs[owner[e]] += 1
    return parts, pairs


class Splitter:
    """A run's layer-steps split into parts as the forward splits them, in step order: expert-major
    (`by_expert`, forward.parts=experts) or token ranges. Expert-major parts depend on the layer's
    previous split step (`plan_parts_by_expert`'s `first`), so one splitter follows one run (one
    capacity) from its first step. What replay's curves, optimum and cost fit split with."""

    __slots__ = ("by_expert", "router_order", "_tails")

    def __init__(self, by_expert: bool, *, router_order: bool = False) -> None:
        self.by_expert = by_expert
        self.router_order = router_order
        self._tails: dict[int, tuple[int, ...]] = {}

    def split(self, experts: Sequence[int], k: int, capacity: int, layer: int = -1) -> tuple[list[Part], list[int] | None]:
        """The parts of `layer`'s step routed to `experts` (flat, `k` per token) at `capacity`, and each part's
        (token, expert) pairs when they are more than one expert-major part (else None)."""
        if not self.by_expert:
            return plan_parts_flat(experts, k, capacity, layer=layer, router_order=self.router_order), None
        parts, pairs = plan_parts_by_expert(experts, k, capacity, layer=layer, router_order=self.router_order,
                                            first=self._tails.get(layer, ()))
        if len(parts) == 1:
            return parts, None
        self._tails[layer] = parts[-1][2]
        return parts, pairs

    def parts(self, experts: Sequence[int], k: int, capacity: int, layer: int = -1) -> list[Part]:
        """`split`'s parts alone."""
        return self.split(experts, k, capacity, layer)[0]
