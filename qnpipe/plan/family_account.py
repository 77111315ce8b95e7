"""The memory account of a model of any MoE family mlx-lm runs, from its own skeleton (docs/plan.md).

    facts = family_facts(config, tensors, "model-dir")   # tensors: name -> shape and dtype (safetensors headers)
    lines = family_fixed_lines(facts, cfg, context=8192)

Every figure comes from mlx-lm's own model class of the config, built without weights
(`build_skeleton`: lazy arrays, nothing is computed or allocated):

- **parameters**: each skeleton tensor's elements at the dtype the checkpoint stores it in; the
  expert records are the switches' expert tensors (`expert_params`) over the expert count.
- **caches**: a one-token forward of the skeleton into `make_prompt_cache`, left unevaluated:
  the caches' shapes and dtypes say what each layer keeps. `KVCache` (MLA latent caches
  too) grows per token in mlx-lm's 256-token steps; `RotatingKVCache` is capped at its window
  (plus the prefill chunk less one: mlx-lm keeps a chunk's whole keys while it attends over
  them); `ChunkedKVCache` at its attention chunk (plus one step's growth); `ArraysCache`
  (Gated DeltaNet, Mamba, short conv) is a constant; `CacheList` the sum of its caches. Any other
  cache kind is refused by name.
- **activations**: a coarse per-token bound: the residual stream and its norm (4 x hidden),
  the widest layer's non-expert linear outputs plus top-k x (its expert linears' outputs and
  one input), the float32 router over every expert, and the attention scores twice (heads x
  context, activation dtype and a float32 softmax: gpt-oss's attention with sinks keeps two
  copies); plus the head's float32 logits and log-softmax.
  Checked against MLX's peak over real prefills of the tiny models of the tier-1 families
  (tests/plan/test_account_families.py).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from qnpipe.errors import CheckpointError
from qnpipe.plan.account import KV_STEP, Line, ModelFacts, forward_tokens, model_facts
from qnpipe.trace import ModelShape

if TYPE_CHECKING:
    from qnpipe.config import Config

# safetensors header dtypes (a spec's dtype is one of these, or an mx.Dtype)
_ST_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "U8": 1, "I8": 1, "U16": 2, "I16": 2, "U32": 4, "I32": 4,
             "U64": 8, "I64": 8, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
_FLOAT = {"F32": 4, "F16": 2, "BF16": 2}
HEAD_KEYS = ("num_attention_heads", "num_heads", "n_heads")
_LAYER = re.compile(r"(?:^|\.)(?:layers|h)\.(\d+)\.")


class CacheSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What one cache of a layer keeps: `per_token` bytes up to `window` tokens (0: no cap), and `constant` bytes."""

    kind: str  # kv, rotating, chunked, arrays
    layer: int
    per_token: int = 0
    window: int = 0
    constant: int = 0


class FamilyFacts(msgspec.Struct, frozen=True, kw_only=True):
    """What the account needs of a model of a generic family, and where each figure came from."""

    source: str
    model_type: str
    shape: ModelShape
    record_nbytes: dict[int, int]
    record_source: str
    non_expert_nbytes: int
    non_expert_source: str
    act_dtype_bytes: int
    caches: tuple[CacheSpec, ...]
    layer_width: int  # the widest layer's per-token activation elements (module doc)
    heads: int  # attention heads (the scores' width per context token)
    vocab_size: int
    bounce_reads: bool = False

    def own_lines(self, cfg: Config, *, context: int) -> tuple[Line, Line, Line]:
        """The KV cache, recurrent state and activation lines (`family_fixed_lines`)."""
        kv, state, acts = family_fixed_lines(self, cfg, context=context)
        return kv, state, acts


def spec_nbytes(shape: Any, dtype: Any) -> int:
    """Bytes of a tensor of `shape` and `dtype` (a safetensors dtype name or an mx.Dtype)."""
    size = dtype.size if hasattr(dtype, "size") else _ST_BYTES.get(str(dtype))
    if size is None:
        raise CheckpointError(f"a tensor of dtype {dtype!r}: not a dtype qnpipe can size")
    return math.prod(int(d) for d in shape) * int(size)


def family_facts(config: Mapping[str, Any], tensors: Mapping[str, Any], where: str, *,
                 act_dtype_bytes: int | None = None, bounce_reads: bool = False) -> FamilyFacts:
    """The facts of a model of `config` whose checkpoint holds `tensors` (name -> shape and dtype).

    CheckpointError naming `where` for a config mlx-lm cannot build, a dense model, a cache kind
    the account cannot size, or no attention head count where the model attends."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from qnpipe.model.family.skeleton import build_skeleton, family_info, text_config
    from qnpipe.model.family.switches import expert_params, find_switches

    model = build_skeleton(config, tensors, where)
    info = family_info(config, model, where)

    def nbytes(name: str, a: Any) -> int:
        spec = tensors.get(name)
        return spec_nbytes(a.shape, spec.dtype if spec is not None else a.dtype)

    params = {n: a for n, a in tree_flatten(model.parameters()) if isinstance(a, mx.array)}
    total = sum(nbytes(n, a) for n, a in params.items())
    records: dict[int, int] = {}
    width = 0
    expert_total = 0
    hidden = _hidden(text_config(config), where)
    for site in find_switches(model):
        ex = {f"{site.path}.{k}": a for k, a in expert_params(site.module).items()}
        layer_bytes = sum(nbytes(n, a) for n, a in ex.items())
        expert_total += layer_bytes
        records[site.layer] = layer_bytes // info.num_experts
    widths: dict[int, int] = {}
    for n, a in params.items():
        m = _LAYER.search(n)
        if m is None or not n.endswith(".weight") or a.ndim < 2:
            continue
        layer = int(m.group(1))
        if a.ndim == 3:  # an expert stack [E, out, in]: top-k experts' outputs and their input copy
            widths[layer] = widths.get(layer, 0) + info.num_experts_per_tok * (int(a.shape[1]) + hidden)
        elif not n.endswith(("embed_tokens.weight", "embedding.weight")):
            widths[layer] = widths.get(layer, 0) + int(a.shape[0])
    width = max(widths.values(), default=0)
    act = act_dtype_bytes or _act_bytes(tensors, where)
    caches = cache_specs(model, act, where, str(config.get("model_type")))
    tc = text_config(config)
    heads = next((int(tc[k]) for k in HEAD_KEYS if isinstance(tc.get(k), int)), 0)
    if not heads and any(c.kind != "arrays" for c in caches):
        raise CheckpointError(f"{where}: config.json names no attention head count ({', '.join(HEAD_KEYS)}): "
                              f"cannot size a {info.model_type} model's attention")
    shape = ModelShape(num_layers=info.num_hidden_layers, moe_layers=info.moe_layers, num_experts=info.num_experts,
                       top_k=info.num_experts_per_tok, hidden_size=hidden)
    return FamilyFacts(
        source=where, model_type=info.model_type, shape=shape, record_nbytes=records,
        record_source=f"the {info.switch_class} expert tensors of mlx-lm's {info.model_type} model, per expert",
        non_expert_nbytes=total - expert_total,
        non_expert_source=f"mlx-lm's {info.model_type} model's tensor shapes at the checkpoint's dtypes",
        act_dtype_bytes=act, caches=caches, layer_width=width, heads=heads, vocab_size=info.vocab_size,
        bounce_reads=bounce_reads)


def dir_facts(model_dir: str | Path, cfg: Config) -> ModelFacts | FamilyFacts:
    """The facts of a `qnpipe convert` output directory of any family: `model_facts` for Qwen3-Next,
    else `family_dir_facts`."""
    from qnpipe.model.args import read_config

    d = Path(model_dir)
    raw = read_config(d)
    if raw.get("model_type") == "qwen3_next":
        return model_facts(d, cfg)
    return family_dir_facts(d, raw, cfg)


def family_dir_facts(d: Path, config: Mapping[str, Any], cfg: Config) -> FamilyFacts:
    """The facts of a `qnpipe convert` directory of a generic family: the skeleton of its config.json,
    the non-expert files' headers and the store's expert stacks; the records' and the non-expert
    weights' bytes as the files hold them (CheckpointError/StoreError/ConfigError name what is wrong)."""
    from qnpipe.errors import ConfigError
    from qnpipe.io.store import read_index
    from qnpipe.io.store_format import ALIGN
    from qnpipe.model.checkpoint import scan
    from qnpipe.model.family.store_spec import headers_as_specs, index_tensor_specs

    model_type = config.get("model_type")
    if cfg.mtp.enabled:
        raise ConfigError(f"mtp.enabled: MTP runs on qwen3_next's native path only, not on a {model_type} model")
    root, index = read_index(cfg.model.expert_dir or d)
    headers = scan(d)
    specs = {**headers_as_specs(headers), **index_tensor_specs(index)}
    bounce = any(t.offset % ALIGN or t.nbytes % ALIGN for lf in index.layers for t in lf.tensors)
    facts = family_facts(config, specs, str(d / "config.json"), bounce_reads=bounce)
    records = {lf.layer: lf.record_nbytes for lf in index.layers}
    if missing := sorted(set(facts.shape.moe_layers) - set(records)):
        raise CheckpointError(f"{d}: the expert store has no records of MoE layers {missing}")
    files = sorted({h.file.name for h in headers.values()})
    return msgspec.structs.replace(
        facts, source=str(d), record_nbytes={ly: records[ly] for ly in facts.shape.moe_layers},
        record_source=str(root / "index.json"), non_expert_nbytes=sum(h.nbytes for h in headers.values()),
        non_expert_source="safetensors headers of " + ", ".join(files))


def _hidden(tc: Mapping[str, Any], where: str) -> int:
    for key in ("hidden_size", "model_dim", "d_model"):
        if isinstance(tc.get(key), int):
            return int(tc[key])
    raise CheckpointError(f"{where}: config.json has no hidden_size")


def _act_bytes(tensors: Mapping[str, Any], where: str) -> int:
    """The activations' dtype: the one most float tensors of the checkpoint have (norms, embeddings, scales)."""
    counts: dict[int, int] = {}
    for t in tensors.values():
        d = t.dtype
        size = _FLOAT.get(str(d)) if isinstance(d, str) else (d.size if "float" in str(d) else None)
        if size:
            counts[size] = counts.get(size, 0) + 1
    if not counts:
        raise CheckpointError(f"{where}: no float tensor: cannot tell the activations' dtype")
    return max(counts, key=lambda k: counts[k])


def cache_specs(model: Any, act_bytes: int, where: str, model_type: str) -> tuple[CacheSpec, ...]:
    """Each layer's caches, read off an unevaluated one-token forward of `model` into mlx-lm's caches."""
    import mlx.core as mx
    from mlx_lm.models.cache import ArraysCache, CacheList, ChunkedKVCache, KVCache, RotatingKVCache, make_prompt_cache

    dtype = {4: mx.float32, 2: mx.bfloat16}.get(act_bytes, mx.float32)
    model.set_dtype(dtype)  # activations follow the weights: a float32 skeleton would size float32 caches
    cache = make_prompt_cache(model)
    model(mx.array([[0]]), cache=cache)  # a graph only: never evaluated

    def kv_per_token(c: Any) -> int:
        k, v = c.keys, c.values
        return (k.shape[1] * k.shape[3] + v.shape[1] * v.shape[3]) * k.dtype.size

    out: list[CacheSpec] = []
    for i, top in enumerate(cache):
        for c in top.caches if type(top) is CacheList else (top,):
            if type(c) is KVCache:
                out.append(CacheSpec(kind="kv", layer=i, per_token=kv_per_token(c) if c.keys is not None else 0))
            elif type(c) is RotatingKVCache:
                out.append(CacheSpec(kind="rotating", layer=i, per_token=kv_per_token(c), window=c.max_size))
            elif type(c) is ChunkedKVCache:
                out.append(CacheSpec(kind="chunked", layer=i, per_token=kv_per_token(c), window=c.chunk_size))
            elif type(c) is ArraysCache:
                out.append(CacheSpec(kind="arrays", layer=i,
                                     constant=sum(a.nbytes for a in c.cache if a is not None)))
            else:
                raise CheckpointError(f"{where}: a {model_type} model keeps a {type(c).__name__} cache "
                                      f"(layer {i}): the plan cannot size it")
    return tuple(out)


def _round_step(n: int) -> int:
    return math.ceil(n / KV_STEP) * KV_STEP


def cache_nbytes(facts: FamilyFacts, context: int, tokens: int) -> tuple[int, int]:
    """(KV caches, constant states) at `context` tokens prefilled in forwards of `tokens` (module doc)."""
    kv = 0
    for c in facts.caches:
        if c.kind == "kv":
            held = _round_step(context)
        elif c.kind == "rotating":
            held = min(_round_step(context), c.window + max(tokens, 1) - 1)
        elif c.kind == "chunked":
            held = min(_round_step(context), c.window + _round_step(max(tokens, 1)))
        else:
            held = 0
        kv += held * c.per_token
    return kv, sum(c.constant for c in facts.caches)


def family_activation_nbytes(facts: FamilyFacts, cfg: Config, context: int) -> int:
    """The coarse bound on a forward's working set of `forward_tokens` tokens over `context` cached (module doc)."""
    t, act = forward_tokens(cfg, context), facts.act_dtype_bytes
    per_token = (act * (4 * facts.shape.hidden_size + facts.layer_width) + 4 * facts.shape.num_experts
                 + 2 * facts.heads * context * (act + 4))
    return t * per_token + 2 * facts.vocab_size * 4


def family_fixed_lines(facts: FamilyFacts, cfg: Config, *, context: int) -> list[Line]:
    """The KV cache, the constant states and the activations of a generic family (the rest: account.fixed_lines)."""
    from qnpipe.errors import ConfigError

    if cfg.kv.quantize:
        raise ConfigError(f"kv.quantize: the rotated KV quantization runs on qwen3_next's native path only, "
                          f"not on a {facts.model_type} model")
    tokens = forward_tokens(cfg, context)
    kv, states = cache_nbytes(facts, context, tokens)
    kinds = sorted({c.kind for c in facts.caches if c.kind != "arrays"})
    return [Line(name="KV cache", nbytes=kv,
                 source=f"{context} tokens of mlx-lm's {'/'.join(kinds) or 'no'} caches "
                        f"(full attention in {KV_STEP}-token steps, windows and chunks capped)"),
            Line(name="recurrent state", nbytes=states, source="mlx-lm's ArraysCache states (conv, SSM, delta rule)"),
            Line(name="activations", nbytes=family_activation_nbytes(facts, cfg, context),
                 source=f"a coarse per-token bound for a forward of {tokens} tokens "
                        f"(forward.prefill_chunk_tokens={cfg.forward.prefill_chunk_tokens}) over {context} cached")]


__all__ = ["CacheSpec", "FamilyFacts", "cache_nbytes", "cache_specs", "dir_facts", "family_activation_nbytes",
           "family_dir_facts", "family_facts",
           "family_fixed_lines", "spec_nbytes"]
