"""End to end on the generic tier: a tiny random model of each first family, saved as an mlx-lm directory,
`qnpipe convert`ed and run with a small pool, gives mlx-lm's `generate_step` greedy tokens and mlx-lm's
logits bit for bit; all resident (the mlx-lm directory itself, `pool.eager_load`) too; each streamed run's
event log replayed gives its hit counts. The first family also goes through the CLI: `generate --json --trace`, then `replay` of the log gives the live hit counts.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import load as mlx_lm_load
from mlx_lm.utils import save_config, save_model

import qnpipe
from qnpipe import config as qconfig
from qnpipe.cli import main
from qnpipe.convert import convert
from qnpipe.convert.tiny import TOKENIZER_DIR
from qnpipe.errors import CheckpointError, ConfigError
from qnpipe.model.family import tiny
from qnpipe.replay import replay

# The order; the quantization each runs in (gpt-oss in its own mxfp4).
FAMILIES = [("qwen3_moe", "affine4"), ("gpt_oss", "mxfp4"), ("glm4_moe", "affine4"), ("qwen3_5_moe", None),
            ("deepseek_v3", None), ("minimax", "affine4"), ("llama4", None), ("mixtral", None)]
VOCAB = 1024  # the committed tokenizer's ids
N_NEW = 6
CHUNK = 7  # prefill chunk: the prompt of 20 tokens in three calls


def save_mlx_lm_dir(d: Path, family: str, quant: str | None, seed: int = 1234) -> dict[str, Any]:
    """A tiny random `family` model saved as mlx-lm saves one, with the committed tokenizer; its config."""
    cfg = tiny.tiny_config(family)
    (cfg["text_config"] if "text_config" in cfg else cfg)["vocab_size"] = VOCAB
    model = tiny.build_random(cfg, quant, seed=seed)
    d.mkdir(parents=True)
    save_model(d, model)
    if quant is not None:
        cfg["quantization"] = dict(tiny.QUANTS[quant])
    save_config(cfg, d / "config.json")
    for f in TOKENIZER_DIR.iterdir():
        shutil.copyfile(f, d / f.name)
    return cfg


def prompt(n: int = 20, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, VOCAB - 1, n)]


def reference(d: Path, tokens: list[int]) -> tuple[dict[int, np.ndarray], list[int]]:
    """mlx-lm's logits of `tokens` prefilled whole and in chunks of `CHUNK` on its own cache (chunked and
    rotating caches attend by chunk), and its greedy continuation (`generate_step`)."""
    from mlx_lm.models.cache import make_prompt_cache

    ref = mlx_lm_load(str(d))[0]
    logits = {}
    for chunk in (0, CHUNK):
        cache = make_prompt_cache(ref)
        step = chunk or len(tokens)
        outs = [ref(mx.array(tokens[i:i + step])[None], cache=cache)[0] for i in range(0, len(tokens), step)]
        logits[chunk] = np.array(mx.concatenate(outs, axis=0).astype(mx.float32))
    greedy = [int(t) for t, _ in generate_step(mx.array(tokens), ref, max_tokens=N_NEW)]
    return logits, greedy


def run(d: Path, tokens: list[int], chunk: int = 0, **cfg: Any) -> tuple[np.ndarray, list[int], Any]:
    with qnpipe.Engine(d, prefill_chunk_tokens=chunk, **cfg) as eng:
        logits = eng.logits(tokens)
        greedy = list(eng.generate(tokens, max_tokens=N_NEW, stop_at_eos=False).tokens)
        return logits, greedy, eng.stats()


@pytest.mark.parametrize("family, quant", FAMILIES, ids=[f for f, _ in FAMILIES])
def test_family_end_to_end_equals_mlx_lm(tmp_path: Path, family: str, quant: str | None) -> None:
    src = tmp_path / "src"
    cfg = save_mlx_lm_dir(src, family, quant)
    toks = prompt()
    want_logits, want_greedy = reference(src, toks)
    # All resident from the mlx-lm directory: mlx-lm's own switches.
    got, greedy, stats = run(src, toks)
    assert stats.expert_source == "resident"
    assert np.array_equal(got, want_logits[0]) and greedy == want_greedy
    out = tmp_path / "qn"
    convert(src, out)
    k = tiny.top_k(cfg)
    # Streamed through a pool of top-k + 1 slots, the prompt in chunks of 7 and whole.
    log = tmp_path / "run.qtrace"
    live: Any = None
    for chunk in (CHUNK, 0):
        traced = {"trace.event_log_path": str(log)} if chunk == CHUNK else {}
        got, greedy, stats = run(out, toks, chunk, expert_slots=k + 1,
                                 **{"diag.route_verify": True, "read.verify_crc32": True}, **traced)
        assert stats.expert_source == "pool"
        assert np.array_equal(got, want_logits[chunk]), (family, chunk)
        assert greedy == want_greedy, (family, chunk)
        assert stats.pool is not None and stats.pool.misses > 0
        live = live if chunk != CHUNK else stats.pool
    # The event log of the first run replayed: the live run's hits, layer by layer, and its misses by cause.
    r = replay(log, qconfig.load(None, overrides={"pool.expert_slots": str(k + 1)}))
    assert r.steps == live.steps
    assert [x.hits for x in r.layers] == [x.hits for x in live.layers], family
    assert r.misses_by_cause == live.misses_by_cause, family
    # All resident from the store.
    got, greedy, stats = run(out, toks, eager_load=True)
    assert np.array_equal(got, want_logits[0]) and greedy == want_greedy


def test_cli_generate_trace_and_replay_give_the_live_hits(tmp_path: Path) -> None:
    src = tmp_path / "src"
    cfg = save_mlx_lm_dir(src, "qwen3_moe", "affine4")
    toks = prompt(12)
    want_greedy = reference(src, toks)[1]
    convert(src, tmp_path / "qn")
    slots = str(tiny.top_k(cfg) + 1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["generate", str(tmp_path / "qn"), "--tokens", ",".join(map(str, toks)), "-n", str(N_NEW),
                     "--json", "--set", f"pool.expert_slots={slots}", "--trace", str(tmp_path / "run.qtrace")]) == 0
    live = json.loads(out.getvalue())
    got = list(live["tokens"])  # the CLI stops at EOS: a prefix of mlx-lm's
    assert got and got == want_greedy[:len(got)]
    pool = live["engine"]["pool"]
    r = replay(tmp_path / "run.qtrace", qconfig.load(None, overrides={"pool.expert_slots": slots}))
    assert r.steps == pool["steps"]
    assert [x.hits for x in r.layers] == [x["hits"] for x in pool["layers"]]
    assert sum(x.hits for x in r.layers) == pool["hits"] and r.misses_by_cause == pool["misses_by_cause"]


@pytest.mark.parametrize("setting, value, named", [
    ("mtp.enabled", True, "mtp.enabled"), ("kv.quantize", True, "kv.quantize"),
    ("forward.moe_topk_override", 2, "forward.moe_topk_override")])
def test_a_native_only_setting_on_another_family_is_a_config_error(tmp_path: Path, setting: str, value: Any,
                                                                   named: str) -> None:
    save_mlx_lm_dir(tmp_path / "src", "mixtral", None)
    with pytest.raises(ConfigError, match=rf"a mixtral model on the generic tier: {named}"):
        qnpipe.Engine(tmp_path / "src", **{setting: value})


def test_unknown_and_dense_model_types_are_named(tmp_path: Path) -> None:
    d = tmp_path / "src"
    save_mlx_lm_dir(d, "mixtral", None)
    c = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**c, "model_type": "nosuch_moe"}))
    with pytest.raises(CheckpointError, match=r"model_type 'nosuch_moe' is not a model mlx-lm"):
        qnpipe.Engine(d)
    (d / "config.json").write_text(json.dumps({**c, "model_type": "mistral"}))
    with pytest.raises(CheckpointError, match=r"a mistral model has no routed experts"):
        qnpipe.Engine(d)


@pytest.mark.parametrize("family, quant", [("deepseek_v3", None), ("llama4", None)])
def test_prefetch_from_the_family_router_or_none_said_once(tmp_path: Path, family: str, quant: str | None) -> None:
    """deepseek_v3's MoEGate predicts the next layers and the logits stay mlx-lm's; llama4 has no
    usable router input: one warning naming the family, and the run is demand reads only."""
    src = tmp_path / "src"
    cfg = save_mlx_lm_dir(src, family, quant)
    toks = prompt()
    want_logits, want_greedy = reference(src, toks)
    convert(src, tmp_path / "qn")
    settings = {"predict.cross_layer_prefetch": True, "predict.ahead_layers": 1, "pool.side_region_slots": 4}
    warns = pytest.warns(UserWarning, match=rf"no predictions for a {family} model")
    with warns if family == "llama4" else contextlib.nullcontext():
        got, greedy, stats = run(tmp_path / "qn", toks, expert_slots=tiny.top_k(cfg) + 1, **settings)
    assert np.array_equal(got, want_logits[0]) and greedy == want_greedy
    assert stats.pool is not None
    assert (stats.pool.prefetch_issued > 0) == (family != "llama4")


@pytest.mark.parametrize("family", ["gpt_oss", "llama4", "qwen3_5_moe", "deepseek_v3"])
def test_prefix_snapshots_resume_every_cache_kind(tmp_path: Path, family: str) -> None:
    """Rotating (gpt_oss), chunked (llama4), arrays + KV (qwen3_5_moe), MLA KV (deepseek_v3): a second turn
    resumes the first's state and decodes what a fresh prefill of the whole prompt decodes."""
    src = tmp_path / "src"
    save_mlx_lm_dir(src, family, None)
    toks = prompt(40)
    turn2 = [*toks, 5, 6]
    # Chunks of 2 (scaled down with the 16-token head): the turn state lands within 2 tokens of the end.
    with qnpipe.Engine(src, snapshot_head_tokens=0, prefill_chunk_tokens=2) as eng:
        want = list(eng.generate(turn2, max_tokens=N_NEW, stop_at_eos=False).tokens)
    with qnpipe.Engine(src, snapshot_head_tokens=16, prefill_chunk_tokens=2) as eng:
        eng.generate(toks, max_tokens=N_NEW, stop_at_eos=False)
        got = eng.generate(turn2, max_tokens=N_NEW, stop_at_eos=False)
    assert got.stats.prefix_tokens_reused >= len(toks) - 2
    assert list(got.tokens) == want


def test_distributed_ranks_on_another_family_is_a_config_error(tmp_path: Path) -> None:
    """A rank of a pipeline-parallel run (qnpipe.live.parallel loads each rank's Stage) is refused on the
    generic tier, naming the setting and the family, before the model is built."""
    from qnpipe.live.loaded import load_model
    from qnpipe.model.stage import Stage

    save_mlx_lm_dir(tmp_path / "src", "mixtral", None)
    with pytest.raises(ConfigError, match=r"a mixtral model on the generic tier: distributed ranks \(2\)"):
        load_model(tmp_path / "src", qconfig.load(None), stage=Stage(rank=0, size=2, lo=0, hi=1))
