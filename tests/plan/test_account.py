"""The memory account's derived lines against what the tiny model really has."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import msgspec
import pytest

from qnpipe import config
from qnpipe.errors import ConfigError
from qnpipe.model.checkpoint import read_header
from qnpipe.plan.account import (
    KV_STEP,
    activation_nbytes,
    delta_kernel,
    fixed_lines,
    kv_nbytes,
    model_facts,
    reader_nbytes,
    shape_facts,
    state_nbytes,
)

DATA = Path(__file__).parent / "data"


@pytest.mark.slow
@pytest.mark.parametrize("tokens", [1, 257])
def test_kv_and_recurrent_state_equal_a_real_prefill(tiny_qn4: Path, tokens: int) -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from qnpipe.model.load import load_model

    cfg = config.load(None)
    facts = model_facts(tiny_qn4, cfg)
    model = load_model(tiny_qn4).model
    cache = model.make_cache()
    mx.eval(model(mx.array([[1] * tokens]), cache=cache))
    kv = sum(a.nbytes for c in cache if isinstance(c, KVCache) for a in (c.keys, c.values) if a is not None)
    state = sum(a.nbytes for c in cache if not isinstance(c, KVCache) for a in c.cache if a is not None)
    assert kv == kv_nbytes(facts, cfg, tokens)
    assert kv_nbytes(facts, cfg, tokens) == kv_nbytes(facts, cfg, -(-tokens // KV_STEP) * KV_STEP)
    assert state == state_nbytes(facts)


def test_model_dir_facts_are_its_files(tiny_qn4: Path) -> None:
    facts = model_facts(tiny_qn4, config.load(None))
    index = json.loads((tiny_qn4 / "experts" / "index.json").read_text())
    assert set(facts.record_nbytes.values()) == {lf["record_nbytes"] for lf in index["layers"]}
    assert facts.non_expert_nbytes == sum(i.nbytes for i in read_header(tiny_qn4 / "model.safetensors").values())


def test_shape_facts_derive_the_same_records_and_float_weights(tiny_qn4: Path, tiny_hf: Path) -> None:
    qn = model_facts(tiny_qn4, config.load(None))
    assert shape_facts(tiny_qn4 / "config.json").record_nbytes == qn.record_nbytes  # its 4-bit quantization
    # The float checkpoint: every tensor but the routed experts and the MTP head, from the shapes alone.
    derived = shape_facts(tiny_hf / "config.json")
    files = sorted(tiny_hf.glob("*.safetensors"))
    real = sum(i.nbytes for f in files for name, i in read_header(f).items()
               if ".experts." not in name and not name.startswith("mtp."))
    assert derived.non_expert_nbytes == real
    assert derived.record_nbytes[0] == sum(i.nbytes for f in files for name, i in read_header(f).items()
                                           if ".layers.0.mlp.experts.0." in name and not name.startswith("mtp."))


def test_the_80b_record_is_the_stores() -> None:
    facts = shape_facts(DATA / "qwen3-next-80b-a3b.config.json", bits=4)
    assert set(facts.record_nbytes.values()) == {1769472}  # tools/bench_io.py's RECORD_80B_4BIT
    with pytest.raises(ConfigError, match="bits=7"):
        shape_facts(DATA / "qwen3-next-80b-a3b.config.json", bits=7)


@pytest.mark.slow
@pytest.mark.parametrize("tokens", [1, 2, 64, 300, 1024])
def test_the_activations_line_bounds_a_real_prefills_peak(tiny_qn4: Path, tokens: int) -> None:
    """MLX's peak over a prefill of `tokens` (the hidden states, then the last position's logits and
    log-softmax as the sampler takes them) less what stays (weights, caches) is within the line, and
    the line is not a loose bound: within 2.5x of it from 64 tokens up."""
    import mlx.core as mx

    from qnpipe.model.load import load_model

    cfg = config.load(None, overrides={"forward.prefill_chunk_tokens": "0"})
    facts = model_facts(tiny_qn4, cfg)
    model = load_model(tiny_qn4).model
    mx.eval(model(mx.array([[1]]), cache=model.make_cache()))  # MLX's one-time start-up
    cache = model.make_cache()
    mx.clear_cache()
    mx.reset_peak_memory()
    logits = model.head(model.model(mx.array([[1] * tokens]), cache)[:, -1, :])
    out = logits - mx.logsumexp(logits, keepdims=True)
    mx.eval(out, cache)
    transient = mx.get_peak_memory() - mx.get_active_memory()
    derived = activation_nbytes(facts, cfg, tokens)
    assert transient <= derived
    if tokens >= 64:  # below, the few fixed terms (the head, one step's delta-rule states) are most of it
        assert derived <= 2.5 * transient
    assert derived == activation_nbytes(facts, cfg, tokens, kernel=delta_kernel(facts))


def test_the_activations_follow_the_prefill_chunk_and_the_reader_its_alignment(tiny_qn4: Path) -> None:
    chunked = config.load(None, overrides={"forward.prefill_chunk_tokens": "2"})
    whole = config.load(None, overrides={"forward.prefill_chunk_tokens": "0"})
    facts = model_facts(tiny_qn4, chunked)
    assert activation_nbytes(facts, chunked, 8192) < activation_nbytes(facts, whole, 512) < activation_nbytes(
        facts, whole, 8192)
    # The delta rule as ops keeps a float32 state per token; the kernel one.
    assert activation_nbytes(facts, whole, 64, kernel=False) > activation_nbytes(facts, whole, 64, kernel=True)
    assert reader_nbytes(facts, whole)[0] == 0 or facts.bounce_reads
    bouncing = msgspec.structs.replace(facts, bounce_reads=True)
    n, src = reader_nbytes(bouncing, whole)
    if sys.platform.startswith("linux"):
        assert n == whole.read.workers * (-(-(max(facts.record_nbytes.values()) + 4096) // 4096) * 4096)
        assert "bounce" in src
    assert reader_nbytes(bouncing, config.load(None, overrides={"read.nocache": "false"}))[0] == 0
    # The 80B's records (512 KiB and 32 KiB tensors) land in place.
    assert not shape_facts(DATA / "qwen3-next-80b-a3b.config.json", bits=4).bounce_reads


def test_the_process_line_is_measured_or_the_configs(tiny_qn4: Path) -> None:
    from qnpipe.plan.process import RUN_GROWTH_BYTES, measure_process, resident_bytes

    cfg = config.load(None)
    lines = {x.name: x for x in fixed_lines(model_facts(tiny_qn4, cfg), cfg, context=256)}
    measured, source = measure_process()
    assert lines["process outside MLX"].nbytes == measured and "measured in this process" in source
    # The interpreter and mlx-lm alone are tens of MiB, and never more than the whole process.
    assert 20 * 2**20 < measured - RUN_GROWTH_BYTES <= resident_bytes()[0]
    assert "a run adds after start-up" in source
    set_ = config.load(None, overrides={"plan.process_bytes": "123456789"})
    line = next(x for x in fixed_lines(model_facts(tiny_qn4, set_), set_, context=256) if x.name == "process outside MLX")
    assert (line.nbytes, line.source) == (123456789, "plan.process_bytes")
