"""Hits answered in the forward's turn (qnpipe.actors.pool.InlinePool) log what the actors' channels would.

A real `qnpipe generate --trace` on a streamed tiny model three ways: hits run before their turn
(the default: `Forward.hit_slots` / `hit_queued`, the token read at the next step's first sync),
hits answered in the forward's turn after the backend yields (`ThreadedBackend.takes_hits` off), and
every message by channel (`qnpipe.actors.pipeline._inline_hits = False`); greedy, no autopin (its heat
would carry over) and no early grants (their records follow the reads' timing). The event logs hold
the same record kinds in the same numbers, and the same grants (step, layer, part, experts, slots,
hits, misses); only the times may differ.

The miss path's turns taken where their messages are made (qnpipe.actors.read_scheduler.ReadsInline,
qnpipe.actors.pool.PoolInline) the same way, on a pool too small for a step's experts: the read scheduler's
turn in the pool's (its reads put on the device at once) and the pool's turn over a finished batch in the read
scheduler's task, or every message by channel (`qnpipe.actors.pipeline._inline_reads = False`): the same
record kinds, grants and reads (layer, expert, slot).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from qnpipe import trace
from qnpipe.actors import forward, pipeline
from qnpipe.actors.forward import Forward
from qnpipe.actors.pool import InlinePool, PoolInline
from qnpipe.actors.read_scheduler import ReadsInline
from qnpipe.cli import main
from qnpipe.live.loaded import ThreadedBackend
from qnpipe.messages import Acquire, Granted, ReadDone, Release
from qnpipe.policy.forward_core import ForwardCore
from qnpipe.trace.format import ReadStarted

SHAPE = {"num_hidden_layers": 3, "full_attention_interval": 3, "num_experts": 16, "num_experts_per_tok": 2}


@pytest.fixture(scope="module")
def streamed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from qnpipe.convert import convert
    from qnpipe.convert.tiny import make_tiny

    root = tmp_path_factory.mktemp("inline-model")
    hf = make_tiny(root / "hf", layout="hf", seed=3, config_overrides=SHAPE)
    convert(hf, root / "q")
    return root / "q"


def _run(model: Path, path: Path, slots: int, mode: str,
         monkeypatch: pytest.MonkeyPatch) -> tuple[list[Any], int, int]:
    """The run's records, its inline grants (`answer`'s, and `answer_reads`' of an acquire granted at once) and its
    hits run before their turn; `mode`: hits | inline | channel."""
    answered = hits = 0
    real, real_reads, real_hit = InlinePool.answer, InlinePool.answer_reads, Forward.hit_queued

    def counting(self: InlinePool, msgs: Any) -> Any:
        nonlocal answered
        g = real(self, msgs)
        answered += g is not None
        return g

    def counting_reads(self: InlinePool, msgs: Any, *rest: Any) -> Any:
        nonlocal answered
        got = real_reads(self, msgs, *rest)
        answered += got is not None and len(got) == 1 and isinstance(got[0], Granted)
        return got

    def counting_hit(self: Forward, route: Any, slots: Any) -> None:
        nonlocal hits
        hits += 1
        real_hit(self, route, slots)

    with monkeypatch.context() as m:
        m.setattr(pipeline, "_inline_hits", mode != "channel")
        if mode == "inline":
            m.setattr(ThreadedBackend, "takes_hits", property(lambda self: False))
        m.setattr(InlinePool, "answer", counting)
        m.setattr(InlinePool, "answer_reads", counting_reads)
        m.setattr(Forward, "hit_queued", counting_hit)
        assert main(["generate", str(model), "--tokens", "5,6,7,8,9", "-n", "6", "--json", "--temperature", "0",
                     "--set", f"pool.expert_slots={slots}", "--set", "pool.autopin=false",
                     # early grants' Present records follow the reads' real timing: not the same twice
                     "--set", "forward.early_grants=false", "--trace", str(path)]) == 0
    _, records = trace.read(path)
    return records, answered, hits


def _grants(records: list[Any]) -> Counter[tuple[Any, ...]]:
    out: Counter[tuple[Any, ...]] = Counter()
    for r in records:
        if isinstance(r, Granted):
            out[("granted", r.step, r.layer, r.part, r.experts, r.slots, r.hits, r.misses)] += 1
        elif isinstance(r, Acquire | Release):
            out[(type(r).__name__, r.step, r.layer, r.part)] += 1
    return out


@pytest.mark.parametrize("slots", [16, 6])  # every expert fits (hits after the first reads); hits and misses mixed
def test_inline_hits_log_the_same_records_as_the_channels(streamed: Path, tmp_path: Path, slots: int,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    first, n_first, hits = _run(streamed, tmp_path / "hits.qtrace", slots, "hits", monkeypatch)
    inline, n_inline, no_hits = _run(streamed, tmp_path / "inline.qtrace", slots, "inline", monkeypatch)
    channel, n_channel, _ = _run(streamed, tmp_path / "channel.qtrace", slots, "channel", monkeypatch)
    assert n_first >= hits > 0 and no_hits == 0 and n_inline > 0 and n_channel == 0  # each way really was taken
    kinds = Counter(type(r).__name__ for r in channel)
    assert Counter(type(r).__name__ for r in inline) == kinds
    assert Counter(type(r).__name__ for r in first) == kinds
    assert _grants(inline) == _grants(channel) == _grants(first)
    for records in (first, inline):  # every inline grant is still logged after its acquire, with a time no earlier
        acquired = {(r.step, r.layer, r.part): r.t for r in records if isinstance(r, Acquire)}
        assert all(acquired[(g.step, g.layer, g.part)] <= g.t for g in records if isinstance(g, Granted))


def test_a_stop_at_the_next_steps_first_sync_leaves_no_step(streamed: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The token read at the next step's first router sync ends the generation there (an EOS): that step routed
    nothing, and the pool never hears of it: the same tokens, steps and layer-steps as reading the token first."""
    import qnpipe
    from qnpipe.live.session import Output

    opts: dict[str, Any] = {"pool.autopin": False, "forward.early_grants": False}
    with qnpipe.Engine(streamed, expert_slots=16, **opts) as eng:
        full = eng.generate([5, 6, 7], max_tokens=8, stop_at_eos=False).tokens
    cut = next(i for i in range(2, len(full)) if full[i] not in full[:i])
    real = Output.commit

    def eos_at(self: Output, tok: int) -> bool:
        return False if tok == full[cut] else real(self, tok)

    got, dropped = {}, []
    real_drop = ForwardCore.drop_step

    def counting_drop(self: ForwardCore) -> None:
        dropped.append(self.step)
        real_drop(self)

    for mode in ("hits", "inline"):
        dropped.clear()
        with monkeypatch.context() as m:
            if mode == "inline":
                m.setattr(ThreadedBackend, "takes_hits", property(lambda self: False))
            m.setattr(Output, "commit", eos_at)
            m.setattr(ForwardCore, "drop_step", counting_drop)
            with qnpipe.Engine(streamed, expert_slots=16, **opts) as eng:
                res = eng.generate([5, 6, 7], max_tokens=8)
                pool = eng.stats().pool
                assert pool is not None
                got[mode] = (res.tokens, res.stats.finish_reason, pool.steps, pool.layer_steps, pool.hits, pool.misses)
                assert len(dropped) == (mode == "hits")  # read at the next step's sync, which it then stopped
                m.setattr(Output, "commit", real)
                assert eng.generate([5, 6, 7], max_tokens=8, stop_at_eos=False).tokens == full  # the engine goes on
    assert got["hits"][0] == tuple(full[:cut])
    assert got["hits"] == got["inline"]


def _run_reads(model: Path, path: Path, inline: bool, monkeypatch: pytest.MonkeyPatch,
               route_first: bool = True, own_reads: bool = True) -> tuple[list[Any], int, int, int]:
    """The run's records and the turns taken inline: the read scheduler's, the pool's over a finished batch, the
    pool's over an acquire with misses in the forward's task (`InlinePool.answer_reads`). `route_first`: the
    forward takes a route's turn before the other tasks get theirs (qnpipe.actors.forward._route_turn_first).
    `own_reads`: the forward waits for the batch its turn put on the device (qnpipe.actors.forward._wait_own_reads);
    the batches it did are counted in `CLAIMED`."""
    taken = {"reads": 0, "pool": 0, "acquire": 0}
    reads_take, pool_take, answer_reads = ReadsInline.take, PoolInline.take, InlinePool.answer_reads

    def acquire(self: InlinePool, msgs: Any, *rest: Any) -> Any:
        got = answer_reads(self, msgs, *rest)
        taken["acquire"] += got is not None
        return got

    def reads(self: ReadsInline, msgs: Any, *rest: Any) -> bool:
        ok = reads_take(self, msgs, *rest)
        taken["reads"] += ok
        return ok

    def claims(self: ReadsInline, batch: Any) -> Any:
        claim = reads_claims(self, batch)
        CLAIMED[0] += claim is not None
        return claim

    reads_claims = ReadsInline.claims
    CLAIMED[0] = 0

    async def pool(self: PoolInline, done: Any) -> bool:
        ok = await pool_take(self, done)
        taken["pool"] += ok
        return ok

    with monkeypatch.context() as m:
        m.setattr(pipeline, "_inline_reads", inline)
        m.setattr(forward, "_route_turn_first", route_first)
        m.setattr(forward, "_wait_own_reads", own_reads)
        m.setattr(ReadsInline, "take", reads)
        m.setattr(ReadsInline, "claims", claims)
        m.setattr(PoolInline, "take", pool)
        m.setattr(InlinePool, "answer_reads", acquire)
        assert main(["generate", str(model), "--tokens", "5,6,7,8,9", "-n", "8", "--json", "--temperature", "0",
                     "--set", "pool.expert_slots=4", "--set", "pool.autopin=false",
                     "--set", "forward.early_grants=false", "--trace", str(path)]) == 0
    _, records = trace.read(path)
    return records, taken["reads"], taken["pool"], taken["acquire"]


def _generate(model: Path, slots: int, path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[Any, list[Any]]:
    """`qnpipe generate` of 8 tokens at `slots` with its event log at `path`: its JSON line and its records."""
    assert main(["generate", str(model), "--tokens", "5,6,7,8,9", "-n", "8", "--json", "--temperature", "0",
                 "--set", f"pool.expert_slots={slots}", "--set", "pool.autopin=false", "--trace", str(path)]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1]), trace.read(path)[1]


CLAIMED = [0]  # `_run_reads`' last run: the demand batches its forward waited for itself


def _read_content(records: list[Any]) -> Counter[tuple[Any, ...]]:
    """`_grants`, and every read started and done (layer, expert, slot)."""
    out = _grants(records)
    out.update((type(r).__name__, r.layer, r.expert, r.slot) for r in records if isinstance(r, ReadStarted | ReadDone))
    return out


def test_the_miss_path_inline_logs_the_same_records_as_the_channels(streamed: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    inline, reads, pools, acquires = _run_reads(streamed, tmp_path / "inline.qtrace", True, monkeypatch)
    claimed = CLAIMED[0]
    others, *_ = _run_reads(streamed, tmp_path / "others.qtrace", True, monkeypatch, own_reads=False)
    assert CLAIMED[0] == 0 < claimed  # the forward waited for its own reads, then the read scheduler's task did
    channel, no_reads, no_pools, no_acquires = _run_reads(streamed, tmp_path / "channel.qtrace", False, monkeypatch)
    assert reads >= acquires > 0 and pools > 0 and no_reads == no_pools == no_acquires == 0  # each way really was taken
    assert _read_content(others) == _read_content(channel)
    # The other tasks' turn given as the backend returns a route, before the forward's acquire (the way before).
    deferred = Counter[bool]()
    real = ThreadedBackend.defer_route_yield

    def defer(self: ThreadedBackend) -> bool:
        deferred[True] += 1
        return real(self)

    with monkeypatch.context() as m:
        m.setattr(ThreadedBackend, "defer_route_yield", defer)
        route_later, *_ = _run_reads(streamed, tmp_path / "later.qtrace", True, monkeypatch, route_first=False)
        assert not deferred  # this run's forward did not ask
        first, *_ = _run_reads(streamed, tmp_path / "first.qtrace", True, monkeypatch)
        assert deferred[True] >= 1  # ... and that run's did
    assert Counter(type(r).__name__ for r in inline) == Counter(type(r).__name__ for r in channel)
    content = _read_content(channel)
    assert any(k[0] == "ReadDone" for k in content) and _read_content(inline) == content
    assert _read_content(route_later) == _read_content(first) == content
    # every read logged as started, then done
    for records in (inline, channel):
        times: dict[tuple[int, int, int], tuple[list[float], list[float]]] = {}
        for r in records:
            if isinstance(r, ReadStarted | ReadDone):
                times.setdefault((r.layer, r.expert, r.slot), ([], []))[isinstance(r, ReadDone)].append(r.t)
        for starts, dones in times.values():  # the same slot may be read again later
            assert len(starts) == len(dones)
            assert all(a <= b for a, b in zip(sorted(starts), sorted(dones), strict=True))


def test_a_grant_run_before_its_turn_logs_the_same_records(streamed: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Early grants on: the forward waits for its own reads and, when they complete its grant, the backend runs
    that grant at once and its turns come in the backend's call (`Forward.grant_queued`), or, off
    (qnpipe.actors.forward._landed_grants), before it; foreseen while its reads are on the device or once they are
    done (`_foresee_early`). The same tokens, record kinds, grants and reads."""
    runs: dict[tuple[bool, bool], tuple[Any, list[Any], int]] = {}
    for landed, early in ((True, True), (True, False), (False, True)):
        taken = Counter[str]()
        real_granted, real_queued = Forward._granted, Forward.grant_queued

        def granted(self: Forward, *a: Any, _real: Any = real_granted, taken: Counter[str] = taken) -> None:
            taken["granted"] += 1
            _real(self, *a)

        def queued(self: Forward, _real: Any = real_queued, taken: Counter[str] = taken) -> None:
            taken["in the call"] += self._landed is not None
            _real(self)

        path = tmp_path / f"landed-{landed}-{early}.qtrace"
        with monkeypatch.context() as m:
            m.setattr(forward, "_landed_grants", landed)
            m.setattr(forward, "_foresee_early", early)
            m.setattr(Forward, "_granted", granted)
            m.setattr(Forward, "grant_queued", queued)
            out, records = _generate(streamed, 6, path, capsys)
        runs[landed, early] = (out["tokens"], records, taken["granted"])
        if landed:  # grants were run before their turn, and most took it in the backend's call
            assert taken["granted"] > 0 and taken["in the call"] > 0
        else:
            assert taken["granted"] == taken["in the call"] == 0
    tokens_off, records_off, _ = runs[False, True]
    for early in (True, False):
        tokens, landed_records, _ = runs[True, early]
        assert tokens == tokens_off
        assert Counter(type(r).__name__ for r in landed_records) == Counter(type(r).__name__ for r in records_off)
        assert _read_content(landed_records) == _read_content(records_off)


def test_an_acquires_reads_put_on_the_device_before_the_rest_of_its_turn_are_the_same_reads(
        streamed: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """An acquire with misses taken in the forward's turn puts its reads on the device once the table chose their
    slots (`PoolPolicy.acquire`'s `reads_now`), or, off (qnpipe.actors.pool._reads_first), after its whole turn:
    the same tokens, and the same reads (layer, expert, slot) handed to the read scheduler in the same order."""
    from qnpipe.actors import pool
    from qnpipe.messages import ReadExperts
    from qnpipe.policy.pool import PoolPolicy

    runs: dict[bool, tuple[Any, list[tuple[int, int, int]], int]] = {}
    for first in (True, False):
        reads: list[tuple[int, int, int]] = []
        early = [0]
        real_take, real_acquire = ReadsInline.take, PoolPolicy.acquire

        def take(self: ReadsInline, msgs: Any, *rest: Any, _real: Any = real_take,
                 reads: list[tuple[int, int, int]] = reads) -> bool:
            ok = _real(self, msgs, *rest)
            reads.extend((m.layer, e, s) for m in msgs if ok and isinstance(m, ReadExperts)
                         for e, s in zip(m.experts, m.slots, strict=True))
            return ok

        def acquire(self: PoolPolicy, *a: Any, _real: Any = real_acquire, early: list[int] = early) -> Any:
            if len(a) < 4 or a[3] is None:
                return _real(self, *a)

            def hook(loads: Any, inner: Any = a[3]) -> None:
                early[0] += 1
                inner(loads)

            return _real(self, *a[:3], hook)

        with monkeypatch.context() as m:
            m.setattr(pool, "_reads_first", first)
            m.setattr(ReadsInline, "take", take)
            m.setattr(PoolPolicy, "acquire", acquire)
            assert main(["generate", str(streamed), "--tokens", "5,6,7,8,9", "-n", "8", "--json", "--temperature",
                         "0", "--set", "pool.expert_slots=4", "--set", "pool.autopin=false"]) == 0
        out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        runs[first] = (out["tokens"], reads, early[0])
    (tokens, reads, early), (tokens_off, reads_off, early_off) = runs[True], runs[False]
    assert tokens == tokens_off and reads == reads_off and len(reads) > 0
    assert early > 0 and early_off == 0  # the reads really went out from inside the turn, and only with it on


def test_a_batch_known_before_its_turn_goes_on_the_device_first_and_logs_the_same(
        streamed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A demand request whose reads all start at once (`ReadCore.batch_at_once`) is put on the device before the
    read core's turn, or, off (qnpipe.actors.read_scheduler._submit_first), in it: the same tokens, records and
    batches put on the device in the same order, and the early way really taken."""
    from qnpipe.actors import read_scheduler
    from qnpipe.policy.read_core import ReadCore

    runs: dict[bool, tuple[Any, list[Any], list[list[tuple[int, int, int]]], int]] = {}
    for first in (True, False):
        batches: list[list[tuple[int, int, int]]] = []
        known = [0]
        real_submit, real_at_once = read_scheduler.submit, ReadCore.batch_at_once

        def submit(device: Any, jobs: Any, _real: Any = real_submit, batches: Any = batches) -> Any:
            batches.append([(j.layer, j.expert, j.slot) for j in jobs])
            return _real(device, jobs)

        def at_once(self: ReadCore, msgs: Any, _real: Any = real_at_once, known: list[int] = known) -> Any:
            jobs = _real(self, msgs)
            known[0] += jobs is not None
            return jobs

        path = tmp_path / f"first-{first}.qtrace"
        with monkeypatch.context() as m:
            m.setattr(read_scheduler, "_submit_first", first)
            m.setattr(read_scheduler, "submit", submit)
            m.setattr(ReadCore, "batch_at_once", at_once)
            out, records = _generate(streamed, 4, path, capsys)
        runs[first] = (out["tokens"], records, batches, known[0])
    (tokens, records, batches, known), (tokens_off, records_off, batches_off, known_off) = runs[True], runs[False]
    assert tokens == tokens_off and batches == batches_off and len(batches) > 0
    assert Counter(type(r).__name__ for r in records) == Counter(type(r).__name__ for r in records_off)
    assert _read_content(records) == _read_content(records_off)
    assert known > 0 and known_off == 0
