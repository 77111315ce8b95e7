"""Hits before their turn on the generic tier (qnpipe.model.family.pooled): a pooled switch whose grant is
certain runs its experts at once and the forward takes the turn after; the decode token is read at the next
step's first switch. Same greedy tokens as mlx-lm, and the same tokens, steps and pool counts as the path that
yields every route and reads the token first (`ThreadedBackend.takes_hits` off), an EOS stop included.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import qnpipe
from qnpipe.actors.forward import Forward
from qnpipe.convert import convert
from qnpipe.live.loaded import ThreadedBackend
from qnpipe.live.session import Output
from qnpipe.policy.forward_core import ForwardCore
from tests.families.test_engine_families import N_NEW, prompt, reference, save_mlx_lm_dir


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, int]:
    root = tmp_path_factory.mktemp("hits-first")
    cfg = save_mlx_lm_dir(root / "src", "qwen3_moe", "affine4")
    convert(root / "src", root / "qn")
    return root / "src", root / "qn", int(cfg["num_experts"])


def _generate(d: Path, experts: int, tokens: list[int], monkeypatch: pytest.MonkeyPatch, *, hits: bool,
              eos: int | None = None) -> tuple[Any, ...]:
    """(tokens, finish reason, pool steps, layer-steps, hits, misses, hits run before their turn, steps dropped)."""
    taken, dropped = [0], [0]
    real_hit, real_drop, real_commit = Forward.hit_queued, ForwardCore.drop_step, Output.commit

    def hit(self: Forward, route: Any, slots: Any) -> None:
        taken[0] += 1
        real_hit(self, route, slots)

    def drop(self: ForwardCore) -> None:
        dropped[0] += 1
        real_drop(self)

    with monkeypatch.context() as m:
        m.setattr(Forward, "hit_queued", hit)
        m.setattr(ForwardCore, "drop_step", drop)
        if not hits:
            m.setattr(ThreadedBackend, "takes_hits", property(lambda self: False))
        if eos is not None:
            m.setattr(Output, "commit", lambda self, tok: False if tok == eos else real_commit(self, tok))
        opts: dict[str, Any] = {"pool.autopin": False}
        with qnpipe.Engine(d, expert_slots=experts, prefill_chunk_tokens=0, **opts) as eng:
            eng.generate(tokens, max_tokens=2, stop_at_eos=False)  # the pool fills: later layers are all hits
            res = eng.generate(tokens, max_tokens=N_NEW, stop_at_eos=eos is not None)
            pool = eng.stats().pool
    assert pool is not None
    return (res.tokens, res.stats.finish_reason, pool.steps, pool.layer_steps, pool.hits, pool.misses,
            taken[0], dropped[0])


def test_generic_hits_before_their_turn(dirs: tuple[Path, Path, int], monkeypatch: pytest.MonkeyPatch) -> None:
    src, qn, experts = dirs
    toks = prompt()
    _, want = reference(src, toks)
    first = _generate(qn, experts, toks, monkeypatch, hits=True)
    turn = _generate(qn, experts, toks, monkeypatch, hits=False)
    assert list(first[0]) == want
    assert first[6] > 0 and turn[6] == 0  # each way really was taken
    assert first[:6] == turn[:6]
    # An EOS at the fourth new token: read at the next step's first switch, which it then stops.
    cut = next(i for i in range(3, len(want)) if want[i] not in want[:i])
    first = _generate(qn, experts, toks, monkeypatch, hits=True, eos=want[cut])
    turn = _generate(qn, experts, toks, monkeypatch, hits=False, eos=want[cut])
    assert list(first[0]) == want[:cut]
    assert first[7] == 1 and turn[7] == 0
    assert first[:6] == turn[:6]
