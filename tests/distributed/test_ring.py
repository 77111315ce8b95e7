"""Pipeline parallel over mx.distributed's ring backend on localhost: the test starts the ranks itself
(`ranks.py`: MLX_RANK, MLX_HOSTFILE on free ports, as mlx.launch would) and bounds every wait."""

from __future__ import annotations

import contextlib
import select
import signal
import time
from pathlib import Path

import attrs
import numpy as np
import pytest
import trio
from ranks import finish as _finish
from ranks import start as _start

from qnpipe.replay.runner import load_log
from qnpipe.trace import read
from qnpipe.trace.format import RunPart
from qnpipe.trace.merge import merge

pytestmark = pytest.mark.slow  # rings of processes, each loading the model

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]
# A pool of top-k slots per layer (the tiny model's top-k is 4) and prefill in chunks: every path streams.
# The last one streams: the killed-rank test kills a rank while it generates with it.
# The streamed engine records its routes (in the working directory: each rank names its own file).
ENGINES = {"resident": {"eager_load": True, "prefill_chunk_tokens": 0},
           "stream": {"expert_slots": 4, "prefill_chunk_tokens": 5,
                      "trace.route_trace": True, "trace.route_trace_path": "routes.qtrace"}}
# MTP speculation runs on the trained tiny model (its head drafts well: rounds accept 0..K drafts),
# resident at a fixed depth and streamed through a top-k pool at an adaptive depth (rounds draft 1..3);
# the streamed one is last (the killed-rank test).
MTP = {"mtp.enabled": True, "mtp.num_draft_tokens": 3}
MTP_ENGINES = {"mtp_resident": {**MTP, "eager_load": True, "prefill_chunk_tokens": 0},
               "mtp_stream": {**MTP, "expert_slots": 4, "prefill_chunk_tokens": 5, "mtp.adaptive_depth": True,
                              "mtp.depth_max": 3, "mtp.conf_tau": 0.5}}
MTP_PROMPT = "def read_lines(path):\n    "
MTP_TOKENS = 40
SAMPLED_TOKENS = 16  # speculative sampling at temperature 0.8, seed 3


def _scenario(trained_qn4: Path) -> dict:
    return {"prompt": PROMPT, "tokens": 6, "engines": {**ENGINES, **MTP_ENGINES}, "mtp_prompt": MTP_PROMPT,
            "mtp_tokens": MTP_TOKENS, "sampled_tokens": SAMPLED_TOKENS, "models": {name: str(trained_qn4) for name in MTP_ENGINES}}


@pytest.fixture(scope="module")
def one_process_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where one process runs ENGINES (its routing log is written there)."""
    return tmp_path_factory.mktemp("one")


@pytest.fixture(scope="module")
def one_process(tiny_qn4: Path, one_process_dir: Path) -> dict[str, np.ndarray]:
    """What one process makes of ENGINES."""
    from qnpipe import open_engine

    async def run() -> dict[str, np.ndarray]:
        saved = {}
        for name, over in ENGINES.items():
            async with open_engine(tiny_qn4, **over) as eng:
                saved[f"{name}.logits"] = await eng.logits(PROMPT)
                saved[f"{name}.next"] = await eng.next_logits(PROMPT)
                res = await eng.generate(PROMPT, max_tokens=6, stop_at_eos=False)
                saved[f"{name}.greedy"] = np.array(res.tokens)
                res = await eng.generate(PROMPT, max_tokens=6, temperature=0.8, seed=3, stop_at_eos=False)
                saved[f"{name}.sampled"] = np.array(res.tokens)
        return saved

    with contextlib.chdir(one_process_dir):
        return trio.run(run)


@pytest.fixture(scope="module")
def one_process_mtp(trained_qn4: Path) -> dict[str, np.ndarray]:
    """Tokens of one process for each MTP engine: greedy without MTP (`.plain`) and with it (`.spec`), and
    speculative sampling at a seed (`.sampled`)."""
    from qnpipe import open_engine

    async def run() -> dict[str, np.ndarray]:
        saved = {}
        for name, over in MTP_ENGINES.items():
            for key, mtp in (("plain", False), ("spec", True)):
                async with open_engine(trained_qn4, **{**over, "mtp.enabled": mtp}) as eng:
                    res = await eng.generate(MTP_PROMPT, max_tokens=MTP_TOKENS, stop_at_eos=False)
                    saved[f"{name}.{key}"] = np.array(res.tokens)
            async with open_engine(trained_qn4, **over) as eng:
                res = await eng.generate(MTP_PROMPT, max_tokens=SAMPLED_TOKENS, temperature=0.8, seed=3,
                                         stop_at_eos=False)
                saved[f"{name}.sampled"] = np.array(res.tokens)
        return saved

    return trio.run(run)


def _check_bits(tmp: Path, results: list[tuple[int, str]], one_process: dict[str, np.ndarray],
                one_process_mtp: dict[str, np.ndarray]) -> None:
    got = np.load(tmp / "out0.npz")
    mtp_keys = [f"{name}.{key}" for name in MTP_ENGINES
                for key in ("greedy", "accept_hist", "drafted_at", "sampled", "cancelled_after")]
    assert sorted(got.files) == sorted([*one_process, *mtp_keys])
    for key, want in one_process.items():
        assert got[key].dtype == want.dtype and np.array_equal(got[key], want), key
    for name in MTP_ENGINES:
        # a generation cancelled part way (rank 0 stops; the others were left mid-sequence) ...
        assert 5 <= int(got[f"{name}.cancelled_after"]) < MTP_TOKENS
        # ... then greedy with MTP over the ring == greedy without MTP in one process == with MTP in one process
        tokens = got[f"{name}.greedy"].tolist()
        assert len(tokens) == MTP_TOKENS
        assert tokens == one_process_mtp[f"{name}.plain"].tolist() == one_process_mtp[f"{name}.spec"].tolist(), name
        # rank 0's stats have the last rank's rounds: some rejected drafts (a rollback on every rank to
        # a row inside the verify step), some accepted, fewer rounds than tokens
        hist = got[f"{name}.accept_hist"].tolist()
        drafted = got[f"{name}.drafted_at"].tolist()  # rounds that drafted at each depth
        adaptive = MTP_ENGINES[name].get("mtp.adaptive_depth", False)
        assert (drafted[0] > drafted[-1] > 0) if adaptive else (drafted[0] == drafted[-1] == sum(hist)), drafted
        assert len(hist) == MTP["mtp.num_draft_tokens"] + 1 and sum(hist[:-1]) > 0 and sum(hist[1:]) > 0, hist
        assert sum(hist) < MTP_TOKENS, hist
        # speculative sampling: the last rank draws and judges with the seeded generator in one process's order
        sampled = got[f"{name}.sampled"].tolist()
        assert len(sampled) == SAMPLED_TOKENS and sampled == one_process_mtp[f"{name}.sampled"].tolist(), name
        assert sampled[:8] != tokens[:8], "sampled as greedy"
    assert not (tmp / "out1.npz").exists(), "only rank 0 writes"


def test_two_ranks_give_one_process_bits_streamed_and_resident(tiny_qn4: Path, trained_qn4: Path, tmp_path: Path,
                                                                one_process_dir: Path,
                                                                one_process: dict[str, np.ndarray],
                                                                one_process_mtp: dict[str, np.ndarray]) -> None:
    results = _finish(_start(2, tiny_qn4, tmp_path, _scenario(trained_qn4)), timeout_s=300)
    for r, (rc, err) in enumerate(results):
        assert rc == 0, f"rank {r} exited {rc}:\n{err[-3000:]}"
    _check_bits(tmp_path, results, one_process, one_process_mtp)
    # each rank's log names the run (one id, rank 0's) and the rank's layers, so merge can tell one run's logs
    r0, r1 = (read(tmp_path / f"routes.rank{r}.qtrace")[0].run for r in (0, 1))
    assert isinstance(r0, RunPart) and isinstance(r1, RunPart) and r0.id == r1.id
    assert (r0.rank, r0.ranks, r1.rank, r1.ranks) == (0, 2, 1, 2) and r0.lo == 0 and r0.hi == r1.lo
    # the ranks' routing logs, merged, are the one process's
    merge([tmp_path / "routes.rank0.qtrace", tmp_path / "routes.rank1.qtrace"], tmp_path / "routes.qtrace")
    assert load_log(tmp_path / "routes.qtrace").steps == load_log(one_process_dir / "routes.qtrace").steps


@attrs.frozen
class KilledRun:
    tmp: Path
    first: str  # rank 0's first line: "generating" once its results are saved
    stop_s: float  # from the kill until ranks 0 and 2 had exited
    after: list[tuple[int, str]]  # (exit code, stderr) of ranks 0 and 2


@pytest.fixture(scope="module")
def three_ranks_then_one_killed(tiny_qn4: Path, trained_qn4: Path, tmp_path_factory: pytest.TempPathFactory) -> KilledRun:
    """Three ranks run the scenario (rank 0 saves it), then rank 0 generates on, with MTP speculation
    streamed, until rank 1 is killed.

    One set of processes for both tests below: each rank's start-up (imports) costs seconds."""
    tmp = tmp_path_factory.mktemp("three")
    procs = _start(3, tiny_qn4, tmp, {**_scenario(trained_qn4), "loop": True})
    try:
        assert procs[0].stdout is not None
        # Until rank 0 generates (or exits: then ""), bounded: a hung ring must fail the test, not hang it.
        ready, _, _ = select.select([procs[0].stdout], [], [], 300)
        first = procs[0].stdout.readline() if ready else ""
        if first.strip() != "generating":
            return KilledRun(tmp, first, 0.0, _finish(procs, timeout_s=10))
        procs[1].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        after = _finish([procs[0], procs[2]], timeout_s=10)
        return KilledRun(tmp, first, time.monotonic() - t0, after)
    finally:
        _finish(procs, timeout_s=1)


def test_three_ranks_give_one_process_bits_streamed_and_resident(
        three_ranks_then_one_killed: KilledRun, one_process: dict[str, np.ndarray],
        one_process_mtp: dict[str, np.ndarray]) -> None:
    run = three_ranks_then_one_killed
    assert run.first.strip() == "generating", run.after
    _check_bits(run.tmp, run.after, one_process, one_process_mtp)


def test_a_killed_rank_stops_the_others_naming_it(three_ranks_then_one_killed: KilledRun) -> None:
    run = three_ranks_then_one_killed
    assert run.first.strip() == "generating", run.after
    assert run.stop_s < 10
    (rc0, err0), (rc2, err2) = run.after
    assert rc0 != 0 and "rank 1 was lost" in err0, err0[-3000:]
    assert rc2 != 0 and "rank 1 was lost" in err2, err2[-3000:]


def test_a_rank_that_never_starts_is_named_within_the_connect_timeout(tiny_qn4: Path, tmp_path: Path) -> None:
    # timeout_s is the hang guard: past it the rank is killed and TimeoutExpired fails the test
    [(rc, err)] = _finish(_start(2, tiny_qn4, tmp_path, {"prompt": PROMPT, "tokens": 6, "engines": ENGINES}, only=[0],
                                 env={"QNPIPE_DISTRIBUTED__CONNECT_TIMEOUT_S": "1.5"}), timeout_s=30)
    assert rc != 0 and "rank 1" in err and "did not connect within 1.5 s" in err, err[-3000:]
