"""The embedded API: sync Engine and trio-native open_engine on one MLX thread."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import qnpipe
from qnpipe.errors import QnpipeError
from qnpipe.model.runner import Runner
from qnpipe.stats import FinishReason

PROMPT = [5, 17, 300, 42, 9, 77]


@pytest.fixture(scope="module")
def eng(tiny_hf: Path):
    with qnpipe.Engine(tiny_hf) as e:
        yield e


async def test_open_engine_matches_sync_engine_and_streams_in_order(tiny_hf: Path, eng: qnpipe.Engine) -> None:
    want = eng.generate(PROMPT, max_tokens=10, stop_at_eos=False)
    pieces: list[str] = []
    callers: set[int] = set()

    def on_text(s: str) -> None:
        callers.add(threading.get_ident())
        pieces.append(s)

    prefill: list[tuple[int, int, int]] = []
    async with qnpipe.open_engine(tiny_hf) as aeng:
        got = await aeng.generate(PROMPT, max_tokens=10, stop_at_eos=False, on_text=on_text,
                                  on_prefill=lambda d, t: prefill.append((d, t, threading.get_ident())))
        logits = await aeng.logits(PROMPT)
        assert aeng.stats().requests == 1
    assert got.tokens == want.tokens
    assert "".join(pieces) == got.text
    assert callers == {threading.get_ident()}  # on_text ran in the trio thread
    assert [(d, t) for d, t, _ in prefill][-1] == (len(PROMPT), len(PROMPT))
    assert {i for _, _, i in prefill} == {threading.get_ident()}
    assert np.array_equal(logits, eng.logits(PROMPT))


@pytest.fixture
def mlx_threads(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """The names of the threads every model step of the test runs on (MlxBackend.begin)."""
    from qnpipe.model.stepper import MlxBackend

    names: set[str] = set()
    begin = MlxBackend.begin

    def spy(self, *a):  # type: ignore[no-untyped-def]
        names.add(threading.current_thread().name)
        return begin(self, *a)

    monkeypatch.setattr(MlxBackend, "begin", spy)
    return names


def test_mlx_work_runs_on_one_dedicated_thread(eng: qnpipe.Engine, mlx_threads: set[str]) -> None:
    seen: set[str] = set()
    eng.generate(PROMPT, max_tokens=3, on_text=lambda s: seen.add(threading.current_thread().name))
    eng.generate(PROMPT, max_tokens=3, on_text=lambda s: seen.add(threading.current_thread().name))
    assert mlx_threads == {"qnpipe-mlx"}  # every step of both calls
    assert seen == {"qnpipe-mlx"}  # callbacks run in the engine's trio loop: the MLX thread's


def test_two_engines_share_the_mlx_threads_loop_and_both_stay_exact(
        eng: qnpipe.Engine, tiny_hf: Path, mlx_threads: set[str]) -> None:
    want = eng.generate(PROMPT, max_tokens=6, stop_at_eos=False).tokens
    with qnpipe.Engine(tiny_hf) as other:
        seen: set[str] = set()
        got = other.generate(PROMPT, max_tokens=6, stop_at_eos=False,
                             on_text=lambda s: seen.add(threading.current_thread().name))
        assert got.tokens == want and seen == {"qnpipe-mlx"}
        assert eng.generate(PROMPT, max_tokens=6, stop_at_eos=False).tokens == want
        assert eng.stats().requests > 0 and other.stats().requests == 1  # each its own pipeline
    assert mlx_threads == {"qnpipe-mlx"}


def test_with_prefetch_on_the_engine_loop_has_a_thread_of_its_own(eng: qnpipe.Engine, tiny_hf: Path) -> None:
    want = eng.generate(PROMPT, max_tokens=6, stop_at_eos=False).tokens
    prefetch: dict[str, Any] = {"predict.cross_layer_prefetch": True}
    with qnpipe.Engine(tiny_hf, **prefetch) as other:
        seen: set[str] = set()
        got = other.generate(PROMPT, max_tokens=6, stop_at_eos=False,
                             on_text=lambda s: seen.add(threading.current_thread().name))
    assert got.tokens == want and seen == {"qnpipe-engine"}


def test_seeded_sampling_is_reproducible(eng: qnpipe.Engine) -> None:
    a = eng.generate(PROMPT, max_tokens=12, temperature=1.0, top_p=0.9, seed=11, stop_at_eos=False)
    b = eng.generate(PROMPT, max_tokens=12, temperature=1.0, top_p=0.9, seed=11, stop_at_eos=False)
    c = eng.generate(PROMPT, max_tokens=12, temperature=1.0, top_p=0.9, seed=12, stop_at_eos=False)
    greedy = eng.generate(PROMPT, max_tokens=12, stop_at_eos=False)
    assert a.tokens == b.tokens
    # Both differences must show: another seed samples otherwise, and sampling is not greedy.
    assert a.tokens != c.tokens
    assert a.tokens != greedy.tokens


def test_stops_at_eos_and_excludes_it(eng: qnpipe.Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    free = eng.generate(PROMPT, max_tokens=10, stop_at_eos=False).tokens
    stop = free[3]
    monkeypatch.setattr(Runner, "eos_ids", property(lambda self: {stop}))
    res = eng.generate(PROMPT, max_tokens=10)
    assert res.tokens == free[: free.index(stop)]
    assert res.stats.finish_reason is FinishReason.EOS
    assert res.stats.generated_tokens == len(res.tokens) + 1


def test_max_tokens_and_stats(eng: qnpipe.Engine) -> None:
    before = eng.stats()
    res = eng.generate(PROMPT, max_tokens=7, stop_at_eos=False)
    assert len(res.tokens) == 7 and res.stats.finish_reason is FinishReason.LENGTH
    assert res.stats.prompt_tokens == len(PROMPT)
    assert res.stats.decode_tok_s > 0 and res.stats.peak_memory_bytes > 0
    after = eng.stats()
    assert after.requests == before.requests + 1
    assert after.generated_tokens == before.generated_tokens + 7
    assert after.resident_expert_bytes > 0
    assert eng.generate(PROMPT, max_tokens=0).tokens == ()


@pytest.mark.parametrize(
    "kw, msg",
    [({"max_tokens": -1}, "max_tokens"), ({"temperature": -0.5}, "temperature"), ({"top_p": 0.0}, "top_p"),
     ({"top_p": 1.5}, "top_p")],
)
def test_bad_generation_arguments(eng: qnpipe.Engine, kw: dict, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        eng.generate(PROMPT, **kw)


def test_bad_prompts(eng: qnpipe.Engine) -> None:
    with pytest.raises(ValueError, match="empty prompt"):
        eng.logits([])
    with pytest.raises(ValueError, match="token id 5000 out of range for vocabulary size 1024"):
        eng.generate([1, 5000])


def test_text_prompt_uses_the_tokenizer(eng: qnpipe.Engine) -> None:
    ids = eng.encode("def f(x):\n    return x")
    assert np.array_equal(eng.logits("def f(x):\n    return x"), eng.logits(ids))


def test_model_dir_from_config(tiny_hf: Path) -> None:
    cfg = qnpipe.config.load(env={"MODEL": str(tiny_hf)})
    with qnpipe.Engine(cfg=cfg) as e:
        assert e.model_dir == tiny_hf
        assert e.cfg.model.model_dir == str(tiny_hf)


@pytest.mark.slow
def test_process_exits_cleanly_after_engine_use(tiny_hf: Path) -> None:
    # A thread that ran MLX's CPU attention and then ended used to abort the process at exit.
    import subprocess
    import sys

    code = ("import sys, qnpipe\n"
            "with qnpipe.Engine(sys.argv[1]) as e:\n"
            "    e.generate([5, 6, 7], max_tokens=3)\n"
            "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code, str(tiny_hf)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok" and "terminate called" not in r.stderr


def test_closed_engine_refuses_work_but_keeps_stats(tiny_hf: Path) -> None:
    e = qnpipe.Engine(tiny_hf)
    e.generate(PROMPT, max_tokens=2)
    e.close()
    assert e.stats().requests == 1
    with pytest.raises(RuntimeError, match="closed"):
        e.generate(PROMPT, max_tokens=2)


def test_prefill_progress_reports_each_chunk(tiny_hf: Path) -> None:
    seen: list[tuple[int, int]] = []
    with qnpipe.Engine(tiny_hf, prefill_chunk_tokens=4) as e:
        e.generate(list(range(3, 13)), max_tokens=2, on_prefill=lambda d, t: seen.append((d, t)))
    assert seen == [(4, 10), (8, 10), (10, 10)]


def test_the_built_in_models_name_opens_it_as_the_cli_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from qnpipe.builtin_models import DEMO_MODEL_DIR

    monkeypatch.chdir(tmp_path)  # no ./tiny here: the name means the built-in model
    with qnpipe.Engine("tiny") as e:
        assert e.model_dir == DEMO_MODEL_DIR
    (tmp_path / "tiny").mkdir()  # a path that exists wins, as on the command line
    with pytest.raises(QnpipeError, match="tiny"):
        qnpipe.Engine("tiny")
