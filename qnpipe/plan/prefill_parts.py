"""What a capacity costs in prefill parts: the extra layer passes a chunk's experts cause below their union (pure).

A layer-step whose experts do not fit the layer's slots runs in parts (qnpipe.policy.parts), each part a
pass of its own: a capacity below the union of a typical prefill chunk's experts splits every chunk. The
miss-ratio curves count the misses of those parts, not the passes; this module counts the passes, so the
allocation (qnpipe.plan.search) can price them.

Where the chunks come from:
- `log`: the log's own multi-token layer-steps (a traced run's prefill chunks), when it has any;
- `derived`: a log of one-token steps only (a decode log, `qnpipe trace synth`'s) has no chunk; its tokens,
  taken `forward.prefill_chunk_tokens` consecutive at a time at each layer (the whole log when 0), stand in
  for a prompt's chunks: a prompt as long as the log, routed as the log routes.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from qnpipe.policy.parts import plan_parts_flat
from qnpipe.trace import ModelShape

Steps = Sequence[Sequence[tuple[int, tuple[int, ...]]]]


def chunks(steps: Steps, shape: ModelShape, chunk_tokens: int) -> tuple[dict[int, list[tuple[int, ...]]], str]:
    """Per MoE layer, the prefill chunks' experts (flat, token-major), and where they came from (module doc)."""
    k = shape.top_k
    multi: dict[int, list[tuple[int, ...]]] = {ly: [] for ly in shape.moe_layers}
    for step in steps:
        for ly, experts in step:
            if len(experts) > k and ly in multi:
                multi[ly].append(tuple(experts))
    if any(multi.values()):
        return multi, "log"
    per: dict[int, list[int]] = {ly: [] for ly in shape.moe_layers}
    for step in steps:
        for ly, experts in step:
            if ly in per:
                per[ly].extend(experts)
    out: dict[int, list[tuple[int, ...]]] = {}
    for ly, flat in per.items():
        width = (chunk_tokens or max(1, len(flat) // k)) * k
        out[ly] = [tuple(flat[i:i + width]) for i in range(0, len(flat), width) if len(flat[i:i + width]) > k]
    return out, "derived"


def extra_parts(chunk_experts: Sequence[tuple[int, ...]], k: int, num_experts: int, *,
                by_expert: bool = True) -> list[int]:
    """Passes beyond one per chunk at each capacity k..num_experts (index = capacity - k). `by_expert`: the
    forward's expert-major parts (forward.parts=experts), as few as the slots allow; else token ranges."""
    diff = [0] * (num_experts - k + 2)  # ranges of capacities added at once, summed at the end

    def add(lo: int, hi: int, n: int) -> None:
        diff[lo - k] += n
        diff[hi - k + 1] -= n

    for flat in chunk_experts:
        union = len(set(flat))
        if union <= k:
            continue
        top = min(union, num_experts + 1) - 1  # at the union and above: one part
        if by_expert:  # ceil(union / c) - 1, constant over each range of capacities
            c = k
            while c <= top:
                n = -(-union // c) - 1
                last = min(top, -(-union // n) - 1)  # the largest c with the same ceil(union / c)
                add(c, last, n)
                c = last + 1
            continue
        if len(flat) == 2 * k:  # two tokens: split in two wherever both do not fit
            add(k, top, 1)
            continue
        # The greedy split is the fewest parts (any sub-range of a part fits too), so its count only falls
        # as the capacity grows: where both ends of a range agree, so does every capacity between.
        known: dict[int, int] = {}

        def parts(c: int, flat: tuple[int, ...] = flat, known: dict[int, int] = known) -> int:
            if c not in known:
                known[c] = len(plan_parts_flat(flat, k, c)) - 1
            return known[c]

        todo = [(k, top)]
        while todo:
            lo, hi = todo.pop()
            a, b = parts(lo), parts(hi)
            if a == b:
                add(lo, hi, a)
            else:
                mid = (lo + hi) // 2
                todo += [(lo, mid), (mid + 1, hi)]
    return list(itertools.accumulate(diff[:-1]))


def layer_extra_parts(steps: Steps, shape: ModelShape, chunk_tokens: int, *,
                      by_expert: bool = True) -> tuple[dict[int, list[int]], str]:
    """`extra_parts` of every MoE layer's chunks, and their source ("log" or "derived")."""
    per, source = chunks(steps, shape, chunk_tokens)
    return {ly: extra_parts(ch, shape.top_k, shape.num_experts, by_expert=by_expert) for ly, ch in per.items()}, source


__all__ = ["chunks", "extra_parts", "layer_extra_parts"]
