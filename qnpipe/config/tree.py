"""The ``Config`` tree: per-actor sections of typed, frozen settings, with their defaults.

Values come from ``qnpipe.config.load`` (the only place that reads the environment or
a TOML file); this module only declares what exists. Units are in field names; the
description of each field (``_doc``) is what docs/config.md is generated from.
"""

from __future__ import annotations

import enum
import hashlib
import os
import re
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from qnpipe.errors import ConfigError

# --------------------------------------------------------------------------- types


def _doc(text: str) -> Meta:
    # The description lands in msgspec's type info, so docs/config.md is generated from it.
    return Meta(description=text)


def _cap(n: int) -> Meta:
    # The upper bound of a count that sizes something (threads, slots, arrays, loops): far above any use
    # (the 80B has 512 experts a layer, a draft is a few tokens), far below what would exhaust memory or
    # threads, so `read.workers=10**9` is an error naming the key at start-up, not a crash while the engine
    # builds. Counts that size nothing (periods, seeds, token thresholds) have none. `extra` tells a cap
    # ("at most N" in the loader's messages) from a range such as `kv.k_bits`'s.
    return Meta(le=n, extra={"cap": n})


NonNegInt = Annotated[int, Meta(ge=0)]
PosInt = Annotated[int, Meta(ge=1)]
NonNegFloat = Annotated[float, Meta(ge=0.0)]
Fraction = Annotated[float, Meta(ge=0.0, le=1.0)]
QuantBits = Annotated[int, Meta(ge=2, le=8)]
# Every tuple-of-int field is a layer set: sorted, unique, empty = all layers.
LayerSet = tuple[Annotated[int, Meta(ge=0)], ...]


class EvictPolicy(enum.StrEnum):
    """The built-in eviction policies (docs/pool.md); `pool.evict_policy` also takes a plug-in class."""

    LFU = "lfu"
    LRU = "lru"
    FIFO = "fifo"
    LRFU = "lrfu"  # frequency with recency; measured on real traces in docs/pool.md
    # libCacheSim's policies, with its semantics (tests/policy/test_libcachesim.py)
    CLOCK = "clock"
    ARC = "arc"
    S3FIFO = "s3fifo"
    SIEVE = "sieve"


# A plug-in policy: an importable module and a class in it (qnpipe.policy.eviction_plugin loads it).
_PLUGIN_SPEC = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")
_EVICT_POLICY_VALUES = frozenset(EvictPolicy)
EVICT_POLICY_ALLOWED = f"one of {', '.join(EvictPolicy)}, or a plug-in class package.module:Class"


def check_evict_policy(value: str) -> str:
    """`value` as `pool.evict_policy` holds it: an `EvictPolicy`, or a plug-in's "package.module:Class".

    A built-in's name is matched without case, '-' or '_' (`s3-fifo`, the paper's spelling, is `s3fifo`).
    Raises ConfigError naming the value when it is neither.
    """
    try:
        return EvictPolicy(value)
    except ValueError:
        pass
    folded = value.lower().replace("-", "").replace("_", "")
    if folded in _EVICT_POLICY_VALUES:
        return EvictPolicy(folded)
    if _PLUGIN_SPEC.fullmatch(value):
        return value
    raise ConfigError(f"pool.evict_policy {value!r} is neither a built-in eviction policy nor a plug-in "
                      f"package.module:Class; allowed: {EVICT_POLICY_ALLOWED}")


class ReadBackend(enum.StrEnum):
    """How the SSD reader issues its preads: the C extension, the Python fallback, or the first available."""

    AUTO = "auto"
    C = "c"
    PYTHON = "python"


class PrefetchInto(enum.StrEnum):
    """Where a prefetched expert lands (docs/pool.md, "Prefetch placement")."""

    SIDE = "side"  # the side region, apart from the resident slots
    MAIN = "main"  # the resident region, as its eviction policy decides


class PredictAgg(enum.StrEnum):
    """How the predictor combines the tokens of one verify step."""

    MAX = "max"
    MEAN = "mean"
    UNION = "union"


class MtpVerifyMode(enum.StrEnum):
    """How MTP drafts are verified: all in one forward, or one forward each (reference)."""

    BATCH = "batch"
    SEQUENTIAL = "sequential"


class HiddenVariant(enum.StrEnum):
    """Which hidden state of the main model is recorded and fed onward."""

    PRE_FINAL_NORM = "pre_final_norm"
    POST_FINAL_NORM = "post_final_norm"


class MtpHidden(enum.StrEnum):
    """Which hidden state feeds the MTP drafter."""

    PRE_NORM = "pre_norm"
    POST_NORM = "post_norm"


class ModelTier(enum.StrEnum):
    """Which code runs a qwen3_next model; every other family runs on the generic tier."""

    NATIVE = "native"
    GENERIC = "generic"


class _Section(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of the sub-structs: the struct options are inherited."""


# --------------------------------------------------------------------------- the tree


class ModelCfg(_Section, frozen=True):
    """Where the model lives. Empty paths are derived from ``model_dir``."""

    model_dir: Annotated[str, _doc("model directory")] = "models/Qwen3-Next-80B-A3B-Instruct-MLX-8bit"
    config_path: Annotated[str, _doc("model config.json (empty = <model_dir>/config.json)")] = ""
    mtp_weights_path: Annotated[str, _doc("MTP weights (empty = <model_dir>/mtp.safetensors)")] = ""
    expert_dir: Annotated[str, _doc("per-expert store (empty = <model_dir>/experts)")] = ""
    hidden_variant: Annotated[HiddenVariant, _doc("hidden state recorded and fed onward")] = HiddenVariant.PRE_FINAL_NORM
    # Only qwen3_next has a native model; the generic tier (mlx-lm's own model, its switches pooled)
    # runs it too, so the two cross-check each other (docs/model.md).
    tier: Annotated[ModelTier, _doc("qwen3_next on qnpipe's own model (native) or mlx-lm's (generic); "
                                    "other families are always generic")] = ModelTier.NATIVE

    def resolved_config_path(self) -> str:
        """The model's ``config.json`` path, derived from ``model_dir`` when not set."""
        return self.config_path or os.path.join(self.model_dir, "config.json")

    def resolved_mtp_weights_path(self) -> str:
        """The MTP weights path, derived from ``model_dir`` when not set."""
        return self.mtp_weights_path or os.path.join(self.model_dir, "mtp.safetensors")

    def resolved_expert_dir(self) -> str:
        """The expert store directory, derived from ``model_dir`` when not set."""
        return self.expert_dir or os.path.join(self.model_dir, "experts")


class MemoryCfg(_Section, frozen=True):
    """MLX memory limits (long sessions)."""

    mlx_cache_limit_gb: Annotated[NonNegFloat, _doc("cap on MLX's reusable buffer cache")] = 1.0
    # Must stay below the device's recommended working set; 0 leaves wiring to MLX.
    mlx_wired_limit_gb: Annotated[NonNegFloat, _doc("wire this many GB (0 = off)")] = 0.0


class PoolCfg(_Section, frozen=True):
    """Resident expert pool, side region, eviction and autopin (persisted heat)."""

    # The cap is no use limit: the slots are clamped to the model's experts per layer anyway.
    expert_slots: Annotated[PosInt, _cap(1 << 16), _doc("resident expert slots per layer")] = 64
    capacity_profile_path: Annotated[str, _doc("file of per-layer capacities (empty = expert_slots everywhere)")] = ""
    eager_load: Annotated[bool, _doc("load every expert up front (all-resident reference mode)")] = False
    # A str, not the enum: a plug-in is any "package.module:Class" (checked in __post_init__).
    evict_policy: Annotated[str, Meta(description="eviction policy, built-in or plug-in (docs/pool.md)",
                                      extra={"allowed": EVICT_POLICY_ALLOWED})] = EvictPolicy.LFU
    lfu_decay_interval_forwards: Annotated[NonNegInt, _doc("halve LFU counts every N forwards (0 = never)")] = 0
    lrfu_lambda: Annotated[Fraction, _doc(
        "LRFU's λ: an access counts 2^(-λ·age), age in accesses of the layer (0 = LFU, 1 ≈ LRU)")] = 0.05
    autopin: Annotated[bool, _doc("count routing heat, persist it, pin each layer's hottest experts at start-up")] = True
    autopin_usage_file: Annotated[str, _doc("heat file (empty = <expert dir>/pool_usage.json)")] = ""
    autopin_save_every_forwards: Annotated[PosInt, _doc("persist heat every N forwards (and at exit)")] = 200
    # Pinned slots never leave: above ~0.5 the demand path runs short of free slots.
    autopin_budget_frac: Annotated[Fraction, _doc("pinned share of each layer's capacity, 0..1")] = 0.5
    # Allocated per layer beside the slots; more than a layer has experts is no use.
    side_region_slots: Annotated[NonNegInt, _cap(1024), _doc("side-region (speculative) slots per layer")] = 3
    # qnpipe's side slots live in the resident slots' stacked arrays, so there is no copy to
    # skip: false (the legacy default) only warns.
    side_region_zerocopy: Annotated[bool, _doc(
        "read side-region experts in place, no copy into the resident region (always; false warns)")] = True
    # Measured hit 0.709 (cleared each step) vs 0.81 (persistent) at 32+32 slots.
    side_region_lfu: Annotated[bool, _doc("side region keeps hot experts across steps (persistent LFU)")] = True
    prefetch_into: Annotated[PrefetchInto, _doc(
        "where prefetches land: side (the side region) or main (the resident region, its eviction policy "
        "choosing the victim; the side region then keeps what prefetches displaced)")] = PrefetchInto.SIDE

    def __post_init__(self) -> None:
        msgspec.structs.force_setattr(self, "evict_policy", check_evict_policy(self.evict_policy))


class ReadCfg(_Section, frozen=True):
    """The read scheduler and the SSD reader."""

    # The C reader's thread pool takes at most 1024.
    workers: Annotated[PosInt, _cap(1024), _doc("parallel reader threads (device queue depth)")] = 8
    window_layers: Annotated[NonNegInt, _cap(4096), _doc("layers of lookahead the reader keeps")] = 3
    # On by default so every benchmark measures real cold reads, not the page cache.
    nocache: Annotated[bool, _doc("bypass the OS page cache (F_NOCACHE / O_DIRECT)")] = True
    # Measured best: larger budgets flood the shared queue and prefetches land later.
    bg_budget_experts: Annotated[NonNegInt, _cap(1 << 20), _doc("background prefetch budget, experts in flight")] = 12
    # Measured 6.4 GB/s serial vs 22 GB/s 8-way.
    batch_miss_read: Annotated[bool, _doc("read all of a layer's misses as one parallel batch")] = True
    prefetch_budget_experts: Annotated[Annotated[NonNegInt, _cap(1 << 20)] | None, _doc(
        "per-call prefetch budget (none = the caller's)")] = None
    verify_hit_bytes: Annotated[bool, _doc("diagnostic: after a hit, compare slot bytes with disk")] = False
    verify_crc32: Annotated[bool, _doc("diagnostic: check each record's crc32 as it is read")] = False
    backend: Annotated[ReadBackend, _doc("preads via the C extension, the Python fallback, or auto")] = ReadBackend.AUTO
    device_profile_path: Annotated[str, _doc("measured device profile: written by qnpipe bench io, read by "
                                             "--device measured (empty = <user cache dir>/device-profile.json)")] = ""


class PredictCfg(_Section, frozen=True):
    """Cross-layer expert prediction and the prefetch budgets it feeds."""

    cross_layer_prefetch: Annotated[bool, _doc("predict and prefetch experts of later layers")] = False
    ahead_layers: Annotated[NonNegInt, _cap(4096), _doc(
        "fixed layers ahead (0 = ahead_lo/ahead_hi by cutoff_layer)")] = 0
    # One token lists W candidates per target; a step of several tokens (prefill chunk, verify)
    # lists more, all of which its layer may need: keep up to W x mult of them.
    candidate_mult: Annotated[PosInt, _cap(4096), _doc(
        "a step's hint per target layer names at most width_experts x candidate_mult experts")] = 2
    # Realised hit tops out at 24 (~0.90); wider reads miss their window and steal bandwidth.
    width_experts: Annotated[PosInt, _cap(1 << 16), _doc("candidates per predicted layer (top-W of its gate)")] = 24
    cutoff_layer: Annotated[NonNegInt, _cap(4096), _doc(
        "layers below predict ahead_lo_layers ahead, the rest ahead_hi_layers")] = 6
    ahead_lo_layers: Annotated[PosInt, _cap(4096), _doc("layers ahead below the cutoff (recall)")] = 1
    ahead_hi_layers: Annotated[PosInt, _cap(4096), _doc("layers ahead from the cutoff on (time)")] = 3
    # Measured +3.6 points of recall over the normed residual.
    use_moe_input: Annotated[bool, _doc("feed the target gate this layer's MoE input")] = True
    aggregate: Annotated[PredictAgg, _doc("combine the tokens of a verify step")] = PredictAgg.MAX
    union_k: Annotated[PosInt, _cap(1 << 16), _doc("per-token top-k for union aggregation")] = 8
    file_global_budget_experts: Annotated[NonNegInt, _cap(1 << 20), _doc("global cap on file prefetches")] = 64
    stage_global_budget_experts: Annotated[NonNegInt, _cap(1 << 20), _doc("global cap on staged prefetches")] = 64
    min_score: Annotated[float, _doc("drop candidates scoring below this")] = 0.0
    per_layer_budget_experts: Annotated[NonNegInt, _cap(1 << 16), _doc("per-layer prefetch cap")] = 4


class PrefixCfg(_Section, frozen=True):
    """Prefix snapshots: skip re-prefilling a shared prompt head."""

    # An agent's ~2600-token system+tools head took 158 s to prefill.
    snapshot_head_tokens: Annotated[NonNegInt, _doc("snapshot model state after the first N prompt tokens (0 = off)")] = 2048
    max_entries: Annotated[PosInt, _cap(4096), _doc("snapshots kept (LRU, tens of MB each)")] = 4
    snapshot_dir: Annotated[str, _doc("directory of head snapshots shared across processes (empty = memory only)")] = ""


class ChatCfg(_Section, frozen=True):
    """Chat template rendering."""

    # qnpipe differs from the legacy system here: its default named one deployment's four tools.
    tools_allow: Annotated[tuple[str, ...], _doc("only these tools are rendered (empty = all tools)")] = ()

    def __post_init__(self) -> None:
        names = tuple(dict.fromkeys(n.strip() for n in self.tools_allow if n.strip()))
        msgspec.structs.force_setattr(self, "tools_allow", names)


class MtpCfg(_Section, frozen=True):
    """Multi-token-prediction self-speculative decoding."""

    enabled: Annotated[bool, _doc("draft with the MTP head and verify (lossless under greedy)")] = False
    verify_mode: Annotated[MtpVerifyMode, _doc("verify drafts in one forward, or one at a time")] = MtpVerifyMode.BATCH
    bits: Annotated[Literal[2, 3, 4, 5, 6, 8], _doc("drafter quantization bits (8: better acceptance, +0.7 GB)")] = 4
    hidden: Annotated[MtpHidden, _doc("hidden state that feeds the drafter")] = MtpHidden.PRE_NORM
    # Each draft is one MTP forward and one verify row.
    num_draft_tokens: Annotated[PosInt, _cap(64), _doc("drafts per step (K) with fixed depth")] = 3
    adaptive_depth: Annotated[bool, _doc("draft while cumulative confidence >= conf_tau")] = False
    conf_tau: Annotated[Fraction, _doc("confidence threshold of adaptive depth")] = 0.3
    # Deeper than the slot budget allows must split the step, never overflow.
    depth_max: Annotated[PosInt, _cap(64), _doc("maximum adaptive draft depth")] = 3
    adaptive_rescue: Annotated[bool, _doc("adaptive depth plus top-2 rescue on deep chains")] = False
    tree_top2: Annotated[bool, _doc("verify the 2nd choice when the first draft is rejected")] = False
    tree_top2_p1: Annotated[bool, _doc("the same at the second draft position")] = False
    tree_verify: Annotated[bool, _doc("verify tree_branches candidate paths as one batch")] = False
    tree_branches: Annotated[int, Meta(ge=2), _cap(64), _doc("candidate paths for tree verify")] = 2

    def __post_init__(self) -> None:
        # The legacy system silently let one variant win; qnpipe makes the choice explicit.
        if self.tree_top2_p1 and not self.tree_top2:
            raise ConfigError("mtp.tree_top2_p1=true extends mtp.tree_top2: set mtp.tree_top2=true too")
        if self.adaptive_rescue and not self.adaptive_depth:
            raise ConfigError("mtp.adaptive_rescue=true extends mtp.adaptive_depth: set mtp.adaptive_depth=true too")
        if self.adaptive_depth and self.tree_top2:
            raise ConfigError(
                "mtp.adaptive_depth and mtp.tree_top2 are exclusive; mtp.adaptive_rescue combines them"
            )
        if self.tree_verify and (self.tree_top2 or self.adaptive_depth):
            raise ConfigError(
                "mtp.tree_verify excludes mtp.tree_top2 and mtp.adaptive_depth: choose one verify variant"
            )


class ForwardCfg(_Section, frozen=True):
    """The forward actor (model, prefill, sampling)."""

    # mlx-lm's prefill step, for both tiers: a chunk that does not depend on the pool keeps the
    # logits bit-identical across memory budgets, and a long chunk reads each expert a layer-step
    # needs once for all its tokens (qnpipe.policy.prefill; docs/model.md "Prefill chunk").
    prefill_chunk_tokens: Annotated[NonNegInt, _doc("prefill in chunks of N tokens (0 = whole prompt)")] = 512
    # Expert-major parts read each expert a split layer-step needs once; token-major ranges re-read an
    # expert for every range that names it (qnpipe.policy.parts).
    parts: Annotated[Literal["experts", "tokens"], _doc(
        "a layer-step whose experts do not fit the layer's slots runs in parts of experts or of tokens")] = "experts"
    moe_topk_override: Annotated[Annotated[PosInt, _cap(1 << 16)] | None, _doc(
        "diagnostic: change the router's top-k (breaks exactness)")] = None
    # Not a switch of the system qnpipe replaces: off is the A/B reference (tools/bench_stream.py).
    early_grants: Annotated[bool, _doc("start a layer's experts already in memory while its misses are read")] = True
    # Off: on the CPU backend it costs more host time than the overlap gives back (docs/measurements.md,
    # "Speculated hits"); qnpipe.model.speculate says why it is exact. A/B: tools/bench_stream.py --spec-ab.
    speculate_hits: Annotated[bool, _doc(
        "queue a decode step's experts before the router's sync, from the slots they had last time")] = False


class KvCfg(_Section, frozen=True):
    """KV-cache quantization of the full-attention layers."""

    quantize: Annotated[bool, _doc("quantize the KV cache of the full-attention layers")] = False
    k_bits: Annotated[QuantBits, _doc("key bits")] = 4
    v_bits: Annotated[QuantBits, _doc("value bits")] = 3
    group_size: Annotated[PosInt, _cap(1 << 16), _doc("affine quantization group size (must divide head_dim)")] = 64
    rotate: Annotated[bool, _doc("fixed random SO(4) block rotation before quantizing")] = True
    rot_seed: Annotated[NonNegInt, _doc("rotation seed")] = 0


class DiagCfg(_Section, frozen=True):
    """Diagnostic switches: all off by default and free when off."""

    route_verify: Annotated[bool, _doc("check every token and layer reads the slot holding its routed expert")] = False
    window_prof: Annotated[bool, _doc("window timing probe")] = False
    stream_prof: Annotated[bool, _doc("streaming timing probe")] = False
    prefetch_tprof: Annotated[bool, _doc("host time of predict / submit / promote")] = False
    predict_recall_prof: Annotated[bool, _doc("recall of the prediction vs the real routing")] = False
    miss_attrib: Annotated[bool, _doc("detailed miss-cause probe")] = False
    union_prof: Annotated[bool, _doc("per-layer expert union size per forward, by sequence length")] = False
    accept_topk: Annotated[NonNegInt, _cap(1 << 20), _doc(
        "record whether the true token is in the drafter's top-k (0 = off)")] = 0
    # A generation that makes no progress this long is a deadlock: fail with the evidence, never hang.
    watchdog_s: Annotated[NonNegFloat, _doc("raise StallError when a step makes no progress for N s; a plug-in "
                                            "eviction policy's call running N s ends the process (0 = off)")] = 60.0


class TraceCfg(_Section, frozen=True):
    """Routing log and event log output."""

    route_trace: Annotated[bool, _doc("record the routing log")] = False
    route_trace_path: Annotated[str, _doc("routing log file")] = "route_trace.msgpack"
    route_trace_layers: Annotated[LayerSet, _doc("layers recorded in the routing log (empty = all)")] = ()
    event_log_path: Annotated[str, _doc("event log file (empty = not written)")] = ""

    def __post_init__(self) -> None:
        msgspec.structs.force_setattr(self, "route_trace_layers", tuple(sorted(set(self.route_trace_layers))))


class ComputeCfg(_Section, frozen=True):
    """Where MLX computes on the CPU."""

    # The bundled reference BLAS of mlx[cpu] on Linux is 24x slower than OpenBLAS (1 thread) on a 256-row matmul
    # (docs/measurements.md); chosen once per process, before MLX is imported (qnpipe/compute/blas.py).
    cpu_blas: Annotated[str, _doc(
        "BLAS of MLX's CPU matmuls on Linux: auto (the scipy-openblas32 wheel's OpenBLAS), bundled (MLX's "
        "reference BLAS), or a BLAS library path")] = "auto"
    # An optimized BLAS gives a row other bits in a matmul of another row count, so decode, MTP
    # verify, prefill chunks and parts would disagree; the kernel measured no slower in decode (docs/measurements.md).
    batch_invariant: Annotated[bool, _doc(
        "with an optimized cpu_blas, compute matmuls with a kernel whose rows do not depend on the row "
        "count (exact decode = verify = chunked prefill), process-wide")] = True


# --------------------------------------------------------------------------- distributed (issue 28)
# Kept apart from the sections above so that concurrent additions to them merge cleanly.


class DistributedCfg(_Section, frozen=True):
    """Pipeline parallel over `mx.distributed` (docs/distributed.md): each rank runs a range of layers."""

    enabled: Annotated[bool, _doc("run as one rank of an mx.distributed group (started by mlx.launch)")] = False
    # A rank named in the hostfile that never starts would leave the others in MLX's connect forever.
    connect_timeout_s: Annotated[NonNegFloat, _doc("give up when the ring is not connected after N s (0 = never)")] = 60.0
    # MLX's ring recv cannot be interrupted: a peer that hangs without closing its socket is only
    # noticed by a deadline, and then the process exits (docs/distributed.md, "Failures"). An idle
    # rank 0 sends a keep-alive, so the later ranks' waits between requests have it too.
    step_timeout_s: Annotated[NonNegFloat, _doc("exit when a wait for another rank (a step's answer, rank 0's "
                                                "next message) takes over N s (0 = never)")] = 600.0


# --------------------------------------------------------------------------- memory planner (issue 26)


class PlanCfg(_Section, frozen=True):
    """Planning the pool for a memory budget at start-up (`--memory 8GB`; docs/plan.md)."""

    # Set, the plan sets the slots per layer, the eviction policy, prefetch and autopin, each unless given
    # (qnpipe.plan.fixed: planned with it, or refused).
    memory: Annotated[str, _doc("plan the pool for this budget at start-up, e.g. 8GB (GB = 2^30 bytes; "
                                "empty = off)")] = ""
    log: Annotated[str, _doc("routing or event log to plan from (empty = <expert dir>/trace.qtrace when "
                             "present, else a synthetic log of the model's shape)")] = ""
    device: Annotated[str, _doc("device profile the plan's prediction is for: measured (this machine's, "
                                "measured once), a built-in name, or a profile file")] = "measured"
    cost_path: Annotated[str, _doc("compute cost model of the prediction (qnpipe trace fit-cost; empty = "
                                   "the default model)")] = ""
    context_tokens: Annotated[PosInt, _doc("context the planned KV cache must hold, in tokens")] = 8192
    cache_dir: Annotated[str, _doc("where plans are cached (empty = <expert dir>/plans)")] = ""
    # Measured by default (qnpipe.plan.process): the interpreter and libraries differ by machine and install.
    process_bytes: Annotated[NonNegInt, _doc("the process outside MLX (interpreter, libraries, tokenizer) the budget "
                                             "holds, in bytes (0 = measure this process at start-up)")] = 0


# --------------------------------------------------------------------------- waits on other hosts (issue 34)

# A wait on another host has a bound, always: zero is refused, not "never".
WaitSeconds = Annotated[float, Meta(gt=0.0, le=3600.0)]
HUB_TIMEOUT_S = 30.0
DASK_CONNECT_TIMEOUT_S = 10.0


class NetCfg(_Section, frozen=True):
    """How long qnpipe waits on another host before it gives up, naming the host and the bound."""

    # A Hub endpoint or proxy that accepts and never answers would otherwise stall `convert` for good:
    # huggingface_hub asks for the repository's file list with no timeout at all.
    hub_timeout_s: Annotated[WaitSeconds, _doc(
        "convert OWNER/NAME: the longest wait for a connection to the Hub (or its proxy) and for each "
        "answer or piece of a download, in s")] = HUB_TIMEOUT_S
    # distributed's own connect timeout does not cover its handshake: a port that accepts and never
    # answers held `Client(address)` for good.
    dask_connect_timeout_s: Annotated[WaitSeconds, _doc(
        "sweep --executor dask: give up when the scheduler has not answered after N s")] = DASK_CONNECT_TIMEOUT_S


# dict=True: `load` and `with_overrides` note in the instance's __dict__ which settings were given and where
# (qnpipe.config.loader.explicit_settings), beside the fields: neither the fingerprint nor the encoded tree has it.
class Config(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, dict=True):
    """qnpipe's whole configuration. Build it with ``config.load``; derive variants with ``config.with_overrides``."""

    model: Annotated[ModelCfg, _doc("model files")] = msgspec.field(default_factory=ModelCfg)
    memory: Annotated[MemoryCfg, _doc("MLX memory limits")] = msgspec.field(default_factory=MemoryCfg)
    pool: Annotated[PoolCfg, _doc("expert pool")] = msgspec.field(default_factory=PoolCfg)
    read: Annotated[ReadCfg, _doc("read scheduler")] = msgspec.field(default_factory=ReadCfg)
    predict: Annotated[PredictCfg, _doc("predictor")] = msgspec.field(default_factory=PredictCfg)
    prefix: Annotated[PrefixCfg, _doc("prefix snapshots")] = msgspec.field(default_factory=PrefixCfg)
    chat: Annotated[ChatCfg, _doc("chat template")] = msgspec.field(default_factory=ChatCfg)
    mtp: Annotated[MtpCfg, _doc("MTP speculation")] = msgspec.field(default_factory=MtpCfg)
    forward: Annotated[ForwardCfg, _doc("forward actor")] = msgspec.field(default_factory=ForwardCfg)
    kv: Annotated[KvCfg, _doc("KV quantization")] = msgspec.field(default_factory=KvCfg)
    diag: Annotated[DiagCfg, _doc("diagnostics")] = msgspec.field(default_factory=DiagCfg)
    trace: Annotated[TraceCfg, _doc("trace output")] = msgspec.field(default_factory=TraceCfg)
    compute: Annotated[ComputeCfg, _doc("CPU compute")] = msgspec.field(default_factory=ComputeCfg)
    distributed: Annotated[DistributedCfg, _doc("pipeline parallel over mx.distributed")] = msgspec.field(
        default_factory=DistributedCfg)
    plan: Annotated[PlanCfg, _doc("memory planner at start-up")] = msgspec.field(default_factory=PlanCfg)
    net: Annotated[NetCfg, _doc("waits on other hosts")] = msgspec.field(default_factory=NetCfg)

    def fingerprint(self) -> str:
        """The sha256 hex digest of this config's canonical JSON (sorted keys).

        Equal configs give equal fingerprints in every process; it goes into trace headers.
        """
        canonical = msgspec.json.encode(msgspec.to_builtins(self), order="sorted")
        return hashlib.sha256(canonical).hexdigest()

    def autopin_usage_path(self) -> str:
        """The autopin heat file: ``pool.autopin_usage_file`` or ``<expert dir>/pool_usage.json``."""
        return self.pool.autopin_usage_file or os.path.join(self.model.resolved_expert_dir(), "pool_usage.json")

    def recorded_log_path(self) -> str:
        """The log `--trace` without a file writes and `--memory` plans from: ``<expert dir>/trace.qtrace``."""
        return os.path.join(self.model.resolved_expert_dir(), "trace.qtrace")


