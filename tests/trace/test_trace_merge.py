"""`qnpipe trace merge`: the per-rank logs of a distributed run read as the log of one process."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

from qnpipe import config, trace
from qnpipe.cli import main
from qnpipe.errors import TraceSchemaError
from qnpipe.replay import replay
from qnpipe.replay.runner import load_log, to_json
from qnpipe.replay.synth import SynthSpec, write_synth
from qnpipe.trace.merge import merge, rank_of

SPEC = SynthSpec(layers=4, experts=8, top_k=2, tokens=30, seed=3, locality=0.3)


def _split(whole: Path, tmp: Path, cuts: list[range], clocks: list[tuple[float, float]],
           contents: str = "routes") -> list[Path]:
    """`whole`'s records cut by layer into one log per rank; rank r's clock reads `t - wall + clock_start`."""
    header, records, _ = trace.read_all(whole)
    paths = []
    for rank, (layers, (clock0, wall0)) in enumerate(zip(cuts, clocks, strict=True)):
        h = trace.Header(schema_version=1, fingerprint=f"rank{rank}", model=header.model, clock_start_t=clock0,
                         wall_start_unix_s=wall0, contents=contents, capacities={layer: 4 for layer in layers})
        p = tmp / f"run.rank{rank}.qtrace"
        w = trace.TraceWriter(p, h)
        for r in records:
            if getattr(r, "layer", -1) in layers:
                # the whole log's time t is wall-clock t: this rank's clock reads it shifted
                w.write(type(r)(**{**{f: getattr(r, f) for f in r.__struct_fields__}, "t": r.t - wall0 + clock0}))
        w.close(rank, 1000.0 - wall0 + clock0)
        paths.append(p)
    return paths


def _timed(tmp: Path) -> Path:
    """The synthetic log with each route timed as a pipeline would: step s, layer l at s + l / 10 seconds."""
    plain = write_synth(tmp / "plain.qtrace", SPEC)
    header, records, _ = trace.read_all(plain)
    out = tmp / "whole.qtrace"
    w = trace.TraceWriter(out, header)
    for r in records:
        assert isinstance(r, trace.Route)
        w.write(trace.Route(t=r.step + r.layer / 10, seq=r.seq, step=r.step, layer=r.layer, top_k=r.top_k,
                            experts=r.experts))
    w.close(0, 1000.0)
    return out


def test_merged_ranks_replay_as_the_whole_log(tmp_path: Path) -> None:
    whole = _timed(tmp_path)
    # ranks opened their logs at different wall times, each clock with its own origin
    parts = _split(whole, tmp_path, [range(0, 1), range(1, 3), range(3, 4)],
                   [(5.0, 0.25), (-40.0, 0.5), (1e6, 0.75)])
    out = tmp_path / "merged.qtrace"
    m = merge(list(reversed(parts)), out)  # the ranks come from the names, not the order given
    assert m.ranks == (2, 1, 0) and m.records == SPEC.tokens * SPEC.layers and m.dropped == 0 + 1 + 2
    header, records, footer = trace.read_all(out)
    assert header.capacities == {0: 4, 1: 4, 2: 4, 3: 4} and header.contents == "routes"
    assert footer.dropped == 3
    # every record back at its own time on rank 0's clock (origin 5.0, opened at wall 0.25)
    want = [(r.t - 0.25 + 5.0, getattr(r, "layer", None)) for r in trace.read(whole)[1]]
    assert [getattr(r, "layer", None) for r in records] == [layer for _, layer in want]
    assert [r.t for r in records] == pytest.approx([t for t, _ in want], abs=1e-9)
    assert load_log(out).steps == load_log(whole).steps
    cfg = config.load(None, overrides={"pool.expert_slots": 3})
    a, b = replay(out, cfg, record_nbytes=4096), replay(whole, cfg, record_nbytes=4096)
    assert to_json(a).replace(str(out).encode(), b"L") == to_json(b).replace(str(whole).encode(), b"L")


def test_ties_go_to_the_lower_rank(tmp_path: Path) -> None:
    whole = _timed(tmp_path)
    # both ranks hold their records at the same instants: rank 0's come first
    header, records, _ = trace.read_all(whole)
    same = tmp_path / "same.qtrace"
    w = trace.TraceWriter(same, header)
    for r in records:
        assert isinstance(r, trace.Route)
        w.write(trace.Route(t=float(r.step), seq=r.seq, step=r.step, layer=r.layer, top_k=2, experts=r.experts))
    w.close(0, 1000.0)
    parts = _split(same, tmp_path, [range(2, 4), range(0, 2)], [(0.0, 0.0), (0.0, 0.0)])
    merge([parts[1], parts[0]], tmp_path / "m.qtrace")
    layers = [getattr(r, "layer", None) for r in trace.read(tmp_path / "m.qtrace")[1]][:4]
    assert layers == [2, 3, 0, 1]


def test_rank_from_name() -> None:
    assert rank_of(Path("run.rank12.qtrace")) == 12 and rank_of(Path("run.qtrace")) is None
    assert rank_of(Path("dir.rank1/run.qtrace")) is None


def test_logs_of_different_runs_are_refused(tmp_path: Path) -> None:
    whole = _timed(tmp_path)
    a, b = _split(whole, tmp_path, [range(0, 2), range(1, 4)], [(0.0, 0.0), (0.0, 0.0)])
    with pytest.raises(TraceSchemaError, match=r"layer 1 is also in .*rank0"):
        merge([a, b], tmp_path / "m.qtrace")
    other = write_synth(tmp_path / "other.rank1.qtrace", SynthSpec(layers=4, experts=16, top_k=2, tokens=3))
    with pytest.raises(TraceSchemaError, match="other.rank1.qtrace: its model shape differs"):
        merge([a, other], tmp_path / "m.qtrace")
    (tmp_path / "ev").mkdir()
    (ev,) = _split(whole, tmp_path / "ev", [range(2, 4)], [(0.0, 0.0)], contents="events")
    with pytest.raises(TraceSchemaError, match="holds 'events' where"):
        merge([a, ev], tmp_path / "m.qtrace")
    with pytest.raises(TraceSchemaError, match="two ranks or more"):
        merge([a], tmp_path / "m.qtrace")
    assert not (tmp_path / "m.qtrace").exists() and not (tmp_path / "m.qtrace.partial").exists()


def test_cli(tmp_path: Path) -> None:
    whole = _timed(tmp_path)
    parts = _split(whole, tmp_path, [range(0, 2), range(2, 4)], [(0.0, 0.0), (3.0, 1.0)])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["trace", "merge", *map(str, parts), "-o", str(tmp_path / "m.qtrace")]) == 0
    assert f"{SPEC.tokens * SPEC.layers} records of ranks 0, 1" in out.getvalue()
    assert load_log(tmp_path / "m.qtrace").steps == load_log(whole).steps
