"""How many prompt tokens one prefill forward takes (`forward.prefill_chunk_tokens`), sans I/O.

A prefill chunk of T tokens routes, at each MoE layer, to the union of its tokens' experts:
with E experts, top-k and routes spread evenly, E (1 - (1 - k/E)^T) of them. A streamed layer
reads what of that union is not in its pool, once per chunk when the union fits the layer's
slots, so the bytes read per prompt token fall as 1/T once the union saturates (T of a few
hundred on a 128- or 512-expert layer). When the union does not fit, the layer-step runs in
parts (qnpipe.policy.parts), each of which reads what the previous part's slots do not hold:
bytes per token then stay flat in T. Either way they never rise with T, so the chunk that
minimises bytes read per prompt token is the longest whose activations fit the memory
budget. A resident model reads nothing; its prefill speed is flat above a few hundred tokens
and mlx-lm steps 2048 at a time (`prefill_step_size`).

The engine's default is one chunk for both tiers (`DEFAULT_CHUNK`): chunked prefill changes
low-order bits (different matmul shapes round differently), so a chunk that followed the
pool would give different logits at different memory budgets; one chunk keeps them
bit-identical. `longest_fitting_chunk` is what a planner calls for a tight budget.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["DEFAULT_CHUNK", "bytes_per_prompt_token", "expected_union", "longest_fitting_chunk"]

DEFAULT_CHUNK = 512  # as fast as 2048 resident (docs/measurements.md "Prefill"), and a chat turn resumes closer


def expected_union(tokens: int, experts: int, top_k: int) -> float:
    """Expected distinct experts of `tokens` tokens at one layer, routes spread evenly."""
    if tokens <= 0:
        return 0.0
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


def bytes_per_prompt_token(chunk: int, *, experts: int, top_k: int, capacity: int, record_bytes: int,
                           layers: int) -> float:
    """Bytes a streamed prefill reads per prompt token at `chunk` tokens a forward (a cold pool of
    `capacity` slots a layer, routes spread evenly): the union once per chunk when it fits, else
    what each part of the layer-step misses of the previous part's slots."""
    if chunk <= 0:
        raise ValueError(f"chunk must be > 0, got {chunk}")
    union = expected_union(chunk, experts, top_k)
    if union <= capacity:
        return layers * record_bytes * union / chunk
    # Parts of p tokens whose union fills the slots; each holds C of the E experts, so a part
    # finds a fraction C/E of its union already there.
    p = 1
    while expected_union(p + 1, experts, top_k) <= capacity:
        p += 1
    return layers * record_bytes * capacity * (1.0 - capacity / experts) / p


def longest_fitting_chunk(activation_bytes: Callable[[int], int], budget_bytes: int, *,
                          longest: int = DEFAULT_CHUNK, shortest: int = 1) -> int:
    """The longest chunk, a power of two from `shortest` up to `longest` (or `longest` itself),
    whose forward's activations (`activation_bytes(tokens)`, e.g. qnpipe.plan.account's) fit
    `budget_bytes`: the chunk that minimises bytes read per prompt token within the budget
    (module docstring). `shortest` when none fits: the budget is then the planner's to refuse."""
    if activation_bytes(longest) <= budget_bytes:
        return longest
    t = shortest
    while t * 2 < longest and activation_bytes(t * 2) <= budget_bytes:
        t *= 2
    return t
