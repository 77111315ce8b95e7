"""Tiny random Qwen3-Next model directories (HF or mlx-lm layout) for tests and the demo.

The weights are random but deterministic per seed; the tokenizer is the committed 1024-id byte-level
BPE of ``qnpipe/data/tokenizer`` (trained by ``tools/train_tokenizer.py``).
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import os
import shutil
import sys
import zlib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np

from qnpipe.convert.plan import transform
from qnpipe.convert.safetensors_out import OutTensor, WriteJob, write_safetensors
from qnpipe.errors import ConfigError
from qnpipe.io.outdir import atomic_dir, check_output_location, check_replaceable, clean_stale, output_path
from qnpipe.model.args import args_from_dict

__all__ = ["TINY_CONFIG", "TOKENIZER_DIR", "TOKENIZER_VOCAB_SIZE", "make_tiny", "prepare_output", "random_hf_weights"]

TOKENIZER_DIR = Path(__file__).resolve().parents[1] / "data" / "tokenizer"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
TOKENIZER_VOCAB_SIZE = 1024

# The tiny test configuration of docs/model.md, stored as float32.
TINY_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "vocab_size": 1024,
    "hidden_size": 128,
    "num_hidden_layers": 8,
    "full_attention_interval": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "partial_rotary_factor": 0.25,
    "rope_theta": 10000000,
    "rope_scaling": None,
    "max_position_embeddings": 4096,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "linear_conv_kernel_dim": 4,
    "num_experts": 64,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "intermediate_size": 256,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-06,
    "initializer_range": 0.02,
    "tie_word_embeddings": False,
    "use_cache": True,
    "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
    "mtp_num_hidden_layers": 1,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}

_DTYPES = ("float32", "bfloat16")


class _Gen:
    """Per-tensor generator: each tensor's values depend only on (seed, name, shape)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def rng(self, name: str) -> np.random.Generator:
        return np.random.default_rng([self.seed, zlib.crc32(name.encode())])

    def linear(self, name: str, out: int, inp: int, gain: float = 1.0) -> np.ndarray:
        # Fan-in scaling keeps activations O(1) for any hidden size, so the routing and logit
        # spreads chosen by `gain` hold for every config shape.
        w = self.rng(name).standard_normal((out, inp), dtype=np.float32)
        return w * np.float32(gain / math.sqrt(inp))

    def normal(self, name: str, shape: tuple[int, ...], std: float, mean: float = 0.0) -> np.ndarray:
        w = self.rng(name).standard_normal(shape, dtype=np.float32)
        return w * np.float32(std) + np.float32(mean)


def random_hf_weights(config: Mapping[str, Any], seed: int) -> dict[str, np.ndarray]:
    """Deterministic random float32 weights under the original HF tensor names and shapes (incl. ``mtp.*``)."""
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    g = _Gen(seed)
    c = config
    # ModelArgs holds the layer rules (linear vs full attention, MoE vs dense), as in mlx-lm.
    args = args_from_dict(dict(c), "tiny config")
    H, V = c["hidden_size"], c["vocab_size"]
    nh, nkv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    nk, nv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    dk, dv, K = c["linear_key_head_dim"], c["linear_value_head_dim"], c["linear_conv_kernel_dim"]
    E, inter, Is = c["num_experts"], c["moe_intermediate_size"], c["shared_expert_intermediate_size"]
    L = c["num_hidden_layers"]
    key_dim, value_dim = nk * dk, nv * dv
    conv_dim = 2 * key_dim + value_dim
    real_vocab = min(V, TOKENIZER_VOCAB_SIZE)
    w: dict[str, np.ndarray] = {}

    def norm(name: str, n: int) -> None:
        w[name] = g.normal(name, (n,), 0.1)  # zero-centred: the model applies 1 + w

    def lin(name: str, out: int, inp: int, gain: float = 1.0) -> None:
        w[name] = g.linear(name, out, inp, gain)

    def attn(p: str) -> None:
        lin(p + "self_attn.q_proj.weight", nh * hd * 2, H)
        lin(p + "self_attn.k_proj.weight", nkv * hd, H)
        lin(p + "self_attn.v_proj.weight", nkv * hd, H)
        lin(p + "self_attn.o_proj.weight", H, nh * hd)
        norm(p + "self_attn.q_norm.weight", hd)
        norm(p + "self_attn.k_norm.weight", hd)

    def linear_attn(p: str) -> None:
        q = p + "linear_attn."
        lin(q + "in_proj_qkvz.weight", 2 * key_dim + 2 * value_dim, H)
        lin(q + "in_proj_ba.weight", 2 * nv, H, gain=0.5)
        w[q + "conv1d.weight"] = g.normal(q + "conv1d.weight", (conv_dim, 1, K), 1.0 / math.sqrt(K))
        # Slow decays (exp(g) mostly 0.5-0.99) so the recurrent state carries over many tokens.
        dt = np.exp(g.rng(q + "dt_bias").uniform(math.log(0.01), math.log(0.3), nv))
        w[q + "dt_bias"] = (dt + np.log(-np.expm1(-dt))).astype(np.float32)  # softplus⁻¹(dt)
        w[q + "A_log"] = np.log(g.rng(q + "A_log").uniform(0.5, 4.0, nv)).astype(np.float32)
        w[q + "norm.weight"] = g.normal(q + "norm.weight", (dv,), 0.1, mean=1.0)  # plain weight
        lin(q + "out_proj.weight", H, value_dim)

    def mlp(p: str, moe: bool) -> None:
        if not moe:
            Id = c["intermediate_size"]
            lin(p + "mlp.gate_proj.weight", Id, H)
            lin(p + "mlp.up_proj.weight", Id, H)
            lin(p + "mlp.down_proj.weight", H, Id)
            return
        # Router logits with std ~2: peaked but not one-hot top-k weights, varied choices per token.
        lin(p + "mlp.gate.weight", E, H, gain=2.0)
        for e in range(E):
            lin(p + f"mlp.experts.{e}.gate_proj.weight", inter, H)
            lin(p + f"mlp.experts.{e}.up_proj.weight", inter, H)
            lin(p + f"mlp.experts.{e}.down_proj.weight", H, inter)
        lin(p + "mlp.shared_expert.gate_proj.weight", Is, H)
        lin(p + "mlp.shared_expert.up_proj.weight", Is, H)
        lin(p + "mlp.shared_expert.down_proj.weight", H, Is)
        lin(p + "mlp.shared_expert_gate.weight", 1, H, gain=1.5)

    emb = g.normal("model.embed_tokens.weight", (V, H), 1.0)
    emb[real_vocab:] = 0.0  # padding rows beyond the tokenizer
    w["model.embed_tokens.weight"] = emb
    for layer in range(L):
        p = f"model.layers.{layer}."
        norm(p + "input_layernorm.weight", H)
        if args.is_linear(layer):
            linear_attn(p)
        else:
            attn(p)
        norm(p + "post_attention_layernorm.weight", H)
        mlp(p, args.is_moe(layer))
    norm("model.norm.weight", H)
    if not c.get("tie_word_embeddings", False):
        head = g.linear("lm_head.weight", V, H, gain=2.5)
        head[real_vocab:] = 0.0
        w["lm_head.weight"] = head

    for n in range(c.get("mtp_num_hidden_layers", 1)):
        p = f"mtp.layers.{n}."
        norm(p + "input_layernorm.weight", H)
        attn(p)
        norm(p + "post_attention_layernorm.weight", H)
        mlp(p, c["num_experts"] > 0)
    if c.get("mtp_num_hidden_layers", 1) > 0:
        lin("mtp.fc.weight", H, 2 * H)
        norm("mtp.pre_fc_norm_embedding.weight", H)
        norm("mtp.pre_fc_norm_hidden.weight", H)
        norm("mtp.norm.weight", H)
    return w


def _write_safetensors(path: Path, tensors: Mapping[str, np.ndarray], dtype: str) -> int:
    """Write one safetensors file (tensors in the given order); return its tensor-data size."""
    st_dtype = {"float32": "F32", "bfloat16": "BF16"}[dtype]

    def job(name: str, a: np.ndarray) -> WriteJob:
        def run() -> Iterator[tuple[int, int, np.ndarray]]:
            # convert's own cast (round to nearest even), so tiny bf16 weights are what convert would make.
            yield 0, 0, transform(a, "F32", cast=dtype if dtype != "float32" else None)[0]

        return WriteJob((OutTensor(name, st_dtype, a.shape),), run)

    jobs = [job(n, a) for n, a in tensors.items()]
    write_safetensors(path, jobs, lambda n: None)
    return sum(o.nbytes for j in jobs for o in j.outs)


def _expert_key(name: str) -> tuple[str, int] | None:
    """(mlp prefix, expert index) of a per-expert tensor name, else None."""
    head, sep, tail = name.partition(".mlp.experts.")
    if not sep:
        return None
    return head, int(tail.split(".", 1)[0])


def _shard_cuts(names: list[str], sizes: list[int], shards: int) -> list[int]:
    """Indices where new shards start, balanced by bytes; prefers cuts between two experts of one layer."""
    cum = np.cumsum([0, *sizes])
    total = int(cum[-1])

    def pick(candidates: list[int]) -> list[int]:
        cuts: list[int] = []
        for j in range(1, shards):
            target = total * j / shards
            free = [i for i in candidates if not cuts or i > cuts[-1]]
            if not free:
                break
            cuts.append(min(free, key=lambda i: abs(int(cum[i]) - target)))
        return cuts

    inside_experts = [
        i
        for i in range(1, len(names))
        if (a := _expert_key(names[i - 1])) and (b := _expert_key(names[i])) and a[0] == b[0] and a[1] != b[1]
    ]
    cuts = pick(inside_experts)
    if len(cuts) < shards - 1:
        cuts = pick(list(range(1, len(names))))
    if len(cuts) < shards - 1:
        raise ValueError(f"cannot split {len(names)} tensors into {shards} shards")
    return cuts


def _write_hf(out: Path, config: dict[str, Any], seed: int, shards: int, dtype: str) -> None:
    """Write an HF-layout checkpoint (config, generation config, safetensors, tokenizer) into ``out``."""
    out.mkdir(parents=True)
    weights = random_hf_weights(config, seed)
    names = list(weights)
    if shards == 1:
        _write_safetensors(out / "model.safetensors", weights, dtype)
    else:
        itemsize = 4 if dtype == "float32" else 2
        cuts = _shard_cuts(names, [weights[n].size * itemsize for n in names], shards)
        bounds = [0, *cuts, len(names)]
        weight_map: dict[str, str] = {}
        total = 0
        for s in range(shards):
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: weights[n] for n in names[bounds[s] : bounds[s + 1]]}
            total += _write_safetensors(out / fname, part, dtype)
            weight_map.update(dict.fromkeys(part, fname))
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"], "pad_token_id": 0}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    for f in TOKENIZER_FILES:
        shutil.copyfile(TOKENIZER_DIR / f, out / f)


def _write_mlx(out: Path, hf_dir: Path, bits: int | None, group_size: int) -> None:
    """Run ``mlx_lm.convert`` on ``hf_dir`` into ``out`` (which must not exist)."""
    from mlx_lm import convert

    # convert() prints progress; keep library output off the caller's stdout.
    with contextlib.redirect_stdout(io.StringIO()):
        convert(
            hf_path=str(hf_dir),
            mlx_path=str(out),
            quantize=bits is not None,
            q_bits=bits,
            q_group_size=group_size if bits is not None else None,
        )
    for f in TOKENIZER_FILES:
        if not (out / f).exists():
            shutil.copyfile(TOKENIZER_DIR / f, out / f)


def _config(overrides: Mapping[str, Any] | None, dtype: str) -> dict[str, Any]:
    config = copy.deepcopy(TINY_CONFIG)
    config.update(copy.deepcopy(dict(overrides or {})))
    config["torch_dtype"] = dtype
    if config["vocab_size"] < TOKENIZER_VOCAB_SIZE:
        raise ConfigError(
            f"vocab_size {config['vocab_size']} is smaller than the tiny tokenizer's {TOKENIZER_VOCAB_SIZE} ids"
        )
    if config["num_experts"] > 0 and not 0 < config["num_experts_per_tok"] <= config["num_experts"]:
        raise ConfigError(
            f"num_experts_per_tok {config['num_experts_per_tok']} must be in 1..num_experts ({config['num_experts']})"
        )
    return config


def _stderr(msg: str) -> None:
    print(f"qnpipe: {msg}", file=sys.stderr)


def make_tiny(
    out_dir: str | os.PathLike[str],
    *,
    layout: Literal["hf", "mlx"] = "hf",
    bits: int | None = None,
    group_size: int = 64,
    seed: int = 0,
    config_overrides: Mapping[str, Any] | None = None,
    shards: int = 1,
    dtype: str = "float32",
    force: bool = False,
    log: Callable[[str], None] | None = None,
) -> Path:
    """Create a tiny random Qwen3-Next model directory and return its path.

    ``layout="hf"`` writes the original checkpoint layout (per-expert tensors, ``mtp.*``, optionally
    ``shards`` files with an index); ``layout="mlx"`` is what ``mlx_lm.convert`` makes of it
    (``bits`` quantises with ``group_size``; no MTP). ``dtype`` is the stored float type.
    ``force`` replaces a non-empty ``out_dir`` that qnpipe wrote (never another directory:
    qnpipe.io.outdir.check_replaceable); ``log`` gets the notices about what an interrupted
    earlier run left (default: stderr).
    """
    if layout not in ("hf", "mlx"):
        raise ValueError(f"layout must be 'hf' or 'mlx', got {layout!r}")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {_DTYPES}, got {dtype!r}")
    if bits is not None and layout != "mlx":
        raise ValueError("bits (quantisation) needs layout='mlx'")
    if shards < 1 or (shards != 1 and layout != "hf"):
        raise ValueError(f"shards must be 1, or > 1 with layout='hf'; got {shards} with layout={layout!r}")
    config = _config(config_overrides, dtype)

    out = prepare_output(out_dir, force, log)
    with atomic_dir(out, marker="qnpipe make-tiny") as build:
        hf = build.parent / "hf"  # inside the locked temporary directory: removed with it, even after a kill
        if layout == "mlx":
            _write_hf(hf, config, seed, shards, dtype)
            # mlx_lm.convert wants to create its output itself.
            build.rmdir()
            _write_mlx(build, hf, bits, group_size)
            shutil.rmtree(hf)
        else:
            build.rmdir()
            _write_hf(build, config, seed, shards, dtype)
    return out


def prepare_output(out_dir: str | os.PathLike[str], force: bool, log: Callable[[str], None] | None) -> Path:
    """make-tiny's output directory, checked (replaceable only with `force`, and only if qnpipe wrote it)
    and its parent made; what an interrupted earlier run left is cleaned first."""
    out = output_path(out_dir)
    if out.name and out.parent.is_dir():  # first: a replace cut short may have left the only copy of `out` aside
        clean_stale(out.parent, out.name, log or _stderr)
    check_replaceable(out, force, "output directory", force_flag="force=True")
    check_output_location(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    return out
