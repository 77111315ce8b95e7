"""Prefix snapshots over the ring: each rank keeps its own layers' state under rank 0's keys
(qnpipe.live.parallel.snap), and what a resumed prompt computes is one process's, bit for bit."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
import trio
from mlx_lm.models.cache import ArraysCache, KVCache
from rank_main import run_prefix
from ranks import finish, start

from qnpipe.live.parallel.snap import HEAD, RankStates, SnapWords, decode, encode, layers_tag
from qnpipe.live.prefix import SUFFIX, SnapshotFileWarning, snapshot_path
from qnpipe.model import snapshots
from qnpipe.model.stage import Stage

pytestmark = pytest.mark.slow  # rings of processes, each loading the model

FIRST = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]
SECOND = [*FIRST[:8], 20, 21, 22, 23, 24]  # the same head of 8 tokens
NEW = [30, 31]  # a conversation's next turn: the first prompt, its answer, these
# Streamed through a pool of top-k slots, prefill in chunks of 4, heads of 8 (a multiple of the chunk:
# the prefill of an engine without snapshots); an LRU of 2 states evicts, so the ranks drop states too.
BASE: dict[str, Any] = {"expert_slots": 4, "prefill_chunk_tokens": 4, "max_entries": 2}
HEAD_TOKENS = 8
# MTP speculation on the trained tiny model (its head drafts well): the last rank's state holds its MTP layer's.
MTP: dict[str, Any] = {**BASE, "mtp.enabled": True, "mtp.num_draft_tokens": 3, "snapshot_head_tokens": HEAD_TOKENS}


def _one_process(model: Path) -> dict[str, np.ndarray]:
    """The scenario in one process, without snapshots or MTP (plain greedy)."""
    from qnpipe import open_engine

    async def run() -> dict[str, np.ndarray]:
        saved: dict[str, Any] = {}
        async with open_engine(model, **BASE, snapshot_head_tokens=0) as eng:
            await run_prefix(eng, "one", [FIRST, SECOND, NEW], saved)
        return saved

    return trio.run(run)


@pytest.fixture(scope="module")
def one_process(tiny_qn4: Path) -> dict[str, np.ndarray]:
    return _one_process(tiny_qn4)


@pytest.fixture(scope="module")
def one_process_trained(trained_qn4: Path) -> dict[str, np.ndarray]:
    return _one_process(trained_qn4)


@pytest.fixture(scope="module")
def one_process_sampled(trained_qn4: Path) -> list[int]:
    """Speculative sampling in one process, with MTP and without snapshots, of the prompt the ring's
    MTP engine samples from a resumed state (`run_prefix`)."""
    from qnpipe import open_engine

    async def run() -> list[int]:
        async with open_engine(trained_qn4, **{**MTP, "snapshot_head_tokens": 0}) as eng:
            turn1 = await eng.generate(FIRST, max_tokens=6, stop_at_eos=False)
            res = await eng.generate([*FIRST, *turn1.tokens, *NEW], max_tokens=8, temperature=0.8, seed=3,
                                     stop_at_eos=False)
            return list(res.tokens)

    return trio.run(run)


def _ring(ranks: int, model_dir: Path, tmp: Path, engines: dict[str, dict[str, Any]], lossy_rank: int,
          models: dict[str, str] | None = None) -> Path:
    scenario = {"prompt": FIRST, "tokens": 6, "prefix_prompts": [FIRST, SECOND, NEW],
                "prefix": [name for name in engines if name != "lossy"], "lossy": "lossy", "lossy_rank": lossy_rank,
                "engines": engines, "models": models or {}}
    results = finish(start(ranks, model_dir, tmp, scenario), timeout_s=240)
    for r, (rc, err) in enumerate(results):
        assert rc == 0, f"rank {r} exited {rc}:\n{err[-3000:]}"
        assert "Warning" not in err, f"rank {r}:\n{err[-3000:]}"  # no file ignored, no state not kept
    return tmp


@pytest.fixture(scope="module")
def two_ranks(tiny_qn4: Path, trained_qn4: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two ranks run, each engine in turn: without snapshots, with them (head files in `snaps`), again
    with them (a new engine: its states come from the files), with MTP speculation with and without
    them, and with rank 1 keeping none."""
    tmp = tmp_path_factory.mktemp("snap")
    snap = {**BASE, "snapshot_head_tokens": HEAD_TOKENS, "snapshot_dir": str(tmp / "snaps")}
    return _ring(2, tiny_qn4, tmp, {"plain": {**BASE, "snapshot_head_tokens": 0}, "snap": snap, "again": snap,
                                    "mtp": MTP, "mtp_plain": {**MTP, "snapshot_head_tokens": 0},
                                    "lossy": {**BASE, "snapshot_head_tokens": HEAD_TOKENS}},
                 lossy_rank=1, models={"mtp": str(trained_qn4), "mtp_plain": str(trained_qn4)})


@pytest.fixture(scope="module")
def three_ranks(tiny_qn4: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three ranks: rank 1 passes every message on; then rank 2 keeps no state."""
    snap = {**BASE, "snapshot_head_tokens": HEAD_TOKENS}
    return _ring(3, tiny_qn4, tmp_path_factory.mktemp("snap3"), {"snap": snap, "lossy": snap}, lossy_rank=2)


def test_two_ranks_resume_from_prefix_snapshots_with_one_process_bits(
        two_ranks: Path, one_process: dict[str, np.ndarray], tiny_qn4: Path) -> None:
    got = np.load(two_ranks / "out0.npz")
    for name in ("plain", "snap", "again"):
        for key in ("next0", "next1", "greedy1", "turns"):
            want = one_process[f"one.{key}"]
            assert got[f"{name}.{key}"].dtype == want.dtype and np.array_equal(got[f"{name}.{key}"], want), (name, key)
    assert got["plain.stats"].tolist() == [0] * 5 and got["plain.reused"].tolist() == [0, 0, 0]
    hits, misses, captures, disk_loads, disk_writes = got["snap.stats"].tolist()
    # the second prompt resumes: its head, then its own turn state; the next turn resumes from the
    # last one's (past the head), on every rank
    reused = got["snap.reused"].tolist()
    assert reused[0] == 12 and reused[1] >= HEAD_TOKENS and reused[2] >= len(FIRST) - 1, reused
    assert hits >= 4 and misses == 1 and captures >= 3 and disk_loads == 0 and disk_writes >= 1
    # a new engine: its first prompt resumes from the head files, each rank its own
    hits, misses, captures, disk_loads, disk_writes = got["again.stats"].tolist()
    assert disk_loads >= 1 and misses == 0, got["again.stats"]
    layers = json.loads((tiny_qn4 / "config.json").read_text())["num_hidden_layers"]
    ranges = set()
    for f in (two_ranks / "snaps").iterdir():
        m = re.fullmatch(r"[0-9a-f]{64}\.layers(\d+)-(\d+)" + re.escape(SUFFIX), f.name)
        assert m is not None, f.name
        ranges.add((int(m.group(1)), int(m.group(2))))
    (lo0, hi0), (lo1, hi1) = sorted(ranges)
    assert lo0 == 0 and lo1 == hi0 + 1 and hi1 == layers - 1, ranges


def test_mtp_speculation_resumes_the_last_ranks_mtp_state_too(
        two_ranks: Path, one_process_trained: dict[str, np.ndarray], one_process_sampled: list[int]) -> None:
    got = np.load(two_ranks / "out0.npz")
    # greedy with MTP over the ring, resumed == plain greedy in one process, without snapshots (tokens,
    # as tests/distributed/test_ring.py compares MTP runs)
    for key in ("next0", "next1", "greedy1", "turns"):  # next-token logits bit for bit too
        assert np.array_equal(got[f"mtp.{key}"], one_process_trained[f"one.{key}"]), key
        assert np.array_equal(got[f"mtp_plain.{key}"], one_process_trained[f"one.{key}"]), key
    # the resumed turn's rounds are those of the ring without snapshots: the last rank's MTP layer resumed too
    assert got["mtp.accept_hist"].tolist() == got["mtp_plain.accept_hist"].tolist()
    assert got["mtp_plain.reused"].tolist() == [0, 0, 0]
    # An MTP state at n reads token n: the second prompt (another token after the shared head) and
    # the first one again prefill; the next turn resumes from the first one's turn state.
    assert got["mtp.reused"].tolist() == [0, 0, len(FIRST) - 1]
    hits, misses, captures, _, _ = got["mtp.stats"].tolist()
    assert hits == 1 and misses == 2 and captures >= 4
    # speculative sampling from a resumed state: the sampler reaches the last rank's resumed sequence
    reused, *sampled = got["mtp.sampled"].tolist()
    assert reused > 0 and sampled == one_process_sampled


def test_a_rank_that_lacks_the_state_is_named_and_the_prompt_then_prefilled(
        two_ranks: Path, one_process: dict[str, np.ndarray]) -> None:
    got = np.load(two_ranks / "out0.npz")
    assert "rank 1 does not hold the prefix snapshot of 8 tokens" in str(got["lossy.refused"])
    assert np.array_equal(got["lossy.next1"], one_process["one.next1"])


def test_three_ranks_resume_with_one_process_bits_and_name_the_rank_that_lacks_the_state(
        three_ranks: Path, one_process: dict[str, np.ndarray]) -> None:
    got = np.load(three_ranks / "out0.npz")
    for key in ("next0", "next1", "greedy1", "turns"):
        assert np.array_equal(got[f"snap.{key}"], one_process[f"one.{key}"]), key
    assert got["snap.reused"].tolist() == [12, HEAD_TOKENS, len(FIRST) - 1]
    assert "rank 2 does not hold the prefix snapshot of 8 tokens" in str(got["lossy.refused"])
    assert np.array_equal(got["lossy.next1"], one_process["one.next1"])


def test_snap_words_round_trip() -> None:
    key = snapshots.token_key([5, 6, 7])
    for w in (SnapWords(key), SnapWords(key, HEAD, 3)):
        words = encode(w)
        assert words.dtype == np.uint32 and decode(words) == w
    with pytest.raises(ValueError, match="sha256"):
        encode(SnapWords("abc"))


def _cache(n: int) -> list[Any]:
    """A rank's cache after `n` tokens: a layer of another rank, a linear-attention layer, an attention layer."""
    kv = KVCache()
    kv.update_and_fetch(mx.arange(2 * n * 4, dtype=mx.float32).reshape(1, 2, n, 4),
                        mx.ones((1, 2, n, 4), dtype=mx.float32))
    lin = ArraysCache(size=2)
    lin.cache = [mx.full((1, 3), float(n)), mx.zeros((1, 2, 2))]
    return [None, lin, kv]


def test_a_rank_keeps_restores_and_writes_its_own_layers(tmp_path: Path) -> None:
    from qnpipe.config import Config, with_overrides

    cfg = with_overrides(Config(), {"prefix.snapshot_dir": str(tmp_path)})
    tag = layers_tag(Stage(1, 2, 4, 8))
    assert tag == "layers4-7"
    states = RankStates(cfg.prefix, lambda: "fp", tag, rank=1)
    key = snapshots.token_key(list(range(6)))
    states.capture(_cache(6), key, 6, head=True)
    assert snapshot_path(tmp_path, key, tag).name == f"{key}.layers4-7{SUFFIX}"
    assert [p.name for p in tmp_path.iterdir()] == [f"{key}.layers4-7{SUFFIX}"]
    snap = states.find(key, 6, disk=False)
    assert snap is not None
    back = snapshots.restore(snap)
    assert back[0] is None and back[2].offset == 6
    assert mx.array_equal(back[2].keys, _cache(6)[2].keys[..., :6, :])
    assert states.find(key, 5, disk=False) is None  # another length: never a wrong state
    states.drop(key)
    assert states.find(key, 6, disk=False) is None
    assert states.find(key, 6, disk=True) is not None  # its own head file
    other = RankStates(cfg.prefix, lambda: "fp", "layers0-3", rank=1)  # another split: another file
    assert other.find(key, 6, disk=True) is None
    with pytest.warns(SnapshotFileWarning, match="holds \\[5\\] tokens, not 6"):  # a sequence elsewhere: kept nothing
        states.capture(_cache(5), key, 6, head=False)
    assert key not in states.states
