"""An oracle drafter forces every acceptance count; rollback leaves every cache as plain decoding's."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest
import trio
from mlx_lm.models.cache import KVCache

from qnpipe.actors.forward import Forward
from qnpipe.live import decoding
from qnpipe.live.loaded import ThreadedBackend
from qnpipe.live.mlx_thread import MLXThread, run_on
from qnpipe.live.mtp import loop
from qnpipe.model.mtp import MtpHead
from qnpipe.model.step_cache import StepCache
from qnpipe.model.stepper import MlxBackend

PROMPT = [17, 300, 1000, 42, 9, 2048, 77]


def _fwd(lm: Any, th: MLXThread) -> Forward:
    return Forward(ThreadedBackend(th, MlxBackend(lm.model, None)), None, None, {}, lm.args.num_experts)


async def _plain(lm: Any, th: MLXThread, n: int) -> list[int]:
    res = await decoding.generate(_fwd(lm, th), th, lm.model, None, PROMPT, max_tokens=n, temperature=0.0,
                                  top_p=1.0, seed=None, eos=set(), chunk=2)
    return list(res.tokens)


def _oracle(ref: list[int], p: float, vocab: int, seed: int) -> loop.Oracle:
    """Drafts that are right (the plain greedy token) with probability `p`, else a wrong token."""
    rng = np.random.default_rng(seed)

    def oracle(done: int, drafts: list[int]) -> list[int]:
        out = []
        for i in range(len(drafts)):
            true = ref[done + i] if done + i < len(ref) else 0
            out.append(true if rng.random() < p else (true + 1 + int(rng.integers(vocab - 1))) % vocab)
        return out

    return oracle


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_oracle_forces_every_acceptance_count_and_output_stays_exact(trained_mtp: Any, k: int) -> None:
    lm, head, th = trained_mtp

    async def main() -> tuple[list[int], Any, list[int]]:
        ref = await _plain(lm, th, 128 + k + 1)
        opts = loop.SpecOptions(k=k, hidden=loop.MtpHidden.POST_NORM,
                                oracle=_oracle(ref, 0.7, lm.args.vocab_size, seed=k))
        res = await loop.generate(_fwd(lm, th), th, lm.model, head, None, PROMPT, max_tokens=128, eos=set(),
                                  chunk=2, opts=opts)
        return list(res.tokens), res.stats.mtp, ref[:128]

    tokens, mtp, ref = trio.run(main)
    assert tokens == ref
    assert len(mtp.accept_hist) == k + 1
    for a, count in enumerate(mtp.accept_hist):
        assert count > 0, f"acceptance count {a} never occurred: {mtp.accept_hist}"
    assert mtp.drafted_at == (mtp.rounds,) * k


def _plain_caches(lm: Any, head: MtpHead, tokens: list[int], nxt: int) -> tuple[list[Any], KVCache]:
    """Caches after plain decoding of `tokens` (prompt in chunks of 2, then one token a step), and the
    MTP's rows over them (row j: hidden j with token j+1, the last with `nxt`)."""
    m = lm.model
    cache = m.make_cache()
    hs = []
    P = len(PROMPT)
    for lo in range(0, P, 2):
        hs.append(m.model(mx.array([PROMPT[lo:lo + 2]], dtype=mx.uint32), cache))
    for t in tokens[P:]:
        hs.append(m.model(mx.array([[t]], dtype=mx.uint32), cache))
    mcache = head.make_cache()
    h = mx.concatenate(hs, axis=1)
    head(m, h, mx.array([[*tokens[1:], nxt]], dtype=mx.uint32), mcache)
    mx.eval([c.state for c in cache], mcache.state)
    return cache, mcache


def _arrays(c: Any) -> list[np.ndarray]:
    if isinstance(c, KVCache):
        assert c.keys is not None and c.values is not None
        return [np.array(c.keys[..., :c.offset, :]), np.array(c.values[..., :c.offset, :])]
    return [np.array(c[0]), np.array(c[1])]


@pytest.mark.parametrize("rollback", ["states", "rerun"])
def test_after_a_rejected_draft_every_cache_equals_plain_decoding(trained_mtp: Any, rollback: str) -> None:
    lm, head, th = trained_mtp
    K = 3

    async def main() -> tuple[loop.SpecState, list[int], list[int], list[np.ndarray]]:
        ref = await _plain(lm, th, 16)
        fwd = _fwd(lm, th)
        # First draft right, the second wrong: accept 1, roll back 2 of the 4 verified tokens.
        wrong = (ref[2] + 1) % lm.args.vocab_size
        opts = loop.SpecOptions(k=K, hidden=loop.MtpHidden.POST_NORM, rollback=rollback,
                                oracle=lambda done, d: [ref[done], wrong, ref[done + 2]])
        st = await run_on(th, loop.SpecState, lm.model, head, opts)
        x = await loop.prefill(fwd, th, st, PROMPT, 2)
        rec = loop.Recorder(K)
        committed = await loop.spec_round(fwd, th, st, x, 1, opts, rec)
        # What the GDN states would be without the rollback: after all K + 1 verified tokens.
        unrolled = [np.array(c.states[-1]) for c in st.caches.main if isinstance(c, StepCache) and c.states]
        await run_on(th, st.apply_pending, True)
        return st, [x, *committed], ref, unrolled

    st, out, ref, unrolled = trio.run(main)
    assert out == ref[:3]  # x, d_1 accepted, then the model's own token
    processed = [*PROMPT, *out[:2]]  # b is pending, as in plain decoding after it sampled b
    plain, plain_mtp = th.submit(_plain_caches, lm, head, processed, out[2]).result()
    n = len(processed)
    for i, (got, want) in enumerate(zip(st.caches.main, plain, strict=True)):
        if isinstance(want, KVCache):
            assert got.offset == want.offset == n, i
        for g, w in zip(_arrays(got), _arrays(want), strict=True):
            assert g.shape == w.shape, i
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=f"layer {i}")
    # The MTP cache holds rows 0..n-1, each from verified hidden states: none left from drafting.
    assert st.caches.mtp.offset == plain_mtp.offset == n
    for g, w in zip(_arrays(st.caches.mtp), _arrays(plain_mtp), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
    # Negative control: the state after every verified token is not plain decoding's.
    if rollback == "states":
        gdn = [c for c in plain if not isinstance(c, KVCache)]
        assert len(unrolled) == len(gdn)
        assert all(np.abs(u - np.array(c[1])).max() > 1e-4 for u, c in zip(unrolled, gdn, strict=True))
