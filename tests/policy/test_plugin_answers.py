"""Issue 34 item 6: a plug-in eviction policy's answers are checked before the slot table uses them.

A `pick` that names an expert the step holds used to be evicted mid-use (other tokens, exit 0);
other wrong answers gave tracebacks. Every answer of `pick` and `victim` is now checked against
what was offered (qnpipe.policy.plugin_check), in `generate`, `replay` and `sweep` alike: a wrong
one is a PluginError naming the setting's value, the class, the method and the value, raised
before any slot is rewritten. The table runs on the slot table and the pool core (no trio, no
MLX); one CLI row each for generate, replay and sweep.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from cli_harness import Case, check_table, run_cli
from plugin_lru import LRU_SOURCE

from qnpipe.errors import QnpipeError
from qnpipe.messages import Acquire, ReadsDone, Release
from qnpipe.policy.eviction import make_eviction
from qnpipe.policy.pool import PoolPolicy
from qnpipe.policy.pool_core import Outbox, PoolCore
from qnpipe.policy.slot_table import SlotTable
from qnpipe.replay.synth import SynthSpec, write_synth

# The plug-ins, as a user's module would hold them: written to a temp directory put on the path.
PLUGIN = LRU_SOURCE + '''
import itertools

_picks = itertools.count()  # over every layer's instance: the n-th pick of the run


class Answer(LRUish):
    """Answers `answer` (set by the test) to pick and victim; `boom` raises it."""

    answer = None

    def pick(self, loading, held, pinned, incoming):
        return self.answer

    def victim(self, candidates, incoming):
        return self.answer


class Boom(LRUish):
    def pick(self, loading, held, pinned, incoming):
        raise KeyError(incoming)


class HeldLater(LRUish):
    """As LRUish for its first 150 picks (a few tokens of the demo model at 8 slots), then the held expert
    with the lowest id among those not loading (one still loading is refused as loading, checked first)."""

    def pick(self, loading, held, pinned, incoming):
        if next(_picks) >= 150 and (mine := sorted(e for e in self.last if e in held and e not in loading)):
            return mine[0]
        return super().pick(loading, held, pinned, incoming)


class Absent(LRUish):
    def pick(self, loading, held, pinned, incoming):
        return 999


class Text(LRUish):
    def pick(self, loading, held, pinned, incoming):
        return "3"
'''
MODULE = "hp_wrong"


@pytest.fixture(scope="module")
def plugdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("plug")
    (d / f"{MODULE}.py").write_text(PLUGIN)
    return d


@pytest.fixture
def on_path(plugdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(plugdir))
    monkeypatch.delitem(sys.modules, MODULE, raising=False)


def _scene(cls: str) -> tuple[SlotTable, Any]:
    """4 slots: 0 and 2 ready, 1 pinned, 3 still loading; then a step needs 0 (held) and 5 (a miss).

    The pick for 5 is offered only expert 2: 0 is held, 1 pinned, 3 loading, 5 incoming."""
    policy = make_eviction(f"{MODULE}:{cls}", 4)
    t = SlotTable(0, 4, policy)
    plan = t.acquire([0, 1, 2, 3])
    for ld in plan.loads[:3]:
        t.loaded(ld.expert, ld.slot)
    t.release([0, 1, 2, 3])
    t.pin(1)
    return t, policy


def _answer(monkeypatch: pytest.MonkeyPatch, value: object) -> None:
    """What every `Answer` plug-in answers from now on."""
    monkeypatch.setattr(sys.modules[MODULE].Answer, "answer", value)


def _slots(t: SlotTable) -> tuple[object, ...]:
    """What the forward reads and the table decides by: every slot's expert, state and generation."""
    return (list(t.expert_of), list(t.state), list(t.generation), dict(t.slot_of), list(t._free))


# (row, answer, what the message says besides class, method and value)
WRONG: list[tuple[str, object, str]] = [
    ("held", 0, "held by a step using it"),
    ("pinned", 1, "pinned"),
    ("loading", 3, "still loading"),
    ("incoming", 5, "the incoming expert"),
    ("absent", 9, "not in the pool"),
    ("negative", -1, "not in the pool"),
    ("none-while-evictable", None, "could be evicted"),
    ("string", "2", "not an expert id"),
    ("bool", True, "not an expert id"),
    ("float", 2.0, "not an expert id"),
    ("list-of-one", [2], "not an expert id"),
    ("too-few", [], "not an expert id"),
    ("duplicates", (2, 2), "not an expert id"),
]


@pytest.mark.usefixtures("on_path")
@pytest.mark.parametrize(("row", "answer", "why"), WRONG, ids=[w[0] for w in WRONG])
def test_a_wrong_pick_is_refused_before_the_table_changes(row: str, answer: object, why: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    t, _ = _scene("Answer")
    _answer(monkeypatch, answer)
    before = _slots(t)
    with pytest.raises(QnpipeError) as got:
        t.acquire([0, 5])
    msg = str(got.value)
    assert type(got.value).__name__ == "PluginError"
    for needle in (f"pool.evict_policy='{MODULE}:Answer'", "Answer.pick", f"returned {answer!r}", why):
        assert needle in msg, msg
    assert _slots(t) == before  # no slot rewritten: the forward would read what it read before


@pytest.mark.usefixtures("on_path")
def test_the_right_answer_passes_and_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    t, _ = _scene("Answer")
    _answer(monkeypatch, 2)
    plan = t.acquire([0, 5])
    assert [(ld.expert, ld.evicted) for ld in plan.loads] == [(5, 2)]


@pytest.mark.usefixtures("on_path")
def test_none_when_every_expert_is_blocked_is_an_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    """`prefetch` asks with nothing evictable: None is then right, and the prefetch is dropped."""
    t, _ = _scene("Answer")
    t.acquire([0, 2])  # 0 and 2 held, 1 pinned, 3 loading
    _answer(monkeypatch, None)
    assert t.prefetch(7) is None


@pytest.mark.usefixtures("on_path")
@pytest.mark.parametrize(("answer", "why"), [(0, "not one of the candidates [1, 2]"), (None, "not an expert id"),
                                             ("1", "not an expert id"), (False, "not an expert id")])
def test_a_wrong_victim_is_refused(answer: object, why: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _, policy = _scene("Answer")
    _answer(monkeypatch, answer)
    with pytest.raises(QnpipeError) as got:
        policy.victim(iter([1, 2]), 5)
    assert "Answer.victim" in str(got.value) and f"returned {answer!r}" in str(got.value) and why in str(got.value)


@pytest.mark.usefixtures("on_path")
def test_an_error_the_plugin_raises_is_named_not_a_traceback_from_the_table() -> None:
    t, _ = _scene("Boom")
    with pytest.raises(QnpipeError, match=r"'hp_wrong:Boom': Boom\.pick raised KeyError: 5"):
        t.acquire([0, 5])


@pytest.mark.usefixtures("on_path")
def test_the_pool_core_sends_nothing_for_a_wrong_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through PoolCore (what the actor and replay's fast driver both run): the error, and no read asked for."""
    policy = PoolPolicy.build({0: 2}, {0: make_eviction(f"{MODULE}:Answer", 2)}, {0: 100})
    core = PoolCore(policy)
    seq = iter(range(1, 100))
    core.handle(Acquire(t=0.0, seq=next(seq), step=1, layer=0, part=0, experts=(0, 1)), 0.0)
    core.handle(ReadsDone(t=0.0, seq=next(seq), layers=(0, 0), experts=(0, 1), slots=(0, 1), nbytes=(100, 100),
                          issued_t=(0.0, 0.0), started_t=0.0), 0.0)
    core.handle(Release(t=0.0, seq=next(seq), step=1, layer=0, part=0), 0.0)
    _answer(monkeypatch, 1)
    out: Outbox | None = None
    with pytest.raises(QnpipeError, match=r"Answer\.pick returned 1 for incoming expert 2: held"):
        out = core.handle(Acquire(t=0.0, seq=next(seq), step=2, layer=0, part=0, experts=(1, 2)), 0.0)
    assert out is None  # the error is the whole answer: no read, no grant goes out
    assert policy.tables[0].expert_of == [0, 1]


# ---------------------------------------------------------------------------- the commands


def _env(plugdir: Path) -> tuple[tuple[str, str], ...]:
    import qnpipe

    return (("PYTHONPATH", f"{Path(qnpipe.__file__).parents[1]}:{plugdir}"),)


@pytest.mark.slow
def test_generate_stops_at_a_held_pick_with_the_tokens_of_a_correct_run_before_it(
        plugdir: Path, trained_qn4: Path) -> None:
    """The silent case: HeldLater is LRU until its 151st pick, then names a held expert. The run stops there,
    naming it, and what it printed is the start of what the built-in lru prints (the same slots were read)."""
    argv = ["generate", trained_qn4, "-p", "def fib(n):", "-n", "24", "--set", "pool.expert_slots=8",
            "--set", "read.workers=1"]
    good = run_cli([*argv, "--set", "pool.evict_policy=lru"], env=_env(plugdir))
    assert good.returncode == 0, good.stderr.decode()
    bad = run_cli([*argv, "--set", f"pool.evict_policy={MODULE}:HeldLater"], env=_env(plugdir))
    err = bad.stderr.decode()
    assert bad.returncode == 2 and "Traceback" not in err, err
    for needle in (f"pool.evict_policy='{MODULE}:HeldLater'", "HeldLater.pick returned", "held by a step using it"):
        assert needle in err, err
    text = bad.stdout.decode()
    assert text.strip() and good.stdout.decode().startswith(text), (text, good.stdout.decode())


@pytest.mark.slow
def test_replay_and_sweep_name_the_plugin_method_and_value(plugdir: Path, tmp_path: Path) -> None:
    log = write_synth(tmp_path / "r.qtrace", SynthSpec(layers=2, experts=16, top_k=2, tokens=20, seed=1))
    rec = "replay.record_nbytes=100000"
    check_table([
        Case("replay-absent", ["replay", log, "--set", rec, "--set", "pool.expert_slots=4",
                               "--set", f"pool.evict_policy={MODULE}:Absent"], 2,
             (f"pool.evict_policy='{MODULE}:Absent'", "Absent.pick returned 999", "not in the pool"),
             env=_env(plugdir)),
        Case("replay-actors-absent", ["replay", log, "--driver", "actors", "--set", rec, "--set", "pool.expert_slots=4",
                                      "--set", f"pool.evict_policy={MODULE}:Absent"], 2,
             ("Absent.pick returned 999", "not in the pool"), env=_env(plugdir)),
        Case("sweep-text", ["sweep", log, "--set", rec, "--set", "pool.expert_slots=4", "--jobs", "2", "--no-progress",
                            "--grid", f"pool.evict_policy=lru,{MODULE}:Text"], 1,
             ("1 of 2 points failed", f"grid point 1 (pool.evict_policy={MODULE}:Text)",
              "Text.pick returned '3' (a str), not an expert id"), env=_env(plugdir)),
    ])
