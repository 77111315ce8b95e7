"""The memory account of the generic families against what mlx-lm's own tiny models really hold."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache, CacheList, make_prompt_cache

from qnpipe import config
from qnpipe.errors import CheckpointError, ConfigError
from qnpipe.model.family import tiny
from qnpipe.model.family.registry import NO_SNAPSHOTS
from qnpipe.model.family.switches import expert_params, find_switches
from qnpipe.plan.account import fixed_lines, minimum_budget
from qnpipe.plan.family_account import FamilyFacts, cache_nbytes, cache_specs, family_activation_nbytes, family_facts

TIER1 = ["qwen3_moe", "gpt_oss", "glm4_moe", "qwen3_5_moe", "deepseek_v3", "minimax", "llama4", "mixtral"]
CASES = [(f, None) for f in sorted(set(tiny.CONFIGS) - set(NO_SNAPSHOTS))] + [(f, "affine4") for f in TIER1] + [("gpt_oss", "mxfp4")]
_MODELS: dict[tuple[str, str | None], Any] = {}


def _tiny(family: str, quant: str | None = None) -> tuple[dict[str, Any], Any]:
    if (family, quant) not in _MODELS:
        _MODELS[family, quant] = tiny.build_random(tiny.tiny_config(family), quant)
    cfg = tiny.tiny_config(family)
    if quant is not None:
        cfg["quantization"] = dict(tiny.QUANTS[quant])
    return cfg, _MODELS[family, quant]


def _facts(family: str, quant: str | None = None) -> Any:
    cfg, model = _tiny(family, quant)
    return family_facts(cfg, dict(tree_flatten(model.parameters())), f"tiny-{family}")


@pytest.mark.parametrize("family", sorted(NO_SNAPSHOTS))
def test_a_cache_the_plan_cannot_size_is_refused_by_name(family: str) -> None:
    with pytest.raises(CheckpointError, match=r"keeps a \w+ cache .*the plan cannot size it"):
        _facts(family)


@pytest.mark.parametrize(("family", "quant"), CASES)
def test_parameter_bytes_are_the_models(family: str, quant: str | None) -> None:
    _, model = _tiny(family, quant)
    facts = _facts(family, quant)
    params = [a for _, a in tree_flatten(model.parameters()) if isinstance(a, mx.array)]
    sites = find_switches(model)
    experts = {s.layer: sum(a.nbytes for a in expert_params(s.module).values()) for s in sites}
    assert facts.non_expert_nbytes + sum(experts.values()) == sum(a.nbytes for a in params)
    assert facts.record_nbytes == {ly: n // facts.shape.num_experts for ly, n in experts.items()}
    assert facts.shape.moe_layers == tuple(sorted(experts))


def test_parameter_bytes_follow_the_checkpoints_dtypes() -> None:
    """A bf16 checkpoint of the same shapes: half the float bytes, from the headers' dtypes alone."""
    cfg, model = _tiny("qwen3_moe")
    headers = {n: _Spec(a.shape, "BF16") for n, a in tree_flatten(model.parameters()) if isinstance(a, mx.array)}
    facts = family_facts(cfg, headers, "bf16")
    f32 = _facts("qwen3_moe")
    assert 2 * facts.non_expert_nbytes == f32.non_expert_nbytes and facts.act_dtype_bytes == 2
    assert all(2 * c.per_token == c32.per_token for c, c32 in zip(facts.caches, f32.caches, strict=True))


class _Spec:
    def __init__(self, shape: Any, dtype: str) -> None:
        self.shape, self.dtype = tuple(shape), dtype


def _held(c: Any) -> list[tuple[int, int, int]]:
    """(kind, bytes per token, tokens held, constant bytes) of a live cache and its sub-caches."""
    if isinstance(c, CacheList):
        return [x for s in c.caches for x in _held(s)]
    if isinstance(c, ArraysCache):
        return [(0, 0, sum(a.nbytes for a in c.cache if a is not None))]
    if c.keys is None:
        return [(0, 0, 0)]
    n = c.keys.shape[2]
    return [((c.keys.nbytes + c.values.nbytes) // n, n, 0)]


@pytest.mark.parametrize("family", sorted(set(tiny.CONFIGS) - set(NO_SNAPSHOTS)))
@pytest.mark.parametrize(("tokens", "chunk"), [(3, 3), (21, 7)])
def test_kv_bytes_per_token_and_states_are_what_mlx_lm_holds(family: str, tokens: int, chunk: int) -> None:
    _, model = _tiny(family)
    facts = _facts(family)
    cache = make_prompt_cache(model)
    ids = [(5 * i + 1) % 200 + 1 for i in range(tokens)]
    for lo in range(0, tokens, chunk):
        mx.eval(model(mx.array([ids[lo:lo + chunk]]), cache=cache))
    held = [x for c in cache for x in _held(c)]
    assert len(held) == len(facts.caches)
    for (per_token, n, constant), spec in zip(held, facts.caches, strict=True):
        assert constant == spec.constant
        if n:  # a layer's keys and values per token, MLA latents included
            assert per_token == spec.per_token, (spec.kind, spec.layer)
        if spec.kind in ("rotating", "chunked"):
            assert spec.window == (8 if spec.kind == "rotating" else 16)
    kv, states = cache_nbytes(facts, tokens, chunk)
    assert states == sum(x[2] for x in held)
    assert sum(p * n for p, n, _ in held) <= kv
    if all(s.kind in ("kv", "arrays") for s in facts.caches):  # mlx-lm's 256-token steps, exactly
        assert sum(p * n for p, n, _ in held) == kv
    # Windows cap the rotating and chunked caches: a long context costs no more than their window.
    long_kv, _ = cache_nbytes(facts, 100_096, chunk)  # 391 steps of 256
    capped = sum(s.per_token * 100_096 for s in facts.caches if s.kind == "kv")
    assert long_kv <= capped + sum(s.per_token * (s.window + 256 + chunk) for s in facts.caches if s.window)


# One fresh process measures every prefill peak: in this one an earlier test may have loaded the engine's
# OpenBLAS (process-wide, the first load wins), whose matmuls need other scratch memory than MLX's own BLAS,
# on which the bound is calibrated.
_PEAKS = """
import json, sys
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from qnpipe.model.family import tiny
out = {}
for family in sys.argv[2].split(","):
    model = tiny.build_random(tiny.tiny_config(family))
    mx.eval(model(mx.array([[1]]), cache=make_prompt_cache(model)))  # MLX's one-time start-up
    for tokens in map(int, sys.argv[1].split(",")):
        ids = mx.array([[(3 * i + 1) % 200 + 1 for i in range(tokens)]])
        cache = make_prompt_cache(model)
        mx.clear_cache()
        mx.reset_peak_memory()
        logits = model(ids, cache=cache)[:, -1, :]
        o = logits - mx.logsumexp(logits, keepdims=True)
        mx.eval(o, [c.state for c in cache])
        out[f"{family}/{tokens}"] = mx.get_peak_memory() - mx.get_active_memory()
        del logits, o, cache
print(json.dumps(out))
"""
PEAK_TOKENS = (1, 64, 256)


@pytest.fixture(scope="module")
def prefill_peaks() -> dict[str, int]:
    p = subprocess.run([sys.executable, "-c", _PEAKS, ",".join(map(str, PEAK_TOKENS)), ",".join(TIER1)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("family", TIER1)
@pytest.mark.parametrize("tokens", PEAK_TOKENS)
def test_the_activations_bound_a_real_prefills_peak(family: str, tokens: int, prefill_peaks: dict[str, int]) -> None:
    """MLX's peak over a prefill (the last position's logits and log-softmax as the sampler takes
    them) less what stays is within the bound, and the bound is coarse, not loose: within 3x from 64 up
    (measured: 1.1x to 2.6x)."""
    cfg = config.load(None, overrides={"forward.prefill_chunk_tokens": "0"})
    transient = prefill_peaks[f"{family}/{tokens}"]
    derived = family_activation_nbytes(_facts(family), cfg, tokens)
    assert transient <= derived, (family, tokens, transient, derived)
    if tokens >= 64:
        assert derived <= 3 * transient, (family, tokens, transient, derived)


def test_the_lines_of_a_generic_family() -> None:
    cfg = config.load(None)
    facts = _facts("gpt_oss")
    lines = {x.name: x for x in fixed_lines(facts, cfg, context=4096)}
    assert list(lines) == ["non-expert weights", "KV cache", "recurrent state", "MLX buffer cache", "activations",
                           "reader buffers", "process outside MLX", "OS / page-cache headroom"]
    assert lines["non-expert weights"].nbytes == facts.non_expert_nbytes
    assert lines["recurrent state"].nbytes == 0 and "rotating" in lines["KV cache"].source
    assert minimum_budget(facts, cfg, context=4096) == (sum(x.nbytes for x in lines.values())
                                                        + 4 * sum(facts.record_nbytes.values()))
    with pytest.raises(ConfigError, match="kv.quantize.*gpt_oss"):
        fixed_lines(facts, config.load(None, overrides={"kv.quantize": "true"}), context=4096)


def test_what_the_plan_cannot_size_is_refused_by_name() -> None:
    cfg, model = _tiny("qwen3_moe")
    tensors = dict(tree_flatten(model.parameters()))

    class Odd:
        nbytes = 0

    class Model:
        def make_cache(self) -> list[Any]:
            return [Odd()]

        def __call__(self, *a: Any, **k: Any) -> None:
            return None

        def set_dtype(self, d: Any) -> None:
            return None

    with pytest.raises(CheckpointError, match="tiny: a odd model keeps a Odd cache .layer 0.: the plan cannot size"):
        cache_specs(Model(), 4, "tiny", "odd")
    with pytest.raises(CheckpointError, match="no-heads: config.json names no attention head count"):
        _no_heads(cfg, tensors)
    with pytest.raises(CheckpointError, match="dense: a llama model has no routed experts"):
        family_facts({**tiny.BASE, "model_type": "llama", "num_hidden_layers": 1}, {}, "dense")
    with pytest.raises(CheckpointError, match="unknown: model_type 'nope' is not a model mlx-lm"):
        family_facts({**cfg, "model_type": "nope"}, tensors, "unknown")


def _no_heads(cfg: dict[str, Any], tensors: dict[str, Any]) -> None:
    import qnpipe.plan.family_account as fa

    saved = fa.HEAD_KEYS
    fa.HEAD_KEYS = ("no_such_key",)
    try:
        family_facts(cfg, tensors, "no-heads")
    finally:
        fa.HEAD_KEYS = saved


def _converted(tmp: Any, family: str, quant: str | None = None) -> Any:
    """A tiny model of `family` saved as mlx-lm saves one, then `qnpipe convert`ed."""
    from mlx_lm.utils import save_config, save_model

    from qnpipe.convert import convert

    cfg, model = _tiny(family, quant)
    src = tmp / f"{family}-src"
    src.mkdir()
    save_model(src, model)
    save_config(cfg, src / "config.json")
    (src / "tokenizer_config.json").write_text("{}")
    convert(src, tmp / family)
    return tmp / family


@pytest.mark.parametrize(("family", "quant"), [("gpt_oss", None), ("qwen3_moe", "affine4")])
def test_a_converted_directory_is_accounted_from_its_files(family: str, quant: str | None, tmp_path: Any) -> None:
    from qnpipe.io.store import read_index
    from qnpipe.model.checkpoint import scan
    from qnpipe.plan.family_account import dir_facts

    d = _converted(tmp_path, family, quant)
    facts = dir_facts(d, config.load(None))
    assert isinstance(facts, FamilyFacts) and facts.model_type == family
    _, index = read_index(d)
    assert facts.record_nbytes == {lf.layer: lf.record_nbytes for lf in index.layers}
    assert facts.non_expert_nbytes == sum(h.nbytes for h in scan(d).values()) == _facts(family, quant).non_expert_nbytes
    assert facts.caches == _facts(family, quant).caches
    with pytest.raises(ConfigError, match="mtp.enabled: MTP runs on qwen3_next's native path only"):
        dir_facts(d, config.load(None, overrides={"mtp.enabled": "true"}))


def test_qnpipe_plan_takes_a_generic_familys_directory(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from qnpipe.cli import main

    d = _converted(tmp_path, "gpt_oss")
    out = tmp_path / "plan.json"
    assert main(["plan", str(d), "--memory", "2GB", "--context", "512", "-o", str(out), "-q"]) == 0
    assert "expert pool" in capsys.readouterr().out and out.is_file()
    assert main(["plan", str(d), "--memory", "2GB", "--context", "512", "--ranks", "2", "-q"]) == 2
    assert "pipeline parallel runs on qwen3_next's native path only, not on a gpt_oss model" in capsys.readouterr().err
