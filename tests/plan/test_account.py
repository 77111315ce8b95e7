"""The memory account's derived lines against what the tiny model really has."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qnpipe import config
from qnpipe.errors import ConfigError
from qnpipe.model.checkpoint import read_header
from qnpipe.plan.account import KV_STEP, kv_nbytes, model_facts, shape_facts, state_nbytes

DATA = Path(__file__).parent / "data"


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
