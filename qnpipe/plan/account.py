"""The memory account: what a run of a model takes besides the expert pool, each line read, derived or measured.

    facts = model_facts("qn80b-4bit")                  # or shape_facts("config.json", bits=4)
    acct = account(facts, cfg, caps, side_slots=0, context=8192)

Where each figure comes from (docs/plan.md, "The memory account"); a model of another family than
Qwen3-Next is accounted from mlx-lm's own skeleton (qnpipe.plan.family_account.dir_facts picks):

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
- **MLX buffer cache**: the cap qnpipe sets on the freed buffers MLX keeps for reuse
  (`memory.mlx_cache_limit_gb`, qnpipe.model.memory.apply_memory_limits). Given by the user, that figure;
  else derived: the activations line, one forward's transient buffers, which is what the cache must hold
  for the next layer to reuse them; a plan then sets `memory.mlx_cache_limit_gb` to it (plan_settings).
  Checked against a real run: tools/bench_plan.py --live, docs/measurements.md.
- **activations**: the largest working set of one layer of a forward of T tokens against a KV cache
  of `context` tokens, T = `forward.prefill_chunk_tokens` (the whole context when 0: the longest
  prompt). Per token: the residual stream and its norm (4 x hidden), and the larger of the mixer
  (full attention: query with its gate, keys, values; plus heads x context attention scores in the
  activation dtype and their float32 softmax) (linear attention: the q/k/v/z and b/a projections, the
  conv output and, where mlx-lm runs the delta rule as ops (no Metal GPU: `gated_delta_update`'s
  fallback), one float32 state per token, value heads x value dim x key dim, and q and k repeated to
  the value heads in float32 (plus 4 states of one step's products); its Metal kernel keeps one
  state) and the MoE block (float32 router over every expert, top-k x (hidden + 3 x expert
  intermediate) for the routed experts' inputs, gate/up and outputs, 3 x shared intermediate); plus
  the head's float32 logits of the last position and their log-softmax. Checked against MLX's peak
  over a real prefill of the tiny model at 1 to 1024 tokens (tests/plan/test_account.py: the
  derived figure bounds the measured one and is within 2.5x of it).
- **reader buffers**: what the SSD reader allocates beyond the pool's slots: nothing when a record's
  reads land in place (every tensor of the record starts and ends on `ALIGN`, or reads do not
  bypass the page cache, or not on Linux: only O_DIRECT has the alignment rule); else one aligned
  bounce buffer per read in flight, `read.workers` x (record + `ALIGN`) (qnpipe.io.ssd: a batch's
  bounce buffers exist while its reads are on the device, at most `read.workers` of them).
- **process outside MLX**: the interpreter, the libraries and their heaps, measured in this process
  after importing what the engine imports (qnpipe.plan.process: resident set less MLX's memory);
  `plan.process_bytes` overrides it (planning for another machine: its figure).
- **headroom**: what the caller keeps for the operating system and the page cache (`headroom_bytes`,
  `qnpipe plan --headroom`); 0 by default, because the budget is what qnpipe may use and
  `read.nocache` (on by default) reads experts around the page cache.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, Protocol

import msgspec

from qnpipe.config import Config, explicit_settings
from qnpipe.errors import CheckpointError, ConfigError
from qnpipe.io.store_format import ALIGN, aligned_len
from qnpipe.model.args import ModelArgs, args_from_dict, read_config
from qnpipe.model.memory import GB
from qnpipe.plan.process import process_nbytes
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
    # Some tensor of a record does not start and end on ALIGN: a direct-I/O read bounces (qnpipe.io.ssd)
    bounce_reads: bool = False

    @property
    def shape(self) -> ModelShape:
        return ModelShape.of(self.args)


class FamilyLines(Protocol):
    """The facts of a model of another family (qnpipe.plan.family_account.FamilyLines): the account's
    shared lines read these, and it gives its own KV, state and activation lines."""

    @property
    def source(self) -> str: ...
    @property
    def shape(self) -> ModelShape: ...
    @property
    def record_nbytes(self) -> dict[int, int]: ...
    @property
    def record_source(self) -> str: ...
    @property
    def non_expert_nbytes(self) -> int: ...
    @property
    def non_expert_source(self) -> str: ...
    @property
    def bounce_reads(self) -> bool: ...

    def own_lines(self, cfg: Config, *, context: int) -> tuple[Line, Line, Line]: ...


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
    """The facts of a `qnpipe convert` output directory of Qwen3-Next (CheckpointError/StoreError name the file)."""
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
    bounce = any(t.offset % ALIGN or t.nbytes % ALIGN for lf in index.layers for t in lf.tensors)
    return ModelFacts(source=str(d), args=args, record_nbytes={ly: records[ly] for ly in args.moe_layers},
                      record_source=f"{index_path_of(d, cfg)}", non_expert_nbytes=non_expert,
                      non_expert_source="safetensors headers of " + ", ".join(f.name for f in files),
                      act_dtype_bytes=act, bounce_reads=bounce)


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
    bounce = any(n % ALIGN for o, i in args.expert_dims.values()
                 for n in _tensor_bytes(o, i, bits, group_size, float_bytes))
    mats, vecs = nonexpert_params(args)
    non_expert = sum(_matrix_bytes(o, i, bits, group_size, float_bytes) for o, i in mats) + vecs * float_bytes
    how = f"{bits}-bit, group {group_size}, bf16 scales" if bits else f"{dtype}"
    return ModelFacts(source=str(p), args=args, record_nbytes=dict.fromkeys(args.moe_layers, rec),
                      record_source=f"derived from {p.name}: 3 projections at {how}",
                      non_expert_nbytes=non_expert,
                      non_expert_source=f"derived from {p.name}: tensor shapes at {how}",
                      act_dtype_bytes=2 if bits else float_bytes, bounce_reads=bounce)


def _read_json(p: Path) -> dict[str, Any]:
    try:
        raw = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{p}: not a readable config.json ({e})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{p}: expected a JSON object")
    return raw


def _tensor_bytes(out: int, inp: int, bits: int | None, group: int, float_bytes: int) -> tuple[int, ...]:
    if bits is None or inp % group:
        return (out * inp * float_bytes,)
    return out * inp * bits // 8, out * (inp // group) * 2, out * (inp // group) * 2  # packed weight, bf16 scales, biases


def _matrix_bytes(out: int, inp: int, bits: int | None, group: int, float_bytes: int) -> int:
    return sum(_tensor_bytes(out, inp, bits, group, float_bytes))


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


def forward_tokens(cfg: Config, context: int) -> int:
    """Tokens of the largest forward: a prefill chunk (`forward.prefill_chunk_tokens`), the whole
    context when chunking is off (0)."""
    chunk = cfg.forward.prefill_chunk_tokens
    return min(chunk, context) if chunk else context


def delta_kernel(facts: ModelFacts) -> bool:
    """Whether mlx-lm's gated delta rule runs as its Metal kernel here (else as ops: a state per token)."""
    import mlx.core as mx

    dk = facts.args.linear_key_head_dim
    return bool(mx.default_device() == mx.gpu and mx.metal.is_available() and dk >= 32 and dk % 32 == 0)


def activation_nbytes(facts: ModelFacts, cfg: Config, context: int, *, kernel: bool | None = None) -> int:
    """The largest layer's working set of a forward of `forward_tokens` tokens with `context` cached
    (module doc), and the head's last-position logits; `kernel`: the delta rule's Metal kernel
    (default: whether it runs here, `delta_kernel`)."""
    a = facts.args
    t, act = forward_tokens(cfg, context), facts.act_dtype_bytes
    key_dim = a.linear_num_key_heads * a.linear_key_head_dim
    value_dim = a.linear_num_value_heads * a.linear_value_head_dim
    state = a.linear_num_value_heads * a.linear_value_head_dim * a.linear_key_head_dim * STATE_DTYPE_BYTES
    per_token_state = not (delta_kernel(facts) if kernel is None else kernel)
    linear = ((2 * key_dim + 2 * value_dim + 2 * a.linear_num_value_heads) * act + (2 * key_dim + value_dim) * act
              + (state + 2 * a.linear_num_value_heads * a.linear_key_head_dim * 4 if per_token_state else 0))
    attention = ((2 * a.num_attention_heads + 2 * a.num_key_value_heads) * a.head_dim * act
                 + a.num_attention_heads * context * (act + 4))
    moe = (a.num_experts * 4 + a.num_experts_per_tok * (a.hidden_size + 3 * a.moe_intermediate_size) * act
           + 3 * a.shared_expert_intermediate_size * act)
    dense = 3 * a.intermediate_size * act
    mixer = max(linear if a.is_linear(i) else attention for i in range(a.num_hidden_layers))
    ffn = max(moe if a.is_moe(i) else dense for i in range(a.num_hidden_layers))
    # Beside the per-token terms: the head's float32 logits and log-softmax; the delta rule's step
    # transients (the decayed state, two products and the sum: 4 states; the kernel: its one state).
    return t * (4 * a.hidden_size * act + max(mixer, ffn)) + 2 * a.vocab_size * 4 + (4 if per_token_state else 1) * state


def reader_nbytes(facts: ModelFacts | FamilyLines, cfg: Config) -> tuple[int, str]:
    """The reader's bounce buffers (module doc), and why they are what they are."""
    if not (facts.bounce_reads and cfg.read.nocache and sys.platform.startswith("linux")):
        why = ("records' tensors are ALIGN-aligned" if not facts.bounce_reads
               else "read.nocache off" if not cfg.read.nocache else "no O_DIRECT alignment rule here")
        return 0, f"reads land in the pool's slots ({why})"
    rec = max(facts.record_nbytes.values())
    return (cfg.read.workers * aligned_len(rec + ALIGN),
            f"read.workers ({cfg.read.workers}) direct-I/O bounce buffers of a record ({rec} bytes) + {ALIGN}")


def fixed_lines(facts: ModelFacts | FamilyLines, cfg: Config, *, context: int, headroom_bytes: int = 0) -> list[Line]:
    """Every line but the pool and side region (they depend on the plan); a generic family's caches and
    activations from its skeleton (`FamilyLines.own_lines`, qnpipe.plan.family_account)."""
    if not isinstance(facts, ModelFacts):
        kv, state, acts = facts.own_lines(cfg, context=context)
        common = _common_lines(facts, cfg, headroom_bytes, acts.nbytes)
        return [Line(name="non-expert weights", nbytes=facts.non_expert_nbytes, source=facts.non_expert_source),
                kv, state, common[0], acts, *common[1:]]
    kv_src = (f"{context} tokens in mlx-lm's {KV_STEP}-token steps x "
              f"{'quantized ' if cfg.kv.quantize else ''}KV bytes per token")
    tokens = forward_tokens(cfg, context)
    acts = activation_nbytes(facts, cfg, context)
    common = _common_lines(facts, cfg, headroom_bytes, acts)
    return [Line(name="non-expert weights", nbytes=facts.non_expert_nbytes, source=facts.non_expert_source),
            Line(name="KV cache", nbytes=kv_nbytes(facts, cfg, context), source=kv_src),
            Line(name="recurrent state", nbytes=state_nbytes(facts),
                 source="conv window + float32 delta-rule state per linear-attention layer"),
            common[0],
            Line(name="activations", nbytes=acts,
                 source=f"the largest layer's working set for a forward of {tokens} tokens "
                        f"(forward.prefill_chunk_tokens={cfg.forward.prefill_chunk_tokens}) over {context} cached; "
                        f"delta rule {'as the Metal kernel' if delta_kernel(facts) else 'as ops: a state per token'}"),
            *common[1:]]


CACHE_LINE = "MLX buffer cache"


def cache_line(cfg: Config, activations: int) -> Line:
    """MLX's buffer cache: `memory.mlx_cache_limit_gb` when the user gave it, else the activations line
    (one forward's transient buffers, what the next layer reuses; module doc), which a plan then sets."""
    given = explicit_settings(cfg).get("memory.mlx_cache_limit_gb")
    if given is not None:
        return Line(name=CACHE_LINE, nbytes=int(cfg.memory.mlx_cache_limit_gb * GB),
                    source=f"memory.mlx_cache_limit_gb, given ({given}): the cap on MLX's reusable buffers")
    return Line(name=CACHE_LINE, nbytes=activations,
                source="derived: the activations line (one forward's transient buffers, reused by the next "
                       "layer); the plan sets memory.mlx_cache_limit_gb to it")


def cache_limit_gb(acct: Account) -> float:
    """The `memory.mlx_cache_limit_gb` an account's buffer-cache line stands for (exact: a byte count / 2^30)."""
    return next(x.nbytes for x in acct.lines if x.name == CACHE_LINE) / GB


def _common_lines(facts: ModelFacts | FamilyLines, cfg: Config, headroom_bytes: int, activations: int) -> list[Line]:
    """The lines every family shares: MLX's buffer cache, then the reader, the process and the headroom."""
    reader, reader_src = reader_nbytes(facts, cfg)
    process, process_src = process_nbytes(cfg)
    return [cache_line(cfg, activations),
            Line(name="reader buffers", nbytes=reader, source=reader_src),
            Line(name="process outside MLX", nbytes=process, source=process_src),
            Line(name="OS / page-cache headroom", nbytes=headroom_bytes,
                 source="--headroom (read.nocache keeps expert reads out of the page cache)")]


def pool_lines(facts: ModelFacts | FamilyLines, caps: dict[int, int], side_slots: int) -> list[Line]:
    rec = facts.record_nbytes
    return [Line(name="expert pool", nbytes=sum(c * rec[ly] for ly, c in caps.items()),
                 source=f"{sum(caps.values())} resident slots x record bytes ({facts.record_source})"),
            Line(name="side region", nbytes=side_slots * sum(rec[ly] for ly in caps),
                 source=f"{side_slots} slots per layer x record bytes")]


def account(facts: ModelFacts | FamilyLines, cfg: Config, caps: dict[int, int], *, side_slots: int, context: int,
            budget: int, headroom_bytes: int = 0) -> Account:
    return Account(budget=budget, lines=fixed_lines(facts, cfg, context=context, headroom_bytes=headroom_bytes)
                   + pool_lines(facts, caps, side_slots))


def minimum_budget(facts: ModelFacts | FamilyLines, cfg: Config, *, context: int, headroom_bytes: int = 0) -> int:
    """The smallest budget that fits: every fixed line and top-k slots per MoE layer, no side region."""
    k = facts.shape.top_k
    return (sum(x.nbytes for x in fixed_lines(facts, cfg, context=context, headroom_bytes=headroom_bytes))
            + k * sum(facts.record_nbytes.values()))


__all__ = ["CACHE_LINE", "KV_STEP", "Account", "Line", "ModelFacts", "account", "activation_nbytes", "cache_limit_gb",
           "cache_line", "fixed_lines",
           "forward_tokens",
           "delta_kernel", "kv_nbytes", "minimum_budget", "model_facts", "nonexpert_params", "pool_lines", "reader_nbytes",
           "shape_facts", "state_nbytes"]
