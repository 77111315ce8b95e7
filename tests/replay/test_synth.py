"""`qnpipe trace synth` (qnpipe.replay.synth): seeded bytes, and each knob doing what it says."""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import pytest

from qnpipe import trace
from qnpipe.cli import main
from qnpipe.errors import ConfigError, TraceSchemaError
from qnpipe.replay.synth import SynthSpec, read_popularity_table, synth, write_synth

RAW = Path("/work/shared/traces/raw/sarelWeinberger__qwen-hebrew-finetuning")
QWEN30B = RAW / "moe_all_layers_analysis_gsm_en_he_500_20250921_115824_avg_activation.csv"


def _reuse_distance(routes: list[list[tuple[int, ...]]], layer: int) -> float:
    """Median tokens between two uses of the same expert at `layer`."""
    last: dict[int, int] = {}
    gaps = []
    for t, row in enumerate(routes):
        for e in row[layer]:
            if e in last:
                gaps.append(t - last[e])
            last[e] = t
    return float(np.median(gaps))


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path: Path) -> None:
    spec = SynthSpec(layers=4, experts=32, top_k=4, tokens=50, seed=3, locality=0.3, cross_layer=0.4,
                     popularity="zipf:1.0")
    a = write_synth(tmp_path / "a.qtrace", spec).read_bytes()
    b = write_synth(tmp_path / "b.qtrace", spec).read_bytes()
    c = write_synth(tmp_path / "c.qtrace", msgspec.structs.replace(spec, seed=4)).read_bytes()
    assert a == b and a != c
    header, records = trace.read(tmp_path / "a.qtrace")
    assert header.model == trace.ModelShape(num_layers=4, moe_layers=(0, 1, 2, 3), num_experts=32, top_k=4,
                                            hidden_size=0)
    assert header.contents == "routes" and len(records) == 50 * 4
    assert all(isinstance(r, trace.Route) and len(set(r.experts)) == 4 for r in records)


def test_higher_locality_gives_shorter_reuse_distance() -> None:
    dist = [_reuse_distance(synth(SynthSpec(layers=2, experts=64, top_k=4, tokens=400, seed=1, locality=x)), 1)
            for x in (0.0, 0.4, 0.8)]
    assert dist[0] > dist[1] > dist[2]
    # with locality 0.8 most experts repeat the previous token's
    assert dist[2] == 1 and dist[0] > 8


def test_cross_layer_makes_the_next_layer_predictable() -> None:
    def top1_accuracy(y: float) -> float:
        routes = synth(SynthSpec(layers=2, experts=32, top_k=2, tokens=600, seed=2, cross_layer=y))
        counts = np.zeros((32, 32))
        for row in routes[:300]:  # learn on the first half
            for a, b in zip(row[0], row[1], strict=True):
                counts[a, b] += 1
        best = counts.argmax(axis=1)
        hits = sum(best[a] in row[1] for row in routes[300:] for a in row[0])
        return hits / (300 * 2)

    low, high = top1_accuracy(0.0), top1_accuracy(0.9)
    assert high > 0.8 and low < 0.3


def test_popularity_follows_the_qwen3_30b_table() -> None:
    table = read_popularity_table(QWEN30B)
    assert table.shape == (48, 128) and np.allclose(table.sum(axis=1), 8, atol=0.05)  # top-8 one-hot means
    routes = synth(SynthSpec(layers=48, experts=128, top_k=8, tokens=1000, seed=5, popularity=str(QWEN30B)))
    for layer in (0, 20, 47):
        freq = np.bincount([e for row in routes for e in row[layer]], minlength=128) / 1000
        assert np.corrcoef(freq, table[layer])[0, 1] > 0.9, layer
        assert np.argmax(freq) == np.argmax(table[layer])


def test_zipf_popularity_is_skewed_and_stretches_a_table_to_any_shape() -> None:
    routes = synth(SynthSpec(layers=1, experts=64, top_k=2, tokens=500, seed=0, popularity="zipf:1.5"))
    freq = np.sort(np.bincount([e for row in routes for e in row[0]], minlength=64))[::-1]
    assert freq[0] > 10 * max(freq[32], 1)
    big = synth(SynthSpec(layers=3, experts=512, top_k=10, tokens=5, seed=0, popularity=str(QWEN30B)))
    assert len(big) == 5 and all(len(r) == 3 and all(len(set(x)) == 10 for x in r) for r in big)


def test_bad_knobs_and_tables_fail_naming_what(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="locality=1.5"):
        synth(SynthSpec(locality=1.5))
    with pytest.raises(ConfigError, match="top_k=9"):
        synth(SynthSpec(experts=8, top_k=9))
    with pytest.raises(ConfigError, match="zipf:A"):
        synth(SynthSpec(popularity="zipf:x"))
    bad = tmp_path / "bad.csv"
    bad.write_text("Layer,Language,Expert_0,Expert_1\n0,en,0.5,0.5\n1,en,0.5,oops\n")
    with pytest.raises(TraceSchemaError, match=r"bad.csv: row 3"):
        read_popularity_table(bad)
    with pytest.raises(TraceSchemaError, match="no 'Layer' column"):
        bad.write_text("a,b\n1,2\n")
        read_popularity_table(bad)


def test_cli_trace_synth_writes_a_replayable_log(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "s.qtrace"
    assert main(["trace", "synth", "-o", str(out), "--layers", "3", "--experts", "16", "--top-k", "2",
                 "--tokens", "20", "--seed", "1", "--locality", "0.5", "--popularity", "zipf:1"]) == 0
    assert "20 steps x 3 MoE layers" in capsys.readouterr().out
    assert main(["replay", str(out), "--set", "replay.record_nbytes=1000", "--set", "pool.expert_slots=4"]) == 0
    assert "replay of" in capsys.readouterr().out
    assert main(["trace", "synth", "-o", str(out), "--cross-layer", "-1"]) == 2
    assert "cross_layer=-1.0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["trace", "synth", "--help"])
    assert e.value.code == 0
    assert "examples:" in capsys.readouterr().out
