"""Prefix snapshots with MTP speculation: a resumed prompt leaves both models' caches bit for bit as a
prefill from the start, and generates plain greedy's tokens (issues 12 and 13)."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
import trio

import qnpipe
from qnpipe.actors.forward import Forward
from qnpipe.config import PrefixCfg
from qnpipe.live.loaded import ThreadedBackend
from qnpipe.live.mlx_thread import run_on
from qnpipe.live.mtp import loop
from qnpipe.live.prefix import PrefixCache, SnapshotFileWarning
from qnpipe.model.snapshots import capture
from qnpipe.model.stepper import MlxBackend

HEAD = 16
CHUNK = 2  # scaled down with HEAD: the turn state lands within 2 tokens of a prompt's end (tests/live/test_prefix.py)


@pytest.fixture(scope="module", autouse=True)
def _chunk() -> Iterator[None]:
    """Every engine of this module prefills in chunks of `CHUNK` unless a test says otherwise."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QNPIPE_FORWARD__PREFILL_CHUNK_TOKENS", str(CHUNK))
        yield
SYSTEM = "import os\nimport sys\n\n\ndef main(argv):\n    \"\"\"Entry point.\"\"\"\n"
TAILS = ["    return len(argv)\n\n\nif __name__ == '__main__':", "    for a in argv:\n        print(a)\n"]
MTP = {"mtp": True, "mtp.num_draft_tokens": 3, "mtp.hidden": "post_norm"}
STREAM = {"pool.expert_slots": 4, "predict.cross_layer_prefetch": True}


@pytest.fixture(scope="module")
def prompts(trained_hf: Path) -> list[list[int]]:
    from qnpipe.chat.tokenizer import encode, load_tokenizer

    tok = load_tokenizer(trained_hf)
    out = [encode(tok, SYSTEM + t) for t in TAILS]
    # They share HEAD + 1 tokens (the MTP's row HEAD - 1 reads token HEAD), and differ after 19.
    assert out[0][:19] == out[1][:19] and out[0][19] != out[1][19] and len(out[1]) > HEAD + 8
    return out


def _state(st: loop.SpecState, n: int) -> list[np.ndarray]:
    """Every cache's arrays (main layers, the MTP layer), the MTP's last row's logits and feed."""
    snap = capture(st.caches.all, n)
    assert st.logits is not None and st.feed is not None
    return [np.array(a) for s in snap.layers for a in s.arrays] + [np.array(st.logits), np.array(st.feed)]


def test_resumed_prefill_leaves_both_models_bit_identical(trained_mtp: Any, prompts: list[list[int]]) -> None:
    lm, head, th = trained_mtp
    fwd = Forward(ThreadedBackend(th, MlxBackend(lm.model, None)), None, None, {}, lm.args.num_experts)
    opts = loop.SpecOptions(k=3, hidden=loop.MtpHidden.POST_NORM)

    async def prefill(tokens: list[int], prefix: PrefixCache | None) -> tuple[int, list[np.ndarray], int]:
        st = await run_on(th, loop.SpecState, lm.model, head, opts)
        plan = await prefix.plan(th, tokens, 2) if prefix is not None else None
        x = await loop.prefill(fwd, th, st, tokens, 2, prefix=prefix, plan=plan)
        return x, await run_on(th, _state, st, len(tokens)), plan.start if plan is not None else 0

    async def main() -> None:
        fresh = [await prefill(p, None) for p in prompts]
        pc = PrefixCache(PrefixCfg(snapshot_head_tokens=HEAD), lambda: "test", lookahead=True)
        first = await prefill(prompts[0], pc)  # head and turn captured
        again = await prefill(prompts[0], pc)  # from its turn state
        other = await prefill(prompts[1], pc)  # from the shared head
        assert (first[2], again[2], other[2]) == (0, len(prompts[0]) - 1, HEAD)
        for (x, arrays, _), (y, want, _) in zip([first, again, other], [fresh[0], fresh[0], fresh[1]],
                                                strict=True):
            assert x == y and len(arrays) == len(want)
            assert all(np.array_equal(a, b) for a, b in zip(arrays, want, strict=True))
        # A head of 19 shared tokens whose token 19 differs: the MTP row 18 differs, so no resume.
        pc19 = PrefixCache(PrefixCfg(snapshot_head_tokens=19), lambda: "test", lookahead=True)
        await prefill(prompts[0], pc19)
        x, arrays, start = await prefill(prompts[1], pc19)
        assert start == 0 and x == fresh[1][0]
        assert all(np.array_equal(a, b) for a, b in zip(arrays, fresh[1][1], strict=True))

    trio.run(main)
    mx.clear_cache()


def _run(model: Path, prompts: list[list[int]], **over: Any) -> tuple[list[tuple[int, ...]], list[Any], Any]:
    with qnpipe.Engine(model, **over) as eng:
        res = [eng.generate(p, max_tokens=24, stop_at_eos=False) for p in prompts]
        return [r.tokens for r in res], [(r.stats.mtp, r.stats.prefix_tokens_reused) for r in res], eng.stats()


@pytest.mark.slow
@pytest.mark.parametrize(("model", "stream"), [("trained_hf", False), ("trained_qn4", True)])
def test_mtp_resume_equals_mtp_without_snapshots_and_plain_greedy(request: pytest.FixtureRequest, model: str,
                                                                  stream: bool, prompts: list[list[int]],
                                                                  tmp_path: Path) -> None:
    d = request.getfixturevalue(model)
    extra = STREAM if stream else {}
    seq = [prompts[0], prompts[0], prompts[1]]
    plain, _, _ = _run(d, seq, snapshot_head_tokens=0, **extra)
    ref, ref_mtp, _ = _run(d, seq, snapshot_head_tokens=0, **MTP, **extra)
    got, got_mtp, st = _run(d, seq, snapshot_head_tokens=HEAD, snapshot_dir=str(tmp_path), **MTP, **extra)
    assert got == ref == plain
    # The same drafts accepted round by round: the resumed MTP cache drafts as the fresh one does.
    assert [m.accept_hist for m, _ in got_mtp] == [m.accept_hist for m, _ in ref_mtp]
    assert [m.rounds for m, _ in got_mtp] == [m.rounds for m, _ in ref_mtp]
    assert [r for _, r in got_mtp] == [0, len(prompts[0]) - 1, HEAD]
    assert st.prefix is not None and st.prefix.captures == 3 and st.prefix.hits == 2 and st.prefix.disk_writes == 1
    if stream:
        assert st.expert_source == "pool" and st.pool is not None and st.pool.misses > 0
    # Another engine (process) resumes the second prompt from the head's file.
    again, again_mtp, st2 = _run(d, [prompts[1]], snapshot_head_tokens=HEAD, snapshot_dir=str(tmp_path), **MTP,
                                 **extra)
    assert again == [plain[2]] and again_mtp[0][1] == HEAD and again_mtp[0][0].accept_hist == ref_mtp[2][0].accept_hist
    assert st2.prefix is not None and st2.prefix.disk_loads == 1


@pytest.mark.slow
def test_a_snapshot_of_the_other_kind_is_ignored_with_one_warning(trained_hf: Path, prompts: list[list[int]],
                                                                  tmp_path: Path) -> None:
    plain, _, _ = _run(trained_hf, [prompts[1]], snapshot_head_tokens=0)
    for writer, reader in [({}, MTP), (MTP, {})]:
        d = tmp_path / ("mtp" if writer else "plain")
        _run(trained_hf, [prompts[0]], snapshot_head_tokens=HEAD, snapshot_dir=str(d), **writer)
        with qnpipe.Engine(trained_hf, snapshot_head_tokens=HEAD, snapshot_dir=str(d), **reader) as eng:
            with pytest.warns(SnapshotFileWarning, match="mtp settings"):
                first = eng.generate(prompts[1], max_tokens=24, stop_at_eos=False)
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                second = eng.generate(prompts[1][:HEAD + 2], max_tokens=4, stop_at_eos=False)
            st = eng.stats().prefix
        assert first.tokens == plain[0] and first.stats.prefix_tokens_reused == 0
        assert second.stats.prefix_tokens_reused == HEAD  # its own head state, captured in place of the file's
        assert st is not None and st.ignored_files == 1 and st.disk_loads == 0
