"""The predictor actor: one hint per candidates message, sized by width x candidate_mult."""

from __future__ import annotations

import trio
import trio.testing

from qnpipe.actors.predictor import PredictorStats, predictor
from qnpipe.config import PredictCfg
from qnpipe.messages import Candidates, PoolInbox, PrefetchHint
from qnpipe.policy.predict import hint_top


def _hints(cfg: PredictCfg, cands: list[Candidates]) -> list[PrefetchHint]:
    out: list[PoolInbox] = []

    async def main() -> None:
        c_tx, c_rx = trio.open_memory_channel[Candidates](len(cands))
        p_tx, p_rx = trio.open_memory_channel[PoolInbox](len(cands))
        async with trio.open_nursery() as n:
            await n.start(lambda task_status: predictor(c_rx, p_tx, predict_cfg=cfg, top=hint_top(cfg),
                                                        stats=PredictorStats(), task_status=task_status))
            async with c_tx:
                for c in cands:
                    await c_tx.send(c)
            async with p_rx:
                out.extend([m async for m in p_rx])

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert all(isinstance(h, PrefetchHint) for h in out)
    return [h for h in out if isinstance(h, PrefetchHint)]


def _cands(tokens: int, width: int) -> Candidates:
    # Every token lists its own `width` experts (disjoint), token t's scores below token t-1's.
    experts = tuple(range(tokens * width))
    scores = tuple(1.0 - 0.01 * i for i in range(tokens * width))
    return Candidates(t=0.0, seq=0, step=0, layer=0, target=1, width=width, token_experts=experts,
                      token_scores=scores, deadline=1.0)


def test_one_hint_names_at_most_width_times_candidate_mult_experts_of_a_steps_tokens() -> None:
    for mult in (1, 2, 3):
        cfg = PredictCfg(width_experts=4, candidate_mult=mult)
        (one_token,) = _hints(cfg, [_cands(1, 4)])
        assert one_token.experts == (0, 1, 2, 3)  # one token: its W, whatever the multiplier
        (step,) = _hints(cfg, [_cands(5, 4)])
        assert step.experts == tuple(range(min(20, 4 * mult)))  # best first, cut at W x mult
