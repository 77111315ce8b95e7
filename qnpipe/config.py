"""qnpipe's single typed configuration: the frozen ``Config`` tree and ``load()``.

This is the only module of qnpipe that reads the environment or a TOML config file.
``load`` runs once, at start-up; the resulting ``Config`` is immutable and each actor
receives only its own sub-struct, so nothing is read per token.

Precedence, lowest first: field defaults < TOML file < environment < overrides.
Environment names: ``QNPIPE_<SECTION>__<FIELD>`` and every bare switch name of the
previous system (``EXPERT_SLOTS``, ``PREFILL_CHUNK``, ... see ``config_aliases``); when
both spellings set one field, the ``QNPIPE_`` one wins. ``docs/config.md`` has the
full story and the generated reference tables.
"""

from __future__ import annotations

import difflib
import enum
import hashlib
import os
import re
import sys
import tomllib
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple

import msgspec
from msgspec import Meta

from qnpipe.config_aliases import SEED_BY_NAME, SEED_NAMES, Kind, SeedName
from qnpipe.errors import ConfigError

__all__ = [
    "cache_dir", "ChatCfg", "Config", "describe_allowed", "DiagCfg", "EvictPolicy", "field_specs",
    "FieldSpec", "format_layer_set", "ForwardCfg", "HiddenVariant", "InexactConfigWarning", "KvCfg",
    "load", "MemoryCfg", "ModelCfg", "MtpCfg", "MtpHidden", "MtpVerifyMode", "OVERRIDE_ALIASES",
    "parse_layer_set", "PoolCfg", "PredictAgg", "PredictCfg", "PrefixCfg", "ReadCfg",
    "ReplacedSwitchWarning", "SEED_NAMES", "TraceCfg", "with_overrides",
]

ENV_PREFIX = "QNPIPE_"
# Names the TOML file when load() gets no toml_path; not a Config field.
ENV_CONFIG_FILE = "QNPIPE_CONFIG"
# Where downloaded / generated artefacts (demo model) live; see cache_dir(). Not a field.
ENV_CACHE_DIR = "QNPIPE_CACHE_DIR"
_NOT_FIELDS = frozenset({ENV_CONFIG_FILE, ENV_CACHE_DIR})


class ReplacedSwitchWarning(UserWarning):
    """A switch of the previous system was set that qnpipe's architecture replaces (no effect)."""


class InexactConfigWarning(UserWarning):
    """A setting breaks exact routing (output no longer matches the model's)."""


# --------------------------------------------------------------------------- types


def _doc(text: str) -> Meta:
    # The description lands in msgspec's type info, so docs/config.md is generated from it.
    return Meta(description=text)


NonNegInt = Annotated[int, Meta(ge=0)]
PosInt = Annotated[int, Meta(ge=1)]
NonNegFloat = Annotated[float, Meta(ge=0.0)]
Fraction = Annotated[float, Meta(ge=0.0, le=1.0)]
QuantBits = Annotated[int, Meta(ge=2, le=8)]
# Every tuple-of-int field is a layer set: sorted, unique, empty = all layers.
LayerSet = tuple[Annotated[int, Meta(ge=0)], ...]


class EvictPolicy(enum.StrEnum):
    """Which resident expert the pool evicts when it needs a slot."""

    LFU = "lfu"
    LRU = "lru"
    FIFO = "fifo"


class ReadBackend(enum.StrEnum):
    """How the SSD reader issues its preads: the C extension, the Python fallback, or the first available."""

    AUTO = "auto"
    C = "c"
    PYTHON = "python"


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


class _Section(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of the sub-structs: the struct options are inherited."""


# --------------------------------------------------------------------------- the tree


class ModelCfg(_Section):
    """Where the model lives. Empty paths are derived from ``model_dir``."""

    model_dir: Annotated[str, _doc("model directory")] = "models/Qwen3-Next-80B-A3B-Instruct-MLX-8bit"
    config_path: Annotated[str, _doc("model config.json (empty = <model_dir>/config.json)")] = ""
    mtp_weights_path: Annotated[str, _doc("MTP weights (empty = <model_dir>/mtp.safetensors)")] = ""
    expert_dir: Annotated[str, _doc("per-expert store (empty = <model_dir>/experts)")] = ""
    hidden_variant: Annotated[HiddenVariant, _doc("hidden state recorded and fed onward")] = HiddenVariant.PRE_FINAL_NORM

    def resolved_config_path(self) -> str:
        """The model's ``config.json`` path, derived from ``model_dir`` when not set."""
        return self.config_path or os.path.join(self.model_dir, "config.json")

    def resolved_mtp_weights_path(self) -> str:
        """The MTP weights path, derived from ``model_dir`` when not set."""
        return self.mtp_weights_path or os.path.join(self.model_dir, "mtp.safetensors")

    def resolved_expert_dir(self) -> str:
        """The expert store directory, derived from ``model_dir`` when not set."""
        return self.expert_dir or os.path.join(self.model_dir, "experts")


class MemoryCfg(_Section):
    """MLX memory limits (long sessions)."""

    mlx_cache_limit_gb: Annotated[NonNegFloat, _doc("cap on MLX's reusable buffer cache")] = 1.0
    # Must stay below the device's recommended working set; 0 leaves wiring to MLX.
    mlx_wired_limit_gb: Annotated[NonNegFloat, _doc("wire this many GB (0 = off)")] = 0.0


class PoolCfg(_Section):
    """Resident expert pool, side region, eviction and autopin (persisted heat)."""

    expert_slots: Annotated[PosInt, _doc("resident expert slots per layer")] = 64
    capacity_profile_path: Annotated[str, _doc("file of per-layer capacities (empty = expert_slots everywhere)")] = ""
    eager_load: Annotated[bool, _doc("load every expert up front (all-resident reference mode)")] = False
    evict_policy: Annotated[EvictPolicy, _doc("eviction policy")] = EvictPolicy.LFU
    lfu_decay_interval_forwards: Annotated[NonNegInt, _doc("halve LFU counts every N forwards (0 = never)")] = 0
    autopin: Annotated[bool, _doc("count routing heat, persist it, pin each layer's hottest experts at start-up")] = True
    autopin_usage_file: Annotated[str, _doc("heat file (empty = <expert dir>/pool_usage.json)")] = ""
    autopin_save_every_forwards: Annotated[PosInt, _doc("persist heat every N forwards (and at exit)")] = 200
    # Pinned slots never leave: above ~0.5 the demand path runs short of free slots.
    autopin_budget_frac: Annotated[Fraction, _doc("pinned share of each layer's capacity, 0..1")] = 0.5
    side_region_slots: Annotated[NonNegInt, _doc("side-region (speculative) slots per layer")] = 3
    side_region_zerocopy: Annotated[bool, _doc("read side-region experts in place, no copy into the resident region")] = False
    # Measured hit 0.709 (cleared each step) vs 0.81 (persistent) at 32+32 slots.
    side_region_lfu: Annotated[bool, _doc("side region keeps hot experts across steps (persistent LFU)")] = True

    def __post_init__(self) -> None:
        if self.side_region_zerocopy and self.side_region_slots == 0:
            raise ConfigError(
                "pool.side_region_zerocopy=true needs a side region: pool.side_region_slots is 0, allowed: >= 1"
            )


class ReadCfg(_Section):
    """The read scheduler and the SSD reader."""

    workers: Annotated[PosInt, _doc("parallel reader threads (device queue depth)")] = 8
    window_layers: Annotated[NonNegInt, _doc("layers of lookahead the reader keeps")] = 3
    # On by default so every benchmark measures real cold reads, not the page cache.
    nocache: Annotated[bool, _doc("bypass the OS page cache (F_NOCACHE / O_DIRECT)")] = True
    # Measured best: larger budgets flood the shared queue and prefetches land later.
    bg_budget_experts: Annotated[NonNegInt, _doc("background prefetch budget, experts in flight")] = 12
    # Measured 6.4 GB/s serial vs 22 GB/s 8-way.
    batch_miss_read: Annotated[bool, _doc("read all of a layer's misses as one parallel batch")] = True
    prefetch_budget_experts: Annotated[NonNegInt | None, _doc("per-call prefetch budget (none = the caller's)")] = None
    verify_hit_bytes: Annotated[bool, _doc("diagnostic: after a hit, compare slot bytes with disk")] = False
    verify_crc32: Annotated[bool, _doc("diagnostic: check each record's crc32 as it is read")] = False
    backend: Annotated[ReadBackend, _doc("preads via the C extension, the Python fallback, or auto")] = ReadBackend.AUTO


class PredictCfg(_Section):
    """Cross-layer expert prediction and the prefetch budgets it feeds."""

    cross_layer_prefetch: Annotated[bool, _doc("predict and prefetch experts of later layers")] = False
    ahead_layers: Annotated[NonNegInt, _doc("fixed layers ahead (0 = ahead_lo/ahead_hi by cutoff_layer)")] = 0
    candidate_mult: Annotated[PosInt, _doc("candidate multiplier")] = 2
    # Realised hit tops out at 24 (~0.90); wider reads miss their window and steal bandwidth.
    width_experts: Annotated[PosInt, _doc("candidates per predicted layer (top-W of its gate)")] = 24
    cutoff_layer: Annotated[NonNegInt, _doc("layers below predict ahead_lo_layers ahead, the rest ahead_hi_layers")] = 6
    ahead_lo_layers: Annotated[PosInt, _doc("layers ahead below the cutoff (recall)")] = 1
    ahead_hi_layers: Annotated[PosInt, _doc("layers ahead from the cutoff on (time)")] = 3
    # Measured +3.6 points of recall over the normed residual.
    use_moe_input: Annotated[bool, _doc("feed the target gate this layer's MoE input")] = True
    aggregate: Annotated[PredictAgg, _doc("combine the tokens of a verify step")] = PredictAgg.MAX
    union_k: Annotated[PosInt, _doc("per-token top-k for union aggregation")] = 8
    file_global_budget_experts: Annotated[NonNegInt, _doc("global cap on file prefetches")] = 64
    stage_global_budget_experts: Annotated[NonNegInt, _doc("global cap on staged prefetches")] = 64
    min_score: Annotated[float, _doc("drop candidates scoring below this")] = 0.0
    per_layer_budget_experts: Annotated[NonNegInt, _doc("per-layer prefetch cap")] = 4


class PrefixCfg(_Section):
    """Prefix snapshots: skip re-prefilling a shared prompt head."""

    # An agent's ~2600-token system+tools head took 158 s to prefill.
    snapshot_head_tokens: Annotated[NonNegInt, _doc("snapshot model state after the first N prompt tokens (0 = off)")] = 2048
    max_entries: Annotated[PosInt, _doc("snapshots kept (LRU, tens of MB each)")] = 4


class ChatCfg(_Section):
    """Chat template rendering."""

    # qnpipe differs from the seed here: its default named one deployment's four tools.
    tools_allow: Annotated[tuple[str, ...], _doc("only these tools are rendered (empty = all tools)")] = ()

    def __post_init__(self) -> None:
        names = tuple(dict.fromkeys(n.strip() for n in self.tools_allow if n.strip()))
        msgspec.structs.force_setattr(self, "tools_allow", names)


class MtpCfg(_Section):
    """Multi-token-prediction self-speculative decoding."""

    enabled: Annotated[bool, _doc("draft with the MTP head and verify (lossless under greedy)")] = False
    verify_mode: Annotated[MtpVerifyMode, _doc("verify drafts in one forward, or one at a time")] = MtpVerifyMode.BATCH
    bits: Annotated[Literal[2, 3, 4, 5, 6, 8], _doc("drafter quantization bits (8: better acceptance, +0.7 GB)")] = 4
    hidden: Annotated[MtpHidden, _doc("hidden state that feeds the drafter")] = MtpHidden.PRE_NORM
    num_draft_tokens: Annotated[PosInt, _doc("drafts per step (K) with fixed depth")] = 3
    adaptive_depth: Annotated[bool, _doc("draft while cumulative confidence >= conf_tau")] = False
    conf_tau: Annotated[Fraction, _doc("confidence threshold of adaptive depth")] = 0.3
    # Deeper than the slot budget allows must split the step, never overflow.
    depth_max: Annotated[PosInt, _doc("maximum adaptive draft depth")] = 3
    adaptive_rescue: Annotated[bool, _doc("adaptive depth plus top-2 rescue on deep chains")] = False
    tree_top2: Annotated[bool, _doc("verify the 2nd choice when the first draft is rejected")] = False
    tree_top2_p1: Annotated[bool, _doc("the same at the second draft position")] = False
    tree_verify: Annotated[bool, _doc("verify tree_branches candidate paths as one batch")] = False
    tree_branches: Annotated[Annotated[int, Meta(ge=2)], _doc("candidate paths for tree verify")] = 2

    def __post_init__(self) -> None:
        # The seed silently let one variant win; qnpipe makes the choice explicit.
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


class ForwardCfg(_Section):
    """The forward actor (model, prefill, sampling)."""

    # Peak memory tracks the chunk, not the prompt; 2 keeps each chunk on the pool's cheap path.
    prefill_chunk_tokens: Annotated[NonNegInt, _doc("prefill in chunks of N tokens (0 = whole prompt)")] = 2
    moe_topk_override: Annotated[PosInt | None, _doc("diagnostic: change the router's top-k (breaks exactness)")] = None


class KvCfg(_Section):
    """KV-cache quantization of the full-attention layers."""

    quantize: Annotated[bool, _doc("quantize the KV cache of the full-attention layers")] = False
    k_bits: Annotated[QuantBits, _doc("key bits")] = 4
    v_bits: Annotated[QuantBits, _doc("value bits")] = 3
    group_size: Annotated[PosInt, _doc("affine quantization group size (must divide head_dim)")] = 64
    rotate: Annotated[bool, _doc("fixed random SO(4) block rotation before quantizing")] = True
    rot_seed: Annotated[NonNegInt, _doc("rotation seed")] = 0


class DiagCfg(_Section):
    """Diagnostic switches: all off by default and free when off."""

    route_verify: Annotated[bool, _doc("check every token and layer reads the slot holding its routed expert")] = False
    window_prof: Annotated[bool, _doc("window timing probe")] = False
    stream_prof: Annotated[bool, _doc("streaming timing probe")] = False
    prefetch_tprof: Annotated[bool, _doc("host time of predict / submit / promote")] = False
    predict_recall_prof: Annotated[bool, _doc("recall of the prediction vs the real routing")] = False
    miss_attrib: Annotated[bool, _doc("detailed miss-cause probe")] = False
    union_prof: Annotated[bool, _doc("per-layer expert union size per forward, by sequence length")] = False
    accept_topk: Annotated[NonNegInt, _doc("record whether the true token is in the drafter's top-k (0 = off)")] = 0


class TraceCfg(_Section):
    """Routing log and event log output."""

    route_trace: Annotated[bool, _doc("record the routing log")] = False
    route_trace_path: Annotated[str, _doc("routing log file")] = "route_trace.msgpack"
    route_trace_layers: Annotated[LayerSet, _doc("layers recorded in the routing log (empty = all)")] = ()
    event_log_path: Annotated[str, _doc("event log file (empty = not written)")] = ""

    def __post_init__(self) -> None:
        msgspec.structs.force_setattr(self, "route_trace_layers", tuple(sorted(set(self.route_trace_layers))))


class Config(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """qnpipe's whole configuration. Build it with ``load``; derive variants with ``replace``."""

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

    def fingerprint(self) -> str:
        """The sha256 hex digest of this config's canonical JSON (sorted keys).

        Equal configs give equal fingerprints in every process; it goes into trace headers.
        """
        canonical = msgspec.json.encode(msgspec.to_builtins(self), order="sorted")
        return hashlib.sha256(canonical).hexdigest()

    def replace(self, **overrides: object) -> Config:
        """A copy with ``overrides`` applied, resolved exactly as ``load``'s overrides.

        Raises:
          ConfigError: an unknown key or an invalid value.
        """
        return with_overrides(self, overrides)

    def autopin_usage_path(self) -> str:
        """The autopin heat file: ``pool.autopin_usage_file`` or ``<expert dir>/pool_usage.json``."""
        return self.pool.autopin_usage_file or os.path.join(self.model.resolved_expert_dir(), "pool_usage.json")


# --------------------------------------------------------------------------- field table


class FieldSpec(NamedTuple):
    """One leaf field of ``Config``: dotted path, msgspec type info, default, description."""

    path: str
    type: msgspec.inspect.Type
    default: object
    doc: str

    @property
    def env_name(self) -> str:
        """The ``QNPIPE_<SECTION>__<FIELD>`` environment name of this field."""
        section, field = self.path.split(".")
        return f"{ENV_PREFIX}{section.upper()}__{field.upper()}"


def _unwrap(t: msgspec.inspect.Type) -> tuple[msgspec.inspect.Type, str]:
    doc = ""
    while isinstance(t, msgspec.inspect.Metadata):
        doc = (t.extra_json_schema or {}).get("description", doc)
        t = t.type
    return t, doc


def _build_fields() -> dict[str, FieldSpec]:
    out: dict[str, FieldSpec] = {}
    root = msgspec.inspect.type_info(Config)
    assert isinstance(root, msgspec.inspect.StructType)
    for sf in root.fields:
        section_t, _ = _unwrap(sf.type)
        assert isinstance(section_t, msgspec.inspect.StructType)
        for f in section_t.fields:
            t, doc = _unwrap(f.type)
            default = f.default if f.default_factory is msgspec.NODEFAULT else f.default_factory()
            out[f"{sf.name}.{f.name}"] = FieldSpec(f"{sf.name}.{f.name}", t, default, doc)
    return out


_FIELDS: dict[str, FieldSpec] = _build_fields()
_SECTIONS: frozenset[str] = frozenset(p.split(".")[0] for p in _FIELDS)
# Field name -> dotted paths; a name with one path works as a flat override key.
_FLAT: dict[str, list[str]] = {}
for _path in _FIELDS:
    _FLAT.setdefault(_path.split(".")[1], []).append(_path)
del _path

# Convenience override names (Engine(model_dir, mtp=True)); flat field names that are
# unique across the tree work without an entry here.
OVERRIDE_ALIASES: Mapping[str, str] = {
    "mtp": "mtp.enabled",
    "model": "model.model_dir",
    "kv_quant": "kv.quantize",
    "prefill_chunk": "forward.prefill_chunk_tokens",
    "cache_limit_gb": "memory.mlx_cache_limit_gb",
    "wired_limit_gb": "memory.mlx_wired_limit_gb",
}


def field_specs() -> tuple[FieldSpec, ...]:
    """Every leaf field of ``Config`` in declaration order (used to generate docs/config.md)."""
    return tuple(_FIELDS.values())


def describe_allowed(t: msgspec.inspect.Type) -> str:
    """A short English description of the values a field of type ``t`` accepts."""
    t, _ = _unwrap(t)
    if isinstance(t, msgspec.inspect.BoolType):
        return "true or false (1 or 0)"
    if isinstance(t, msgspec.inspect.IntType | msgspec.inspect.FloatType):
        noun = "an integer" if isinstance(t, msgspec.inspect.IntType) else "a number"
        bounds = [f"{op} {v}" for op, v in ((">", t.gt), (">=", t.ge), ("<", t.lt), ("<=", t.le)) if v is not None]
        return f"{noun} {' and '.join(bounds)}".strip()
    if isinstance(t, msgspec.inspect.EnumType):
        return "one of " + ", ".join(str(m.value) for m in t.cls)
    if isinstance(t, msgspec.inspect.LiteralType):
        return "one of " + ", ".join(str(v) for v in t.values)
    if isinstance(t, msgspec.inspect.StrType):
        return "a string"
    if isinstance(t, msgspec.inspect.UnionType):
        parts = ["empty (none)" if isinstance(a, msgspec.inspect.NoneType) else describe_allowed(a) for a in t.types]
        return ", or ".join(parts)
    if isinstance(t, msgspec.inspect.VarTupleType | msgspec.inspect.ListType):
        item, _ = _unwrap(t.item_type)
        if isinstance(item, msgspec.inspect.IntType):
            return "a layer set such as 0-3,5,8 (empty = all layers)"
        return "a comma-separated list (empty = none)"
    return type(t).__name__


# --------------------------------------------------------------------------- layer sets

_LAYER_PART = re.compile(r"([0-9]+)\s*(?:-\s*([0-9]+))?")
# Far above any real model; stops "0-999999999" from building a huge set by mistake.
_MAX_LAYER = 65535


def parse_layer_set(text: str) -> tuple[int, ...]:
    """Parse a layer set such as ``"0-3,5,8"`` into sorted unique layer indices.

    Ranges are inclusive; empty text means all layers and gives ``()``. Empty parts
    (``"1,,2"``, a trailing comma) are skipped, as the previous system did.

    Raises:
      ConfigError: a part is not a non-negative number or an ascending range ``a-b``.
    """
    layers: set[int] = set()
    for raw in text.split(","):
        part = raw.strip()
        if not part:
            continue
        m = _LAYER_PART.fullmatch(part)
        if m is None:
            why = "layer numbers are non-negative" if part.startswith("-") else "expected a layer number or a range a-b"
            raise ConfigError(f"bad layer set {text!r}: {part!r}: {why}; allowed: e.g. 0-3,5,8 (empty = all layers)")
        lo = int(m[1])
        hi = int(m[2]) if m[2] is not None else lo
        if hi < lo:
            raise ConfigError(f"bad layer set {text!r}: range {part!r} runs backwards; write {hi}-{lo}")
        if hi > _MAX_LAYER:
            raise ConfigError(f"bad layer set {text!r}: layer {hi} is above the maximum {_MAX_LAYER}")
        layers.update(range(lo, hi + 1))
    return tuple(sorted(layers))


def format_layer_set(layers: Iterable[int]) -> str:
    """The shortest ``parse_layer_set`` text for ``layers`` (e.g. ``(0, 1, 2, 5)`` -> ``"0-2,5"``)."""
    parts: list[str] = []
    run: list[int] = []
    for layer in sorted(set(layers)):
        if run and layer != run[-1] + 1:
            parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(layer)
    if run:
        parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(parts)


# --------------------------------------------------------------------------- loading


class _Setting(NamedTuple):
    path: str  # qnpipe dotted path
    value: object
    source: str  # where it came from, for error messages


_warned_names: set[str] = set()


def _stacklevel() -> int:
    # Point warnings at the first frame outside this module (the caller of load()).
    level, frame = 1, sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__") == __name__:
        level, frame = level + 1, frame.f_back
    return level


def _warn_replaced(seed: SeedName, source: str) -> None:
    if seed.name in _warned_names:
        return
    _warned_names.add(seed.name)
    warnings.warn(
        f"seed switch {seed.name} ({source}) has no effect in qnpipe: it meant {seed.meaning!r}; "
        f"replaced by {seed.target}",
        ReplacedSwitchWarning,
        stacklevel=_stacklevel(),
    )


def _suggest(word: str, candidates: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


def _seed_setting(name: str, value: object, source: str) -> _Setting | None:
    seed = SEED_BY_NAME[name]
    if seed.kind is Kind.REPLACED:
        _warn_replaced(seed, source)
        return None
    return _Setting(seed.target, value, source)


def _same_value(a: object, b: object) -> bool:
    def norm(v: object) -> object:
        s = str(v).strip().lower()
        return {"1": "true", "0": "false"}.get(s, s)

    return norm(a) == norm(b)


def _check_seed_conflicts(settings: list[_Setting]) -> list[_Setting]:
    # Two seed names for one field (EXPERT_NOCACHE, STREAM_BLOB_NOCACHE) must agree.
    seen: dict[str, _Setting] = {}
    for s in settings:
        prev = seen.get(s.path)
        if prev is not None and not _same_value(prev.value, s.value):
            raise ConfigError(
                f"{s.path} is set twice with different values: {prev.source}={prev.value!r} "
                f"and {s.source}={s.value!r}; set one of them"
            )
        seen[s.path] = s
    return settings


def _env_settings(env: Mapping[str, str]) -> list[_Setting]:
    seed_hits: list[_Setting] = []
    own_hits: list[_Setting] = []
    for key, raw in sorted(env.items()):
        if key.startswith(ENV_PREFIX):
            if key in _NOT_FIELDS:
                continue
            section, _, field = key[len(ENV_PREFIX):].partition("__")
            path = f"{section.lower()}.{field.lower()}"
            if path not in _FIELDS:
                # Compare without the shared prefix, which would make every name look close.
                flat = _FLAT.get(key[len(ENV_PREFIX):].lower(), [])
                close = _suggest(key[len(ENV_PREFIX):], [s.env_name[len(ENV_PREFIX):] for s in _FIELDS.values()])
                hint = f"; did you mean {_FIELDS[flat[0]].env_name}?" if len(flat) == 1 else close.replace(
                    "mean ", "mean " + ENV_PREFIX)
                what = f"no qnpipe field {path}" if field else f"not of the form {ENV_PREFIX}<SECTION>__<FIELD>"
                raise ConfigError(f"unknown environment variable {key}={raw!r}: {what}{hint} (see docs/config.md)")
            own_hits.append(_Setting(path, raw, f"environment variable {key}"))
        elif key in SEED_BY_NAME:
            s = _seed_setting(key, raw, f"environment variable {key}")
            if s is not None:
                seed_hits.append(s)
    # The QNPIPE_ spelling comes last so it wins over the bare seed name.
    return _check_seed_conflicts(seed_hits) + own_hits


def _toml_settings(toml_path: str | os.PathLike[str]) -> list[_Setting]:
    where = os.fspath(toml_path)
    try:
        with open(where, "rb") as fh:
            data = tomllib.load(fh)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {where}: {exc.strerror or exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {where} is not valid TOML: {exc}") from exc
    seed_hits: list[_Setting] = []
    own_hits: list[_Setting] = []
    for key, table in data.items():
        if key not in _SECTIONS and key != "seed":
            hint = _suggest(key, [*_SECTIONS, "seed"])
            if key in SEED_BY_NAME:
                hint = f"; seed names go in the [seed] table: [seed] {key} = ..."
            elif len(_FLAT.get(key, [])) == 1:
                hint = f"; did you mean [{_FLAT[key][0].split('.')[0]}] {key}?"
            raise ConfigError(f"{where}: unknown key {key!r} (allowed: tables [seed], [{'], ['.join(sorted(_SECTIONS))}]){hint}")
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: {key!r} must be a table [{key}], got {type(table).__name__}")
        for name, value in table.items():
            if key == "seed":
                if name not in SEED_BY_NAME:
                    raise ConfigError(f"{where}: unknown key [seed] {name}{_suggest(name, SEED_BY_NAME)}")
                s = _seed_setting(name, value, f"{where}: [seed] {name}")
                if s is not None:
                    seed_hits.append(s)
                continue
            path = f"{key}.{name}"
            if path not in _FIELDS:
                fields = [p.split(".")[1] for p in _FIELDS if p.startswith(key + ".")]
                raise ConfigError(f"{where}: unknown key [{key}] {name}{_suggest(name, fields)}")
            own_hits.append(_Setting(path, value, f"{where}: [{key}] {name}"))
    # As in the environment, the qnpipe spelling beats the seed spelling.
    return _check_seed_conflicts(seed_hits) + own_hits


def _override_path(key: str) -> str:
    """Resolve a qnpipe override key (dotted, alias or unique field name) to a dotted path."""
    if "." in key:
        if key in _FIELDS:
            return key
        raise ConfigError(f"unknown override {key!r}{_suggest(key, _FIELDS)}")
    if key in OVERRIDE_ALIASES:
        return OVERRIDE_ALIASES[key]
    paths = _FLAT.get(key, [])
    if len(paths) == 1:
        return paths[0]
    if len(paths) > 1:
        raise ConfigError(f"override {key!r} is ambiguous: use one of {', '.join(paths)}")
    candidates = [*_FIELDS, *_FLAT, *OVERRIDE_ALIASES]
    raise ConfigError(f"unknown override {key!r}{_suggest(key, candidates)} (allowed: section.field, see docs/config.md)")


def _override_settings(overrides: Mapping[str, object]) -> list[_Setting]:
    seed_hits: list[_Setting] = []
    own_hits: list[_Setting] = []
    for raw_key, value in overrides.items():
        if raw_key in SEED_BY_NAME:  # upper case, never a qnpipe name
            s = _seed_setting(raw_key, value, f"override {raw_key}")
            if s is not None:
                seed_hits.append(s)
            continue
        key = raw_key.replace("-", "_")  # CLI spelling --expert-slots
        if key in _SECTIONS and isinstance(value, Mapping):  # mtp={"enabled": True}
            own_hits += [_Setting(_override_path(f"{key}.{k}"), v, f"override {key}.{k}") for k, v in value.items()]
        else:
            own_hits.append(_Setting(_override_path(key), value, f"override {raw_key}"))
    return _check_seed_conflicts(seed_hits) + own_hits


def _coerce(spec: FieldSpec, value: object, source: str) -> object:
    """Turn text into the shape msgspec expects where strict=False alone does not."""
    t = spec.type
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(t, msgspec.inspect.BoolType) and type(value) is int and value in (0, 1):
        return bool(value)  # TOML [seed] KV_QUANT = 1
    if (isinstance(t, msgspec.inspect.UnionType) and isinstance(value, str) and not value.strip()
            and any(isinstance(a, msgspec.inspect.NoneType) for a in t.types)):
        return None  # MOE_TOPK_OVERRIDE= means unset
    if isinstance(t, msgspec.inspect.VarTupleType) and isinstance(value, str):
        item, _ = _unwrap(t.item_type)
        if isinstance(item, msgspec.inspect.IntType):
            try:
                return parse_layer_set(value)
            except ConfigError as exc:
                raise ConfigError(f"bad value for {spec.path} (from {source}={value!r}): {exc}") from None
        return tuple(p.strip() for p in value.split(",") if p.strip())
    return value


def _apply(tree: dict[str, Any], sources: dict[str, str], settings: Iterable[_Setting]) -> None:
    for s in settings:
        section, field = s.path.split(".")
        tree.setdefault(section, {})[field] = _coerce(_FIELDS[s.path], s.value, s.source)
        sources[s.path] = f"{s.source}={s.value!r}"


_AT = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<where>[^`]*)`)?$", re.S)


def _translate(exc: msgspec.ValidationError, sources: Mapping[str, str]) -> ConfigError:
    m = _AT.match(str(exc))
    assert m is not None  # the pattern matches any text
    what = m["what"]
    path = re.sub(r"\[\d+\]", "", (m["where"] or "").lstrip("."))
    if path in _FIELDS:
        origin = f" (from {sources[path]})" if path in sources else ""
        allowed = describe_allowed(_FIELDS[path].type)
        return ConfigError(f"bad value for {path}{origin}: {what}; allowed: {allowed}")
    # A cross-field rule of a section (__post_init__): list what was set there.
    set_here = [v for p, v in sources.items() if p.startswith(path + ".")] if path else []
    origin = f" (set by {'; '.join(set_here)})" if set_here else ""
    return ConfigError(f"invalid [{path or 'config'}]{origin}: {what}")


def _finish(tree: dict[str, Any], sources: Mapping[str, str]) -> Config:
    try:
        cfg = msgspec.convert(tree, Config, strict=False)
    except msgspec.ValidationError as exc:
        raise _translate(exc, sources) from exc
    if cfg.forward.moe_topk_override is not None:
        warnings.warn(
            f"forward.moe_topk_override={cfg.forward.moe_topk_override} changes the router's top-k: "
            "output is NOT exact and differs from the model; use for experiments only",
            InexactConfigWarning,
            stacklevel=_stacklevel(),
        )
    return cfg


def load(
    toml_path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, object] | None = None,
) -> Config:
    """Build the ``Config``: defaults < TOML file < environment < overrides.

    Call it once at start-up. ``env=None`` reads ``os.environ`` (tests pass a dict);
    without ``toml_path`` the file named by ``QNPIPE_CONFIG`` is read, if set. Seed
    switches that qnpipe replaces warn once per process (``ReplacedSwitchWarning``);
    ``forward.moe_topk_override`` warns on every load (``InexactConfigWarning``).

    Args:
      toml_path: TOML file with tables named after the sections (``[pool]``) and an
        optional ``[seed]`` table of the previous system's names.
      env: environment; ``QNPIPE_<SECTION>__<FIELD>`` and bare seed names are read,
        other variables ignored.
      overrides: dotted paths (``"pool.expert_slots"``), unique field names
        (``expert_slots``), ``OVERRIDE_ALIASES`` (``mtp``), seed names, or a section
        name mapped to a dict.

    Raises:
      ConfigError: an unknown key (with the nearest valid name) or an invalid value
        (naming the key, where it came from, and what is allowed).
    """
    env = os.environ if env is None else env
    if toml_path is None and env.get(ENV_CONFIG_FILE):
        toml_path = env[ENV_CONFIG_FILE]
    tree: dict[str, Any] = {}
    sources: dict[str, str] = {}
    if toml_path is not None:
        _apply(tree, sources, _toml_settings(toml_path))
    _apply(tree, sources, _env_settings(env))
    _apply(tree, sources, _override_settings(overrides or {}))
    return _finish(tree, sources)


def with_overrides(cfg: Config, overrides: Mapping[str, object] | None = None, /, **kw: object) -> Config:
    """A copy of ``cfg`` with overrides applied, resolved exactly as in ``load``.

    Overrides come from the mapping and/or keywords (keywords win), e.g.
    ``with_overrides(cfg, expert_slots=32, mtp=True)``.

    Raises:
      ConfigError: an unknown key or an invalid value.
    """
    merged = {**(overrides or {}), **kw}
    tree: dict[str, Any] = msgspec.to_builtins(cfg)
    sources: dict[str, str] = {}
    _apply(tree, sources, _override_settings(merged))
    return _finish(tree, sources)


def cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """qnpipe's cache directory (demo model and other generated files); not created here.

    ``QNPIPE_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/qnpipe``, else ``~/.cache/qnpipe``.
    ``env=None`` reads ``os.environ``.
    """
    env = os.environ if env is None else env
    if env.get(ENV_CACHE_DIR):
        return Path(env[ENV_CACHE_DIR]).expanduser()
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "qnpipe"
