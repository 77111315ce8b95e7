"""Typed, frozen statistics snapshots returned by the engine."""

from __future__ import annotations

import enum

import msgspec

from qnpipe.compute.blas import BlasInfo
from qnpipe.mtp_stats import SpecStats


class FinishReason(enum.StrEnum):
    EOS = "eos"
    LENGTH = "length"


class GenerateStats(msgspec.Struct, frozen=True, kw_only=True):
    """Figures of one `generate` call. Times in seconds, memory in bytes."""

    prompt_tokens: int
    generated_tokens: int
    prefill_s: float
    decode_s: float
    prefill_tok_s: float
    decode_tok_s: float
    peak_memory_bytes: int
    finish_reason: FinishReason
    prefix_tokens_reused: int = 0  # prompt tokens resumed from a prefix snapshot (not prefilled)
    mtp: SpecStats | None = None  # MTP speculation's figures (None: plain decoding)


class LayerPoolStats(msgspec.Struct, frozen=True, kw_only=True):
    """One MoE layer's pool: capacity, slots in use, and what its steps found."""

    layer: int
    capacity: int
    occupancy: int
    hits: int
    misses: int
    evictions: int
    prefetch_recall: float = 0.0  # predicted and used / used, this layer (0 without prediction)


class UnionProf(msgspec.Struct, frozen=True, kw_only=True):
    """diag.union_prof: the distinct experts a layer needed per step of `tokens` tokens."""

    tokens: int
    layer: int
    layer_steps: int
    mean_union: float
    max_union: int


class PoolStats(msgspec.Struct, frozen=True, kw_only=True):
    """The streaming pool since the engine opened.

    With prediction on, `misses_by_cause` uses the causes of qnpipe.policy.pool.MissKind
    (each miss exactly one); `prefetch_recall` = predicted and used / used,
    `useful_prefetch_ratio` = prefetches used / issued, `wasted_bytes` = prefetched records
    evicted or cleared unused.

    `misses` counts experts a step needed that were not resident (`misses_by_cause`:
    "cold" = first use in that layer, "capacity" = evicted earlier); `reads` the records
    read (merged duplicates read once); `stall_s` the time the forward waited for grants
    that had misses; `split_layer_steps` the layer-steps whose experts did not fit at once
    and ran in parts; `early_grants` the layer-steps whose experts already in memory started
    before their misses were read (`forward.early_grants`).
    """

    hits: int = 0
    misses: int = 0
    misses_by_cause: dict[str, int] = msgspec.field(default_factory=dict)
    hit_rate: float = 0.0
    reads: int = 0
    bytes_read: int = 0
    merged_reads: int = 0
    peak_reads_in_flight: int = 0
    device_s: float = 0.0
    stall_s: float = 0.0
    steps: int = 0
    layer_steps: int = 0
    split_layer_steps: int = 0
    early_grants: int = 0
    slot_bytes: int = 0
    layers: tuple[LayerPoolStats, ...] = ()
    # -- prediction and prefetch (zero when predict.cross_layer_prefetch is off)
    pinned: int = 0  # experts pinned by autopin (read once at start-up, not misses)
    side_hits: int = 0  # hits the side region or a prefetch served (prefetch_hits + victim_hits)
    prefetch_hits: int = 0  # hits on experts a prefetch read brought in
    victim_hits: int = 0  # hits the side region kept after the resident slots gave them up (no read)
    prefetch_issued: int = 0
    prefetch_done: int = 0
    prefetch_used: int = 0
    prefetch_expired: int = 0
    useful_prefetch_ratio: float = 0.0
    prefetch_recall: float = 0.0
    wasted_bytes: int = 0
    hints: int = 0
    hints_dropped_full: int = 0
    hints_dropped_budget: int = 0
    candidates_dropped: int = 0
    stall_s_by_layer: dict[int, float] = msgspec.field(default_factory=dict)
    # diag.union_prof: per (step length, layer): layer-steps, mean and max distinct experts
    union_prof: tuple[UnionProf, ...] = ()


class PrefixStats(msgspec.Struct, frozen=True, kw_only=True):
    """Prefix snapshots since the engine opened (qnpipe.live.prefix).

    `hits` resumed a prompt from a kept state (`disk_loads` of them read from the snapshot
    directory), `misses` found none; `tokens_reused` prompt tokens not prefilled again;
    `captures` states taken, `disk_writes` head states written, `evictions` states the LRU
    dropped, `ignored_files` stale or corrupt files skipped; `entries`/`bytes` kept now.
    """

    hits: int = 0
    misses: int = 0
    tokens_reused: int = 0
    disk_loads: int = 0
    disk_writes: int = 0
    captures: int = 0
    evictions: int = 0
    ignored_files: int = 0
    entries: int = 0
    bytes: int = 0


class EngineStats(msgspec.Struct, frozen=True, kw_only=True):
    """Totals since the engine opened.

    `expert_source` says how experts are served: "resident" (every expert in memory, no
    reads or misses to count) or "pool" (streamed; `pool` has the figures). `load_s` is the
    time the engine took to open (weights, pool, actors), `warmup_s` that of the throwaway
    forward paying MLX's one-time start-up (0 when the engine was opened without it); neither
    is in `prefill_s`.
    """

    requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    decoded_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_tok_s: float = 0.0
    peak_memory_bytes: int = 0
    expert_source: str = "resident"
    resident_expert_bytes: int = 0
    expert_bytes_read: int = 0
    expert_misses_by_cause: dict[str, int] = msgspec.field(default_factory=dict)
    pool: PoolStats | None = None
    prefix: PrefixStats | None = None  # None when prefix snapshots are off
    kv_bytes_per_token: int = 0  # KV cache per token of context, full-attention layers (kv.quantize counted)
    mtp: SpecStats | None = None  # summed over the requests that speculated
    load_s: float = 0.0
    warmup_s: float = 0.0
    cpu_blas: BlasInfo | None = None  # the BLAS of MLX's CPU matmuls (compute.cpu_blas)

    def add(self, g: GenerateStats) -> EngineStats:
        decode_s = self.decode_s + g.decode_s
        # The first token of each request comes out of prefill; decode makes the rest.
        decoded = self.decoded_tokens + max(g.generated_tokens - 1, 0)
        return msgspec.structs.replace(
            self,
            requests=self.requests + 1,
            prompt_tokens=self.prompt_tokens + g.prompt_tokens,
            generated_tokens=self.generated_tokens + g.generated_tokens,
            decoded_tokens=decoded,
            prefill_s=self.prefill_s + g.prefill_s,
            decode_s=decode_s,
            decode_tok_s=_rate(decoded, decode_s),
            peak_memory_bytes=max(self.peak_memory_bytes, g.peak_memory_bytes),
            mtp=g.mtp if self.mtp is None else self.mtp.add(g.mtp) if g.mtp is not None else self.mtp,
        )


def _rate(n: int, s: float) -> float:
    return n / s if s > 0 else 0.0


class GenerateResult(msgspec.Struct, frozen=True, kw_only=True):
    """What `generate` returns: the new tokens, their text, and the call's stats."""

    tokens: tuple[int, ...]
    text: str
    stats: GenerateStats
