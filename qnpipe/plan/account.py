"""The memory account: what a run of a model takes besides the expert pool, each line measured or derived.

    facts = model_facts("qn80b-4bit")                  # or shape_facts("config.json", bits=4)
    acct = account(facts, cfg, caps, side_slots=0, context=8192)

Where each figure comes from (docs/plan.md, "The memory account"):

- **non-expert weights**: the tensors' bytes in the model directory's safetensors headers
  (`model.safetensors`, and `mtp.safetensors` when `mtp.enabled`); for a model given by its
  `config.json` alone, its tensors' shapes (`nonexpert_params`) at the stored bits.
- **expert records**: the expert store's index (`record_nbytes` per layer); from `config.json`
  alone, the three projections at the stored bits with a bf16 scale and bias per group (the
  layout `qnpipe convert` writes: qnpipe.io.store_format.Quant).
- **pool and side region**: slots x record bytes (the pool's stacked arrays hold whole records).
- **KV cache** at `context`: mlx-lm's KVCache grows in steps of 256 tokens, so ceil(context / 256) x 256
  tokens of `bytes_per_token` (qnpipe.model.kvquant) over the full-attention layers.
- **recurrent state**: each Gated DeltaNet layer keeps its conv window (kernel - 1 positions of the
  conv channels, activation dtype) and its delta-rule state (value heads x value dim x key dim,
  float32): both independent of the context. Checked against the caches of a real prefill
  (tests/plan/test_account.py).
- **MLX buffer cache**: `memory.mlx_cache_limit_gb`, the cap qnpipe sets on the freed buffers MLX keeps
  for reuse (qnpipe.model.memory.apply_memory_limits).
- **headroom**: what the caller keeps for the operating system and the page cache (`headroom_bytes`,
  `qnpipe plan --headroom`); 0 by default, because the budget is what qnpipe may use and
  `read.nocache` (on by default) reads experts around the page cache.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import msgspec

from qnpipe.config import Config
from qnpipe.errors import CheckpointError, ConfigError
from qnpipe.model.args import ModelArgs, args_from_dict, read_config
from qnpipe.model.memory import GB
from qnpipe.plan.units import fmt_bytes
from qnpipe.trace import ModelShape

KV_STEP = 256  # mlx_lm.models.cache.KVCache.step: the cache grows by this many tokens at a time
STATE_DTYPE_BYTES = 4  # the delta-rule state is float32 whatever the weights (measured: tests/plan/test_account.py)
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


class ModelFacts(msgspec.Struct, frozen=True, kw_only=True):
    """What the account needs of a model, and where each figure came from."""

    source: str  # the model directory, or the config.json of --shape
    args: ModelArgs
    record_nbytes: dict[int, int]  # bytes of one expert record per MoE layer
    record_source: str
    non_expert_nbytes: int
    non_expert_source: str
    act_dtype_bytes: int  # activations' dtype (KV cache, conv window)

    @property
    def shape(self) -> ModelShape:
        return ModelShape.of(self.args)


class Line(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    nbytes: int
    source: str


class Account(msgspec.Struct, frozen=True, kw_only=True):
    """The budget and its lines; `free` is what is left (never negative in a plan)."""

    budget: int
    lines: list[Line]

    @property
    def total(self) -> int:
        return sum(x.nbytes for x in self.lines)

    @property
    def free(self) -> int:
        return self.budget - self.total

    def describe(self) -> list[str]:
        w = max(len(x.name) for x in self.lines)
        out = [f"  {x.name:<{w}} {fmt_bytes(x.nbytes):>11}  ({x.source})" for x in self.lines]
        out.append(f"  {'total':<{w}} {fmt_bytes(self.total):>11}  of {fmt_bytes(self.budget)} "
                   f"({fmt_bytes(self.free)} unused)")
        return out


def model_facts(model_dir: str | Path, cfg: Config) -> ModelFacts:
    """The facts of a `qnpipe convert` output directory (CheckpointError/StoreError name the file)."""
    from qnpipe.io.store import read_index
    from qnpipe.model.checkpoint import read_header

    d = Path(model_dir)
    raw = read_config(d)
    args = args_from_dict(raw, str(d / "config.json"))
    _, index = read_index(cfg.model.expert_dir or d)
    records = {lf.layer: lf.record_nbytes for lf in index.layers}
    if missing := sorted(set(args.moe_layers) - set(records)):
        raise CheckpointError(f"{d}: the expert store has no records of MoE layers {missing}")
    files = [d / "model.safetensors"] + ([Path(cfg.model.resolved_mtp_weights_path())] if cfg.mtp.enabled else [])
    if not files[0].exists():
        raise CheckpointError(f"{files[0]}: not found: a qnpipe model directory (`qnpipe convert` output) has one")
    non_expert = 0
    act = 0
    for f in files:
        for name, info in read_header(f).items():
            non_expert += info.nbytes
            if name == "model.norm.weight":
                act = {"F32": 4, "F16": 2, "BF16": 2}.get(info.dtype, 0)
    if not act:
        raise CheckpointError(f"{files[0]}: no float model.norm.weight: cannot tell the activations' dtype")
    return ModelFacts(source=str(d), args=args, record_nbytes={ly: records[ly] for ly in args.moe_layers},
                      record_source=f"{index_path_of(d, cfg)}", non_expert_nbytes=non_expert,
                      non_expert_source="safetensors headers of " + ", ".join(f.name for f in files),
                      act_dtype_bytes=act)


def index_path_of(d: Path, cfg: Config) -> str:
    return str(Path(cfg.model.expert_dir or d / "experts") / "index.json")


def shape_facts(config_json: str | Path, *, bits: int | None = None, group_size: int = 64) -> ModelFacts:
    """The facts of a model given by its `config.json` alone (before converting): records at `bits`
    (default: the config's own quantization, else its float dtype), the rest from its tensors' shapes."""
    p = Path(config_json)
    if p.is_dir():
        p = p / "config.json"
    raw = read_config(p.parent) if p.name == "config.json" else _read_json(p)
    args = args_from_dict(raw, str(p))
    q = raw.get("quantization") or raw.get("quantization_config") or {}
    dtype = raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"
    float_bytes = _DTYPE_BYTES.get(str(dtype), 2)
    if bits is None and isinstance(q.get("bits"), int):
        bits, group_size = q["bits"], int(q.get("group_size", group_size))
    if bits is not None and bits not in (2, 3, 4, 5, 6, 8):
        raise ConfigError(f"bits={bits}: expected 2, 3, 4, 5, 6 or 8")
    rec = sum(_matrix_bytes(o, i, bits, group_size, float_bytes) for o, i in args.expert_dims.values())
    mats, vecs = nonexpert_params(args)
    non_expert = sum(_matrix_bytes(o, i, bits, group_size, float_bytes) for o, i in mats) + vecs * float_bytes
    how = f"{bits}-bit, group {group_size}, bf16 scales" if bits else f"{dtype}"
    return ModelFacts(source=str(p), args=args, record_nbytes=dict.fromkeys(args.moe_layers, rec),
                      record_source=f"derived from {p.name}: 3 projections at {how}",
                      non_expert_nbytes=non_expert,
                      non_expert_source=f"derived from {p.name}: tensor shapes at {how}",
                      act_dtype_bytes=2 if bits else float_bytes)


def _read_json(p: Path) -> dict[str, Any]:
    try:
        raw = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{p}: not a readable config.json ({e})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{p}: expected a JSON object")
    return raw


def _matrix_bytes(out: int, inp: int, bits: int | None, group: int, float_bytes: int) -> int:
    if bits is None or inp % group:
        return out * inp * float_bytes
    return out * inp * bits // 8 + 2 * out * (inp // group) * 2  # packed weight, bf16 scales and biases


def nonexpert_params(args: ModelArgs) -> tuple[list[tuple[int, int]], int]:
    """The non-expert tensors of a Qwen3-Next model: (out, in) of each matrix, and the count of other
    parameters (norms, conv kernels, the delta rule's A and dt); qnpipe.model.qwen3_next's modules."""
    h, v = args.hidden_size, args.vocab_size
    mats: list[tuple[int, int]] = [(v, h)] + ([] if args.tie_word_embeddings else [(v, h)])
    vecs = h  # final norm
    key_dim = args.linear_num_key_heads * args.linear_key_head_dim
    value_dim = args.linear_num_value_heads * args.linear_value_head_dim
    for layer in range(args.num_hidden_layers):
        vecs += 2 * h
        if args.is_linear(layer):
            mats += [(2 * key_dim + 2 * value_dim, h), (2 * args.linear_num_value_heads, h), (h, value_dim)]
            vecs += (2 * key_dim + value_dim) * args.linear_conv_kernel_dim + 2 * args.linear_num_value_heads
            vecs += args.linear_value_head_dim
        else:
            q = args.num_attention_heads * args.head_dim
            kv = args.num_key_value_heads * args.head_dim
            mats += [(2 * q, h), (kv, h), (kv, h), (h, q)]
            vecs += 2 * args.head_dim
        if args.is_moe(layer):
            mats += [(args.num_experts, h), (args.shared_expert_intermediate_size, h),
                     (args.shared_expert_intermediate_size, h), (h, args.shared_expert_intermediate_size), (1, h)]
        else:
            mats += [(args.intermediate_size, h), (args.intermediate_size, h), (h, args.intermediate_size)]
    return mats, vecs


def kv_nbytes(facts: ModelFacts, cfg: Config, context: int) -> int:
    """The full-attention layers' KV cache at `context` tokens, in mlx-lm's 256-token steps."""
    from qnpipe.model.kvquant import bytes_per_token  # its module loads mlx-lm: only when an account is made

    args = facts.args
    n_fa = sum(not args.is_linear(i) for i in range(args.num_hidden_layers))
    per_token = bytes_per_token(n_fa, args.num_key_value_heads, args.head_dim, facts.act_dtype_bytes,
                                cfg.kv if cfg.kv.quantize else None)
    return math.ceil(context / KV_STEP) * KV_STEP * per_token


def state_nbytes(facts: ModelFacts) -> int:
    """The Gated DeltaNet layers' recurrent state: conv window and delta-rule state (module doc)."""
    a = facts.args
    conv_dim = 2 * a.linear_num_key_heads * a.linear_key_head_dim + a.linear_num_value_heads * a.linear_value_head_dim
    conv = (a.linear_conv_kernel_dim - 1) * conv_dim * facts.act_dtype_bytes
    delta = a.linear_num_value_heads * a.linear_value_head_dim * a.linear_key_head_dim * STATE_DTYPE_BYTES
    return sum(a.is_linear(i) for i in range(a.num_hidden_layers)) * (conv + delta)


def fixed_lines(facts: ModelFacts, cfg: Config, *, context: int, headroom_bytes: int = 0) -> list[Line]:
    """Every line but the pool and side region (they depend on the plan)."""
    kv_src = (f"{context} tokens in mlx-lm's {KV_STEP}-token steps x "
              f"{'quantized ' if cfg.kv.quantize else ''}KV bytes per token")
    return [Line(name="non-expert weights", nbytes=facts.non_expert_nbytes, source=facts.non_expert_source),
            Line(name="KV cache", nbytes=kv_nbytes(facts, cfg, context), source=kv_src),
            Line(name="recurrent state", nbytes=state_nbytes(facts),
                 source="conv window + float32 delta-rule state per linear-attention layer"),
            Line(name="MLX buffer cache", nbytes=int(cfg.memory.mlx_cache_limit_gb * GB),
                 source="memory.mlx_cache_limit_gb, the cap qnpipe sets on MLX's reusable buffers"),
            Line(name="OS / page-cache headroom", nbytes=headroom_bytes,
                 source="--headroom (read.nocache keeps expert reads out of the page cache)")]


def pool_lines(facts: ModelFacts, caps: dict[int, int], side_slots: int) -> list[Line]:
    rec = facts.record_nbytes
    return [Line(name="expert pool", nbytes=sum(c * rec[ly] for ly, c in caps.items()),
                 source=f"{sum(caps.values())} resident slots x record bytes ({facts.record_source})"),
            Line(name="side region", nbytes=side_slots * sum(rec[ly] for ly in caps),
                 source=f"{side_slots} slots per layer x record bytes")]


def account(facts: ModelFacts, cfg: Config, caps: dict[int, int], *, side_slots: int, context: int,
            budget: int, headroom_bytes: int = 0) -> Account:
    return Account(budget=budget, lines=fixed_lines(facts, cfg, context=context, headroom_bytes=headroom_bytes)
                   + pool_lines(facts, caps, side_slots))


def minimum_budget(facts: ModelFacts, cfg: Config, *, context: int, headroom_bytes: int = 0) -> int:
    """The smallest budget that fits: every fixed line and top-k slots per MoE layer, no side region."""
    k = facts.args.num_experts_per_tok
    return (sum(x.nbytes for x in fixed_lines(facts, cfg, context=context, headroom_bytes=headroom_bytes))
            + k * sum(facts.record_nbytes.values()))


__all__ = ["KV_STEP", "Account", "Line", "ModelFacts", "account", "fixed_lines", "kv_nbytes", "minimum_budget",
           "model_facts", "nonexpert_params", "pool_lines", "shape_facts", "state_nbytes"]
