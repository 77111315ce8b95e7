"""The previous system's switch names and what qnpipe does with each (data only).

Every name the legacy system read from the environment is listed here once, in the order
of its configuration module. ``qnpipe.config.loader`` accepts each of them from the
environment, as a key of the TOML ``[legacy]`` table and as an override key:

- kind F (feature) and D (diagnostic, off by default) map to one ``Config`` field;
- kind R (replaced by qnpipe's architecture) has no effect and warns once per process,
  naming what replaced it.

This module reads nothing (no environment, no files); ``tools/config_table.py`` turns
the table into the reference table of ``docs/config.md``.
"""

from __future__ import annotations

import enum
from typing import NamedTuple


class Kind(enum.StrEnum):
    """How qnpipe treats a legacy switch (the "kind" column of docs/config.md)."""

    FEATURE = "F"
    DIAGNOSTIC = "D"
    REPLACED = "R"


class LegacyName(NamedTuple):
    """One legacy switch.

    ``target`` is the dotted qnpipe field for kinds F and D, and a short description of
    what replaced the switch for kind R. ``legacy_default`` is the legacy system's default, as text.
    """

    name: str
    kind: Kind
    target: str
    legacy_default: str
    meaning: str


def _f(name: str, target: str, legacy_default: str, meaning: str) -> LegacyName:
    return LegacyName(name, Kind.FEATURE, target, legacy_default, meaning)


def _d(name: str, target: str, legacy_default: str, meaning: str) -> LegacyName:
    return LegacyName(name, Kind.DIAGNOSTIC, target, legacy_default, meaning)


def _r(name: str, replaced_by: str, legacy_default: str, meaning: str) -> LegacyName:
    return LegacyName(name, Kind.REPLACED, replaced_by, legacy_default, meaning)


# Shared "replaced by" texts, so the warnings of one family read the same.
_STORE = "the expert store inside the model directory (model.expert_dir); qnpipe has no separate blob or scratch directory"
_SLOT_MAP = "the pool actor's slot map: experts are mapped to slots by design, with route verification (diag.route_verify)"
_PER_EXPERT_FILES = "per-layer expert files with one contiguous read per expert (model.expert_dir)"
_READ_SCHED = "the read_scheduler actor's shared, budgeted queue (read.*, predict.*)"
_QPROJ = "MLX's quantized matmul (metal/ holds any custom kernel, each with a Python reference)"
_FUSED = "MLX's own gather_qmm (the fused kernel was measured slower)"
_NATIVE = "the trio actor pipeline (pool, read_scheduler) and the optional C reader in cextensions/"
_ALWAYS_STREAM = "nothing to switch: qnpipe always streams experts in the background (read_scheduler)"
_STAGING = "direct reads into pool slots; qnpipe has no staging ring"
_NATIVE_PREFETCH = "the predictor and read_scheduler actors (predict.*)"
_PROBES = "the recorder's event log, which times every actor"

LEGACY_NAMES: tuple[LegacyName, ...] = (
    # -- model and directories
    _f("MODEL", "model.model_dir", "models/Qwen3-Next-80B-A3B-Instruct-MLX-8bit", "model directory"),
    _f("QN_CONFIG", "model.config_path", "MODEL/config.json", "model config.json path"),
    _f("MTP_OUT", "model.mtp_weights_path", "models/qn_mtp_weights.safetensors", "extracted MTP weights"),
    _f("EXPERT_DIR", "model.expert_dir", "models/experts_8bit_g64", "per-expert store"),
    _f("EXPERT_SLOTS", "pool.expert_slots", "64", "resident expert slots per layer"),
    _f("MLX_CACHE_LIMIT_GB", "memory.mlx_cache_limit_gb", "1.0", "cap on MLX's reusable buffer cache"),
    _f("MLX_WIRED_LIMIT_GB", "memory.mlx_wired_limit_gb", "0", "wire this many GB (0 = off)"),
    _f("EXPERT_POOL_PROFILE", "pool.capacity_profile_path", "", "file of per-layer pool capacities"),
    _f("HIDDEN_VARIANT", "model.hidden_variant", "pre_final_norm", "which hidden state is recorded / fed onward"),
    _r("BLOB_DIR", _STORE, "", "alternative expert blob directory"),
    _r("COMPUTE_BUFFER_DIR", _STORE, "", "scratch directory"),
    # -- MoE hot path
    _r("RESIDENT_POOL", "nothing to switch: the resident expert pool is always on in qnpipe", "1", "use the resident expert pool"),
    _r("GPU_REMAP", _SLOT_MAP, "1", "map expert ids to slots on the device"),
    _r("VERIFY_GPU_REMAP", _SLOT_MAP, "0", "device-side slot remap for verify steps"),
    _r("GPU_REMAP_PROMOTE_FILTER", _SLOT_MAP, "1", "filter promotions by device membership"),
    _d("MOE_TOPK_OVERRIDE", "forward.moe_topk_override", "unset", "change the router's top-k (breaks exactness; loud warning)"),
    _f("EAGER_EXPERT_LOAD", "pool.eager_load", "0", "load all experts up front (all-resident reference mode)"),
    # -- cache and eviction
    _f("EVICT_POLICY", "pool.evict_policy", "lfu", "eviction policy"),
    _f("EXPERT_NOCACHE", "read.nocache", "1", "bypass the OS page cache for expert reads"),
    _f("LFU_DECAY_INTERVAL", "pool.lfu_decay_interval_forwards", "0", "halve LFU counts every N forwards (0 = never)"),
    _r("EXPERT_BUNDLE", _PER_EXPERT_FILES, "0", "old multi-expert bundle files"),
    _r("EXPERT_BUNDLE_DIR", _PER_EXPERT_FILES, "(caller's)", "old bundle directory"),
    _r("EXPERT_BUNDLE_CACHE", _PER_EXPERT_FILES, "4", "old bundle cache size"),
    _r("EXPERT_STACK_CACHE", _PER_EXPERT_FILES, "0", "old stacked-expert cache"),
    _r("ASYNC_PREFETCH", _READ_SCHED, "0", "old async prefetch buffer"),
    _r("PREFETCH_BUFFER_EXPERTS", _READ_SCHED, "2048", "old async prefetch buffer size"),
    # -- autopin
    _f("AUTOPIN", "pool.autopin", "1", "count routing heat, persist it, pin each layer's hottest experts at start-up"),
    _f("AUTOPIN_USAGE_FILE", "pool.autopin_usage_file", "EXPERT_DIR/pool_usage.json", "heat file {layer: {expert: count}}"),
    _f("AUTOPIN_SAVE_EVERY", "pool.autopin_save_every_forwards", "200", "persist heat every N forwards (and at exit)"),
    _f("AUTOPIN_BUDGET_FRAC", "pool.autopin_budget_frac", "0.5", "pinned share of each layer's capacity (0..1)"),
    # -- custom kernels and the old native backend
    _r("CUSTOM_QPROJ", _QPROJ, "0", "custom Metal quantized projection"),
    _r("CUSTOM_QPROJ_BITS", _QPROJ, "6", "its bit width"),
    _r("CUSTOM_QPROJ_TARGETS", _QPROJ, "gate,up", "its target projections"),
    _r("CUSTOM_QPROJ_MAX_SEQ", _QPROJ, "4", "its maximum sequence length"),
    _r("CUSTOM_QPROJ_TILE", _QPROJ, "4", "its tile size"),
    _r("CUSTOM_FUSED_MOE", _FUSED, "0", "fused MoE Metal kernel"),
    _r("CUSTOM_FUSED_MOE_BITS", _FUSED, "6", "its bit width"),
    _r("CUSTOM_FUSED_MOE_LANES", _FUSED, "8", "its lanes"),
    _r("CUSTOM_FUSED_MOE_BLOCK", _FUSED, "256", "its block size"),
    _r("CUSTOM_FUSED_MOE_MAX_SEQ", _FUSED, "4", "its maximum sequence length"),
    _r("NATIVE_MOE", _NATIVE, "0", "old C++ MoE backend"),
    _r("NATIVE_MOE_MLX_OP", _NATIVE, "0", "old C++ backend as an MLX op"),
    _r("NATIVE_MOE_SYNTHETIC", _NATIVE, "0", "old C++ backend, synthetic weights"),
    _r("NATIVE_MOE_SLOT_POOL", _NATIVE, "0", "old C++ slot pool"),
    _r("NATIVE_MOE_RAISE", _NATIVE, "0", "old C++ backend: raise on fallback"),
    _r("NATIVE_MOE_SLOT_CAP", _NATIVE, "96", "old C++ slot capacity"),
    _r("NATIVE_MOE_STAGE_CACHE", _NATIVE, "1", "old C++ stage cache"),
    _r("NATIVE_MOE_STAGE_CACHE_EXPERTS", _NATIVE, "96", "old C++ stage cache size"),
    _r("NATIVE_MOE_STAGE_BUNDLE_CACHE", _NATIVE, "1", "old C++ stage bundle cache"),
    _r("NATIVE_MOE_STAGE_CACHE_BUNDLES", _NATIVE, "16", "old C++ stage bundle cache size"),
    _r("NATIVE_MOE_STAGE_PREFETCH", _NATIVE, "0", "old C++ stage prefetch"),
    # -- streaming reads
    _r("STREAM_BLOB", _ALWAYS_STREAM, "0", "read experts from per-layer blob files"),
    _r("STREAM_BLOB_LOADER", _ALWAYS_STREAM, "0", "blob loader"),
    _r("STREAM_BLOB_BG", _ALWAYS_STREAM, "0", "background blob reads"),
    _f("STREAM_BLOB_WORKERS", "read.workers", "8", "parallel reader threads / queue depth"),
    _f("STREAM_BLOB_WINDOW", "read.window_layers", "3", "layers of lookahead the reader keeps"),
    _f("STREAM_BLOB_NOCACHE", "read.nocache", "1", "page-cache bypass for blob reads (same as EXPERT_NOCACHE)"),
    _f("STREAM_BLOB_BG_BUDGET", "read.bg_budget_experts", "12", "background prefetch budget (experts in flight)"),
    _f("BATCH_MISS_READ", "read.batch_miss_read", "1", "read all of a layer's misses as one parallel batch"),
    _r("NATIVE_DEMAND_LOADER", "read_scheduler demand reads (read.batch_miss_read)", "0", "materialise demand misses natively"),
    _r("STAGING_RING", _STAGING, "2", "staging buffers per layer"),
    _r("STAGING_PREAD_PARALLEL", _STAGING, "0", "parallel staging fill"),
    _d("STG_VERIFY", "read.verify_hit_bytes", "0", "after a hit, compare slot bytes with disk"),
    _f("STREAM_BLOB_PREFETCH_BUDGET", "read.prefetch_budget_experts", "(caller's)", "per-call prefetch budget"),
    # -- cross-layer prediction and prefetch
    _f("CROSS_LAYER_PREFETCH", "predict.cross_layer_prefetch", "0", "predict and prefetch experts of later layers"),
    _f("CROSS_LAYER_PREFETCH_AHEAD", "predict.ahead_layers", "0 / 1 (caller's)", "fixed layers ahead (0 = per-layer lo/hi)"),
    _f("CROSS_LAYER_PREFETCH_MULT", "predict.candidate_mult", "2", "candidate multiplier"),
    _f("CROSS_LAYER_PREDICT_WIDTH", "predict.width_experts", "24", "candidates per predicted layer (top-W of the target gate)"),
    _f("CROSS_LAYER_CUTOFF", "predict.cutoff_layer", "6", "layers below it predict ahead_lo ahead, the rest ahead_hi"),
    _f("CROSS_LAYER_AHEAD_LO", "predict.ahead_lo_layers", "1", "layers ahead below the cutoff (recall)"),
    _f("CROSS_LAYER_AHEAD_HI", "predict.ahead_hi_layers", "3", "layers ahead from the cutoff on (time)"),
    _f("PREDICT_USE_X", "predict.use_moe_input", "1", "feed the target gate this layer's MoE input, not the normed residual"),
    _f("PREDICT_AGG", "predict.aggregate", "max", "combine the tokens of a verify step: max, mean or union"),
    _f("PREDICT_UNION_K", "predict.union_k", "8", "per-token top-k for union aggregation"),
    _r("NATIVE_FUSED_PREFETCH", _NATIVE_PREFETCH, "0", "old native prefetch toggle"),
    _f("ZEROCOPY_DUAL_SOURCE", "pool.side_region_zerocopy", "0", "side region read in place, no copy into the resident region"),
    _f("POOL_SPEC_SLOTS", "pool.side_region_slots", "3", "side-region (speculative) slots per layer"),
    _f("SIDEREGION_LFU", "pool.side_region_lfu", "1", "side region keeps hot experts across steps (persistent LFU)"),
    _r("NATIVE_NO_SUBMIT", _NATIVE_PREFETCH, "0", "old native prefetch toggle"),
    _r("NATIVE_NO_PROMOTE", _NATIVE_PREFETCH, "0", "old native prefetch toggle"),
    _r("NATIVE_MATERIALIZE", _NATIVE_PREFETCH, "0", "old native prefetch toggle"),
    _f("FILE_PREFETCH_GLOBAL_BUDGET", "predict.file_global_budget_experts", "64", "global cap on file prefetches"),
    _f("STAGE_PREFETCH_GLOBAL_BUDGET", "predict.stage_global_budget_experts", "64", "global cap on staged prefetches"),
    _f("STAGE_PREFETCH_MIN_SCORE", "predict.min_score", "0", "drop candidates scoring under this"),
    _f("STAGE_PREFETCH_PER_LAYER_BUDGET", "predict.per_layer_budget_experts", "4", "per-layer prefetch cap"),
    # -- prefix snapshots and tools
    _f("PREFIX_SNAPSHOT_HEAD", "prefix.snapshot_head_tokens", "2048", "snapshot model state after the first N prompt tokens (0 = off)"),
    _f("PREFIX_SNAPSHOT_ENTRIES", "prefix.max_entries", "4", "snapshot LRU entries"),
    _f("TOOLS_ALLOW", "chat.tools_allow", "profile_list_employees,profile_get_portrait_overview,profile_get_person_report,profile_get_team_report", "tools rendered into the chat template (empty = all)"),
    # -- MTP and prefill
    _f("MTP_VERIFY_MODE", "mtp.verify_mode", "batch", "how drafts are verified"),
    _f("MTP_BITS", "mtp.bits", "4", "drafter quantization bits"),
    _f("MTP_HIDDEN", "mtp.hidden", "pre_norm", "which hidden state feeds the drafter"),
    _f("PREFILL_CHUNK", "forward.prefill_chunk_tokens", "2", "prefill in chunks of N tokens (0 = whole prompt)"),
    # -- KV quantization
    _f("KV_QUANT", "kv.quantize", "0", "quantize the KV cache of the full-attention layers"),
    _f("KV_K_BITS", "kv.k_bits", "4", "key bits"),
    _f("KV_V_BITS", "kv.v_bits", "3", "value bits"),
    _f("KV_GROUP_SIZE", "kv.group_size", "64", "affine quantization group (divides head_dim)"),
    _f("KV_ROTATE", "kv.rotate", "1", "fixed random SO(4) block rotation before quantizing"),
    _f("KV_ROT_SEED", "kv.rot_seed", "0", "rotation seed"),
    # -- diagnostics
    _d("WINDOW_PROF", "diag.window_prof", "0", "window timing probe"),
    _d("PREDICT_RECALL_PROF", "diag.predict_recall_prof", "0", "recall of the prediction vs the real routing"),
    _d("MISS_ATTRIB", "diag.miss_attrib", "0", "miss causes: predicted-but-late vs not predicted"),
    _f("ROUTE_TRACE", "trace.route_trace", "0", "record the routing log"),
    _d("STREAM_PROF", "diag.stream_prof", "0", "streaming timing probe"),
    _r("PROBE_PREDICT_ONLY", _PROBES, "0", "old probe"),
    _r("PROBE_PERLAYER_SYNC", _PROBES, "0", "old probe"),
    _d("PREFETCH_TPROF", "diag.prefetch_tprof", "0", "host time of predict / submit / promote"),
    _d("UNION_PROF", "diag.union_prof", "0", "per-layer expert union size per forward, by sequence length"),
    _d("ACCEPT_TOPK", "diag.accept_topk", "0", "is the true token in the drafter's top-k per position (0 = off)"),
    # -- speculation variants
    _f("TREE_TOP2", "mtp.tree_top2", "0", "verify the drafter's 2nd choice when the first draft is rejected"),
    _f("TREE_TOP2_P1", "mtp.tree_top2_p1", "0", "the same at the second draft position"),
    _f("TREE_VERIFY", "mtp.tree_verify", "0", "verify several candidate paths as one batch"),
    _f("TREE_BRANCHES", "mtp.tree_branches", "2", "candidate paths for tree verify"),
    _f("MTP_ADAPTIVE_DEPTH", "mtp.adaptive_depth", "0", "draft while cumulative confidence >= tau"),
    _f("MTP_CONF_TAU", "mtp.conf_tau", "0.3", "confidence threshold of adaptive depth"),
    _f("MTP_DEPTH_MAX", "mtp.depth_max", "3", "maximum adaptive draft depth"),
    _f("MTP_ADAPTIVE_RESCUE", "mtp.adaptive_rescue", "0", "adaptive depth plus top-2 rescue on deep chains"),
)

LEGACY_BY_NAME: dict[str, LegacyName] = {s.name: s for s in LEGACY_NAMES}
