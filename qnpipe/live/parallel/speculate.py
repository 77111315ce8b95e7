"""Rank 0's MTP speculation loop over the ring (docs/distributed.md, "MTP speculation").

The last rank holds the MTP head (it needs the final hidden state, the embedding and the LM
head), so the drafts are made there: each step's answer brings rank 0 the committed tokens and
the next round's drafts (K of them, or as many as adaptive depth chose), and rank 0 sends
`[y_n, d_1 … d_K]` round the ring as one verify step of K + 1 rows. The drafts depend only on what the last rank has seen, so no round waits for
more than one pass. Every rank rolls its own layers back (qnpipe.live.parallel.verify): the
rollback of a verify step rides on the next step's header.

The rounds are `qnpipe.live.mtp.loop`'s batch verify with per-token states: greedy (the same
committed tokens as plain greedy decoding), or speculative sampling, where the last rank draws
the drafts and judges them with the sequence's seeded generator in one process's order (the
same tokens as one process with MTP at that seed; qnpipe.live.mtp.sampling).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import mlx.core as mx
import numpy as np
import trio

from qnpipe.actors.forward import Forward
from qnpipe.errors import DistributedError
from qnpipe.live.decoding import conclude
from qnpipe.live.mlx_thread import MLXThread, run_on
from qnpipe.live.mtp.loop import Recorder
from qnpipe.live.mtp.state import Draft
from qnpipe.live.parallel.verify import Verifying, own_layers, spec_cache, spec_restore
from qnpipe.live.prefix import PrefixCache, prefill
from qnpipe.live.session import DecodeSession, Output
from qnpipe.messages import Msg
from qnpipe.model.qwen3_next import Model
from qnpipe.model.snapshots import Snapshot
from qnpipe.model.tails import TailKind
from qnpipe.stats import GenerateResult
from qnpipe.trace import SpecRound


@attrs.frozen
class SamplerArgs:
    """Speculative sampling's settings, read by `Lead.tail` into the step's header."""

    temperature: float
    top_p: float
    seed: int | None


@attrs.frozen
class RingMtp:
    """The end of an MTP step on rank 0: `qnpipe.live.parallel.lead.Lead` sends it round the ring."""

    kind: TailKind
    depth: int
    ids: tuple[int, ...] = ()  # the tokens the last rank's MTP pairs with this step's rows
    keep: int = 0  # rows of the last verify step to keep (0: no verify step before this one)
    sampling: SamplerArgs | None = None  # None: greedy

    def __call__(self, h: mx.array) -> Any:
        # Lead.tail replaces it by a pass around the ring: only the last rank can end this step.
        raise DistributedError(f"an MTP {self.kind.name} step ended on rank 0 (no ring: distributed.enabled?)")


class _Rank0:
    """Rank 0's caches (its own layers) and the rollback still due. MLX thread only."""

    def __init__(self, model: Model) -> None:
        mx.reset_peak_memory()
        self.model = model
        self.cache = spec_cache(model)
        self.verifying = Verifying(model, self.cache)

    def resume(self, snap: Snapshot) -> None:
        """The caches (the list keeps its identity) in the state of rank 0's prefix snapshot."""
        self.cache[:] = spec_restore(self.model, snap)
        self.verifying = Verifying(self.model, self.cache)

    def inputs(self, tokens: Sequence[int], keep: int, verify_rows: int) -> Callable[[], mx.array]:
        def build() -> mx.array:
            self.verifying.before(keep, verify_rows)
            return mx.array(list(tokens), dtype=mx.uint32)[None]

        return build


async def generate(fwd: Forward, thread: MLXThread, model: Model, tokenizer: Any, tokens: Sequence[int], *,
                   max_tokens: int, eos: set[int], chunk: int, depth: int, max_depth: int | None = None,
                   temperature: float = 0.0,
                   top_p: float = 1.0, seed: int | None = None,
                   emit: Callable[[Msg], None] | None = None, on_text: Callable[[str], None] | None = None,
                   on_prefill: Callable[[int, int], None] | None = None,
                   partial: list[int] | None = None, prefix: PrefixCache | None = None) -> GenerateResult:
    """Generation with MTP speculation, the head on the last rank: greedy (plain greedy's tokens) or
    speculative sampling at `temperature` > 0 (one process's tokens with MTP at that seed). `depth`: K;
    `max_depth`: the most drafts a round may have (adaptive depth's `mtp.depth_max`; default K).

    `prefix` (its peers the other ranks) resumes the prompt from a kept state of every rank's
    layers, the last rank's MTP layer's too, and keeps new ones (qnpipe.live.prefix)."""
    sampler = SamplerArgs(temperature, top_p, seed) if temperature > 0.0 else None
    t0 = trio.current_time()
    st = await run_on(thread, _Rank0, model)
    pf = await prefill(thread, tokens, chunk, prefix, on_prefill)
    assert pf.plan.state is None or (prefix is not None and prefix.peers is not None)
    await pf.restore(st.resume, st.cache)
    session = DecodeSession(Output(tokenizer, eos, on_text, partial), len(tokens), max_tokens, t0, pf.start)
    answer = np.zeros(0, dtype=np.uint32)
    for lo, hi, last in pf.spans():
        # Row j pairs h_j with token j + 1; the last row's token is the one this step makes.
        tail = RingMtp(TailKind.MTP_FIRST if last else TailKind.MTP_SETTLE, depth,
                       tuple(tokens[lo + 1:hi] if last else tokens[lo + 1:hi + 1]), sampling=sampler)
        answer = np.asarray(await fwd.run(st.inputs(tokens[lo:hi], 0, 0), st.cache, tail))
        # the last rank's MTP rows now pair up to token hi
        await pf.reached(hi, lambda: own_layers(model, st.cache))
    drafts = _drafts(answer)
    rec = Recorder(depth if max_depth is None else max_depth)
    keep = 0
    pending = [int(answer[0])]
    while session.commit(pending, trio.current_time()):
        x = pending[-1]
        r0 = trio.current_time()
        answer = np.asarray(await fwd.run(st.inputs([x, *drafts], keep, len(drafts) + 1), st.cache,
                                          RingMtp(TailKind.MTP_VERIFY, depth, keep=keep, sampling=sampler)))
        pending = [int(t) for t in answer[:len(answer) - 1 - int(answer[-1])]]
        a = len(pending) - 1
        rec.round(Draft(drafts, []), pending, a)
        if emit is not None:
            emit(SpecRound(**rec.stamper.stamp(), step=fwd.stats.steps, drafts=tuple(drafts), accepted=a,
                           bonus=pending[-1]))
        rec.verify_s += trio.current_time() - r0
        drafts, keep = _drafts(answer), a + 1
    return await conclude(thread, session, mtp=rec.stats())


def _drafts(answer: np.ndarray) -> list[int]:
    """The next round's drafts in the last rank's answer `[committed..., drafts..., len(drafts)]`."""
    n = int(answer[-1])
    return [int(t) for t in answer[len(answer) - 1 - n:len(answer) - 1]]
