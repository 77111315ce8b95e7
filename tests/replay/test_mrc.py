"""Miss-ratio curves (qnpipe.replay.mrc): one pass gives, at every capacity, what a demand-only replay counts."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from qnpipe import config, trace
from qnpipe.cli import main
from qnpipe.io.atomic import UMASK
from qnpipe.policy.eviction import LRU
from qnpipe.policy.slot_table import SlotTable
from qnpipe.replay import miss_ratio_curves, replay
from qnpipe.replay.belady import belady_hits
from qnpipe.replay.mrc import ALL, belady_layers, belady_one_pass, lru_hits, lru_one_pass, native_available
from qnpipe.replay.mrc_export import COLUMNS
from tests.profiles import examples


def write_log(path: Path, steps: list[list[tuple[int, ...] | None]], *, experts: int, k: int) -> Path:
    """A routing log: `steps[s][layer]` = that layer-step's experts (tokens x k, flat), None = not routed."""
    layers = len(steps[0])
    shape = trace.ModelShape(num_layers=layers, moe_layers=tuple(range(layers)), num_experts=experts, top_k=k,
                             hidden_size=8)
    header = trace.Header(schema_version=trace.SCHEMA_VERSION, fingerprint="mrc", model=shape, clock_start_t=0.0,
                          wall_start_unix_s=0.0, contents="routes", capacities={})
    w = trace.TraceWriter(path, header)
    seq = 0
    for s, row in enumerate(steps, start=1):
        for layer, experts_ in enumerate(row):
            if experts_ is not None:
                seq += 1
                w.write(trace.Route(t=0.0, seq=seq, step=s, layer=layer, top_k=k, experts=experts_))
    w.close(0, 0.0)
    return path


@st.composite
def logs(draw: st.DrawFn) -> tuple[list[list[tuple[int, ...] | None]], int, int]:
    experts = draw(st.integers(4, 16))
    k = draw(st.integers(1, min(4, experts)))
    layers = draw(st.integers(1, 3))
    multi = draw(st.booleans())  # steps of several tokens: parts below the step's union
    token = st.lists(st.integers(0, experts - 1), min_size=k, max_size=k, unique=True)
    steps = []
    for _ in range(draw(st.integers(1, 10))):
        row: list[tuple[int, ...] | None] = []
        for _ in range(layers):
            tokens = draw(st.lists(token, min_size=1, max_size=3 if multi else 1))
            # a layer missing from a step (but routed in the first, so every layer has a route)
            row.append(None if steps and draw(st.integers(0, 5)) == 0 else tuple(e for t in tokens for e in t))
        steps.append(row)
    return steps, experts, k


# fewer: each example replays at every capacity
@examples(25)
@given(case=logs())
def test_one_pass_curves_equal_the_replay_at_every_capacity(case: tuple[list[list[tuple[int, ...] | None]], int, int],
                                                            tmp_path_factory: pytest.TempPathFactory) -> None:
    steps, experts, k = case
    path = write_log(tmp_path_factory.mktemp("mrc") / "log.qtrace", steps, experts=experts, k=k)
    result = miss_ratio_curves(path)
    assert miss_ratio_curves(path, native=False).rows() == result.rows()  # the numpy loops, the C ones' reference
    assert result.min_capacity == k
    for c in result.curves:
        assert c.capacities == list(range(k, experts + 1))
    for cap in range(k, experts + 1):
        cfg = config.load(None, overrides={"pool.expert_slots": str(cap), "pool.evict_policy": "lru"})
        r = replay(path, cfg, record_nbytes=1024)
        i = cap - k
        total = {"lru": 0, "belady": 0}
        for x in r.layers:
            if not x.requests:
                continue
            lru, opt = result.curve("lru", x.layer), result.curve("belady", x.layer)
            assert (lru.hits[i], lru.requests[i]) == (x.hits, x.requests), (cap, x)
            assert opt.requests[i] == x.requests and opt.hit_rate()[i] == x.belady_hit_rate, (cap, x)
            total["lru"] += x.hits
            total["belady"] += opt.hits[i]
        assert result.curve("lru").hits[i] == total["lru"] == round(r.hit_rate * result.curve("lru").requests[i])
        assert result.curve("belady").hits[i] == total["belady"]


@st.composite
def request_seqs(draw: st.DrawFn) -> tuple[list[list[list[int]]], int]:
    """Per layer, requests of distinct experts of any size up to 6 (what the one-pass functions take)."""
    experts = draw(st.integers(2, 14))
    width = draw(st.integers(1, min(6, experts)))
    layers = draw(st.integers(1, 3))
    req = st.lists(st.integers(0, experts - 1), min_size=1, max_size=width, unique=True).map(sorted)
    return [draw(st.lists(req, min_size=1, max_size=40)) for _ in range(layers)], experts


# fewer: each example runs the slot table and Belady per capacity
@examples(60)
@given(case=request_seqs())
def test_one_pass_equals_the_slot_table_and_belady_per_capacity(case: tuple[list[list[list[int]]], int]) -> None:
    per_layer, experts = case
    n = max(map(len, per_layer))
    width = max(len(r) for reqs in per_layer for r in reqs)
    arr = np.full((n, len(per_layer), width), -1, dtype=np.int64)
    for layer, reqs in enumerate(per_layer):
        for s, r in enumerate(reqs):
            arr[s, layer, :len(r)] = r
    hits, requests = lru_one_pass(arr, experts, native=False)
    opts = belady_layers(arr, experts, native=False)
    if native_available():  # the C loops (cextensions/mrc_opt.c) give the same, else the numpy ones run
        assert (belady_layers(arr, experts) == opts).all()
        c_hits, c_requests = lru_one_pass(arr, experts)
        assert (c_hits == hits).all() and (c_requests == requests).all()
    for layer, reqs in enumerate(per_layer):
        assert requests[layer] == sum(map(len, reqs))
        opt = belady_one_pass(reqs, experts)
        assert (opt == opts[layer]).all()  # alone or beside other layers
        for cap in range(max(map(len, reqs)), experts + 1):
            assert hits[layer][cap] == lru_hits(reqs, cap), (layer, cap)
            assert opt[cap] == belady_hits(reqs, cap), (layer, cap)


def test_the_c_loops_are_built_here_and_refused_when_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A source checkout built with a compiler has qnpipe.replay._mrc_opt; without it, asking for it says why."""
    import qnpipe.replay.mrc as m

    assert native_available() == any(Path(m.__file__).parent.glob("_mrc_opt*"))
    monkeypatch.setattr(m, "_native", lambda: None)
    arr = np.asarray([[[0, 1]], [[1, 2]]], dtype=np.int64)
    assert belady_layers(arr, 3).tolist() == belady_layers(arr, 3, native=False).tolist()
    with pytest.raises(RuntimeError, match="not built"):
        belady_layers(arr, 3, native=True)
    assert lru_one_pass(arr, 3)[0].tolist() == lru_one_pass(arr, 3, native=False)[0].tolist()
    with pytest.raises(RuntimeError, match="not built"):
        lru_one_pass(arr, 3, native=True)
    monkeypatch.undo()
    if native_available():  # the C loops index arrays by expert: a bad request is refused, never read past
        for bad in ([[[0, 0]]], [[[0, 3]]]):
            for f in (belady_layers, lambda a, e: lru_one_pass(a, e)):
                with pytest.raises(ValueError, match="repeats an expert or names one outside 0..2"):
                    f(np.asarray(bad, dtype=np.int64), 3)


def _contents(requests: list[list[int]], capacity: int) -> set[int]:
    table = SlotTable(0, capacity, LRU())
    for r in requests:
        for ld in table.acquire(r).loads:
            table.loaded(ld.expert, ld.slot)
        table.release(r)
    return set(table.slot_of)


def test_the_pools_lru_has_no_inclusion_property() -> None:
    """Why LRU is not a plain stack-distance count: a step touches its hits before it loads its misses, so
    within a step the recency order depends on the capacity. Step 3 misses expert 0 with 4 slots (so loads it
    last: the step's newest) and hits it with 5 (touched first: the step's oldest), and step 4's eviction takes
    0 with 5 slots and spares it with 4."""
    reqs = [[0, 1, 4], [1, 2, 3], [0, 2, 3], [1, 4, 5]]
    at4, at5 = _contents(reqs, 4), _contents(reqs, 5)
    assert at4 == {0, 1, 4, 5} and at5 == {1, 2, 3, 4, 5}
    # ... and the one pass still counts it exactly
    for native in (False, None):
        hits, _ = lru_one_pass(np.asarray(reqs, dtype=np.int64)[:, None, :], 6, native=native)
        assert [int(hits[0][c]) for c in range(3, 7)] == [lru_hits(reqs, c) for c in range(3, 7)]


def test_mrc_cli_writes_the_csv_and_the_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rng = np.random.default_rng(1)
    steps: list[list[tuple[int, ...] | None]] = [
        [tuple(int(e) for e in rng.choice(12, 3, replace=False)) for _ in range(2)] for _ in range(40)]
    log = write_log(tmp_path / "two.qtrace", steps, experts=12, k=3)
    out, png = tmp_path / "out" / "c.csv", tmp_path / "out" / "c.png"
    out.parent.mkdir()
    assert main(["replay", str(log), "--mrc", "--csv", str(out), "--plot", str(png), "--mrc-layers", "1"]) == 0
    printed = capsys.readouterr().out
    assert "LRU" in printed and "Belady" in printed and str(out) in printed
    with out.open() as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0]) == COLUMNS
    # 2 policies x (2 layers + all) x capacities 3..12
    assert len(rows) == 2 * 3 * 10
    assert {r["layer"] for r in rows} == {"0", "1", ALL}
    by = {(r["policy"], r["layer"], int(r["capacity"])): r for r in rows}
    assert float(by[("lru", ALL, 12)]["hit_rate"]) == float(by[("belady", ALL, 12)]["hit_rate"])  # all fit
    assert int(by[("lru", ALL, 3)]["requests"]) == 2 * 40 * 3
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for p in (out, png):  # the usual permissions, never the temporary file's 0600
        assert os.stat(p).st_mode & 0o777 == 0o666 & ~UMASK
    # defaults: <log name>.mrc.csv in the current directory, and no plot unless --plot asks for one
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert main(["replay", str(log), "--mrc", "--mrc-policies", "belady"]) == 0
    finally:
        os.chdir(cwd)
    with (tmp_path / "two.mrc.csv").open() as f:
        assert {r["policy"] for r in csv.DictReader(f)} == {"belady"}
    assert not (tmp_path / "two.mrc.png").exists() and not list(tmp_path.glob("*.png"))
    # --json: the curves on stdout, the same numbers as the CSV and the Python API
    capsys.readouterr()
    assert main(["replay", str(log), "--mrc", "--json", "--csv", str(out), "--plot", str(png)]) == 0
    doc = json.loads(capsys.readouterr().out)
    api = miss_ratio_curves(log)
    assert doc["min_capacity"] == 3 and len(doc["curves"]) == len(api.curves) == 6
    assert [c["hits"] for c in doc["curves"]] == [c.hits for c in api.curves]
    assert [(r["policy"], str(r["layer"]), r["capacity"], r["hits"]) for r in api.rows()] == \
        [(r["policy"], r["layer"], int(r["capacity"]), int(r["hits"])) for r in rows]


def test_mrc_cli_refuses_what_it_does_not_do(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = write_log(tmp_path / "one.qtrace", [[(0, 1)], [(1, 2)]], experts=4, k=2)
    assert main(["replay", str(log), "--mrc", "--predict", "previous"]) != 0
    assert "demand caching only" in capsys.readouterr().err
    assert main(["replay", str(log), "--mrc", "--mrc-policies", "arc"]) != 0
    assert "--mrc-policies arc" in capsys.readouterr().err
    assert main(["replay", str(log), "--mrc", "--mrc-layers", "5", "--csv", str(tmp_path / "x.csv"),
                 "--plot", str(tmp_path / "x.png")]) != 0
    assert "layers [5] are not routed" in capsys.readouterr().err
    assert main(["replay", str(log), "--plot", str(tmp_path / "y.png"), "--set", "replay.record_nbytes=64"]) != 0
    assert "give --mrc" in capsys.readouterr().err
    assert not (tmp_path / "y.png").exists()
