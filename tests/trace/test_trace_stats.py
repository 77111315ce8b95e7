"""`qnpipe trace stats`: hand-computed values on a tiny hand-made log; native and imported logs through the CLI."""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from qnpipe import trace
from qnpipe.cli import main
from qnpipe.errors import TraceSchemaError
from qnpipe.trace.stats import (
    bin_counts,
    bucket,
    describe,
    median_of_counts,
    popularity,
    reuse_histogram,
    stack_distances,
    trace_stats,
)
from tests.profiles import examples

DATA = Path(__file__).resolve().parent.parent / "data" / "traces"
SHAPE = trace.ModelShape(num_layers=2, moe_layers=(0, 1), num_experts=4, top_k=2, hidden_size=8)
# step -> layer -> tokens' top-2; request 0 = steps 1-2, request 1 = steps 3-4 (step 4 has two tokens)
ROUTES = {1: {0: [[0, 1]], 1: [[1, 2]]},
          2: {0: [[2, 3]], 1: [[0, 3]]},
          3: {0: [[2, 0]], 1: [[3, 1]]},
          4: {0: [[0, 1], [0, 3]], 1: [[1, 2], [1, 0]]}}


def _log(path: Path, requests: bool = True) -> Path:
    w = trace.TraceWriter(path, trace.Header(schema_version=1, fingerprint="hand", model=SHAPE, clock_start_t=0.0,
                                             wall_start_unix_s=0.0, contents="routes"))
    for step, layers in ROUTES.items():
        if requests and step in (1, 3):
            w.write(trace.RequestStart(t=0.0, seq=w.records, request=step // 2, first_step=step))
        for layer, toks in layers.items():
            w.write(trace.Route(t=0.0, seq=w.records, step=step, layer=layer, top_k=2,
                                experts=tuple(e for t in toks for e in t)))
    w.close(0, 0.0)
    return path


def test_stats_of_a_hand_made_log_match_the_hand_computed_values(tmp_path: Path) -> None:
    s = trace_stats(_log(tmp_path / "hand.qtrace"))
    assert (s.requests, s.steps, s.tokens) == (2, 4, 5)
    a, b = s.layers
    # layer 0 assignments: expert 0 four times, 1, 2, 3 twice each (10)
    assert a.top10_share == 0.4  # ceil(10% of 4) = 1 expert: 4 of 10
    h = -(0.4 * math.log2(0.4) + 3 * 0.2 * math.log2(0.2))
    assert a.entropy_bits == pytest.approx(h) and a.entropy_norm == pytest.approx(h / 2)
    assert a.gini == pytest.approx(0.15)  # mean |ci - cj| over ordered pairs (12/16) / (2 * mean 2.5)
    assert (a.unused, a.union_mean, a.union_max, a.tokens_per_step) == (0, 2.25, 3, 1.25)
    # stack distances: {0,1} {2,3} cold; step 3: 0 after {2,3} -> 2, 2 -> 0; step 4: 0 -> 0, 1 -> 3 (2,3,0), 3 -> 2
    assert a.reuse_cold == 4 and a.reuse_hist == {"0": 2, "2-3": 3} and a.reuse_median == 2.0
    assert a.reuse_counts == [2, 0, 2, 1]  # exact: distances 0, 0, 2, 2, 3
    # previous token, within a request: [0,1]->[2,3] 0; [2,0]->[0,1] 1; [0,1]->[0,3] 1: 2 of 3 pairs x 2
    assert a.prev_token_hit == pytest.approx(2 / 6)
    assert b.top10_share == 0.4 and b.gini == pytest.approx(0.15)
    (x,) = s.cross_layer
    # table from tokens [0,1]->[1,2] and [2,3]->[0,3]; tested on [2,0]->[3,1] (guess {0,1}: 1 hit),
    # [0,1]->[1,2] ({1,2}: 2), [0,3]->[1,0] ({0,1}: 2); popularity (all tied, lower ids) {0,1}: 1 + 1 + 2
    assert (x.layer, x.next_layer, x.train_tokens, x.test_tokens) == (0, 1, 2, 3)
    assert x.hit_at_k == pytest.approx(5 / 6) and x.popular_hit_at_k == pytest.approx(4 / 6)
    # layer 1: {1,2} {0,3} cold; step 3: 3 -> 0, 1 -> 2 (0,3); step 4: 1 -> 0, 2 -> 3 (0,3,1), 0 -> 2 (3,1)
    assert b.reuse_counts == [2, 0, 2, 1] and b.reuse_cold == 4
    t = s.total
    assert (t.layers, t.layer_steps, t.tokens, t.unused, t.union_mean, t.union_max) == (2, 8, 10, 0, 2.25, 3)
    assert t.reuse_counts == [4, 0, 4, 2] and t.reuse_cold == 8 and t.reuse_hist == {"0": 4, "2-3": 6}
    assert t.reuse_median == 2.0  # 0 0 0 0 2 | 2 2 2 3 3
    # previous token: layer 0 2 of 6 (above); layer 1 [1,2]->[0,3] 0, [3,1]->[1,2] 1, [1,2]->[1,0] 1: 2 of 6
    assert t.prev_token_hit == pytest.approx(4 / 12)
    assert t.top10_share == 0.4 and t.gini == pytest.approx(0.15)  # the layers' mean
    out = describe(s)
    assert "    all      10  0.400" in out and "4 first uses" not in out and "(10 reuses, 8 first uses" in out
    assert "            0         4  0.400  0.400\n            1         0  0.000  0.400\n          2-3         6  0.600  1.000" in out


def test_without_request_records_the_log_is_one_request(tmp_path: Path) -> None:
    s = trace_stats(_log(tmp_path / "one.qtrace", requests=False))
    assert s.requests == 1
    assert s.layers[0].prev_token_hit == pytest.approx(3 / 8)  # + [2,3]->[2,0]: 1 more hit, 1 more pair


def test_the_building_blocks() -> None:
    assert [bucket(d) for d in (0, 1, 2, 3, 4, 7, 8, 100)] == ["0", "1", "2-3", "2-3", "4-7", "4-7", "8-15", "64-127"]
    top, _, hn, gini = popularity(np.array([5, 5, 5, 5]))
    assert (top, hn, gini) == (0.25, 1.0, 0.0)
    _, _, _, gini = popularity(np.array([0, 0, 0, 8]))
    assert gini == pytest.approx(0.75)  # all on one of 4: (n - 1) / n
    sets = [np.array(s) for s in ([0], [1], [2], [0], [1], [1])]
    assert stack_distances(sets, 3).tolist() == [-1, -1, -1, 2, 2, 0]
    assert reuse_histogram(np.array([-1, 0, 0, 1, 2, 3, 4, 9, 100])) == {"0": 2, "1": 1, "2-3": 2, "4-7": 1, "8-15": 1,
                                                                         "64-127": 1}


def _distances_by_definition(sets: list[list[int]]) -> list[int]:
    """The distinct other experts used in the steps strictly between an expert's previous use and this one."""
    out = []
    for j, s in enumerate(sets):
        for e in s:
            prev = max((p for p in range(j) if e in sets[p]), default=-1)
            out.append(-1 if prev < 0 else len({f for q in range(prev + 1, j) for f in sets[q]}))
    return out


# fewer: the reference is a quadratic scan
@examples(60)
@given(st.integers(1, 12).flatmap(lambda n: st.lists(st.sets(st.integers(0, n - 1), min_size=1, max_size=n),
                                                     min_size=1, max_size=30).map(lambda s: (n, s))))
def test_stack_distances_are_the_definition(case: tuple[int, list[set[int]]]) -> None:
    n, sets = case
    lists = [sorted(s) for s in sets]
    got = stack_distances([np.asarray(s, dtype=np.int64) for s in lists], n)
    assert got.tolist() == _distances_by_definition(lists)
    warm = got[got >= 0]
    exact = np.bincount(warm).tolist()
    assert median_of_counts(exact) == (float(np.median(warm)) if len(warm) else -1.0)
    assert bin_counts(exact) == reuse_histogram(got)


def test_a_log_without_routes_or_with_a_bad_route_fails_naming_it(tmp_path: Path) -> None:
    w = trace.TraceWriter(tmp_path / "empty.qtrace", trace.Header(schema_version=1, fingerprint="x", model=SHAPE,
                                                                   clock_start_t=0.0, wall_start_unix_s=0.0,
                                                                   contents="routes"))
    w.close(0, 0.0)
    with pytest.raises(TraceSchemaError, match="no trace.route records"):
        trace_stats(tmp_path / "empty.qtrace")
    w = trace.TraceWriter(tmp_path / "bad.qtrace", trace.Header(schema_version=1, fingerprint="x", model=SHAPE,
                                                                 clock_start_t=0.0, wall_start_unix_s=0.0,
                                                                 contents="routes"))
    w.write(trace.Route(t=0.0, seq=0, step=1, layer=0, top_k=2, experts=(0, 1)))
    w.write(trace.Route(t=0.0, seq=1, step=1, layer=1, top_k=2, experts=(0, 7)))
    w.close(0, 0.0)
    with pytest.raises(TraceSchemaError, match=r"bad.qtrace: record 2 \(trace.route step 1\)"):
        trace_stats(tmp_path / "bad.qtrace")
    assert main(["trace", "stats", str(tmp_path / "bad.qtrace")]) == 2


def test_cli_stats_of_an_imported_real_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "raw.qtrace"
    assert main(["trace", "import", "mixtral-jsonl", str(DATA / "Mario928__speculative-moe" / "routing_raw.jsonl.gz"),
                 "-o", str(log)]) == 0
    capsys.readouterr()
    assert main(["trace", "stats", str(log), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["steps"] == 84 and s["tokens"] == 135 + 83 and len(s["layers"]) == 32 and len(s["cross_layer"]) == 31
    assert sum(x["tokens"] for x in s["layers"]) == 6777
    assert all(0 < x["hit_at_k"] <= 1 and x["test_tokens"] > 0 for x in s["cross_layer"])
    assert main(["trace", "stats", str(log)]) == 0
    out = capsys.readouterr().out
    assert "1 request(s), 84 steps" in out and "cross-layer hit@2" in out
    assert "\n    all    6777 " in out and "reuse distance, all layers" in out
    assert s["total"]["tokens"] == 6777 and s["total"]["layers"] == 32
    assert s["total"]["reuse_counts"] == np.sum([np.pad(x["reuse_counts"], (0, 8 - len(x["reuse_counts"])))
                                                 for x in s["layers"]], axis=0).tolist()
    assert sum(s["total"]["reuse_counts"]) + s["total"]["reuse_cold"] == sum(
        round(x["union_mean"] * x["layer_steps"]) for x in s["layers"])  # every use is cold or a reuse
    with pytest.raises(SystemExit) as e:
        main(["trace", "stats", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "usage: qnpipe trace stats" in out and "examples:" in out


def test_cli_stats_of_a_native_log(tmp_path: Path) -> None:
    from qnpipe.convert import convert
    from qnpipe.convert.tiny import make_tiny

    hf = make_tiny(tmp_path / "hf", layout="hf", seed=3,
                   config_overrides={"num_hidden_layers": 3, "full_attention_interval": 3, "num_experts": 16,
                                     "num_experts_per_tok": 2})
    convert(hf, tmp_path / "q")
    log = tmp_path / "run.qtrace"
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["generate", str(tmp_path / "q"), "--tokens", "5,6,7,8,9", "-n", "6",
                     "--set", "pool.expert_slots=4", "--trace", str(log)]) == 0
    s = trace_stats(log)
    header, _ = trace.read(log)
    assert header.model is not None and [x.layer for x in s.layers] == list(header.model.moe_layers)
    assert s.requests == 1 and s.tokens == 10 and all(x.tokens == 10 for x in s.layers)  # 5 prompt + 5 decoded
    assert s.layers[0].layer_steps == s.steps and sum(s.layers[0].reuse_hist.values()) + s.layers[0].reuse_cold \
        == sum(round(x.union_mean * x.layer_steps) for x in s.layers[:1])
