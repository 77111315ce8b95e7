"""The event log, written by a real `qnpipe generate --trace` on a streamed tiny model and read back typed."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

from qnpipe import config, trace
from qnpipe.cli import main
from qnpipe.errors import TraceSchemaError
from qnpipe.messages import Acquire, ForwardDone, Granted, ReadDone, ReadExpert, Release

SHAPE = {"num_hidden_layers": 3, "full_attention_interval": 3, "num_experts": 16, "num_experts_per_tok": 2}
SLOTS = "4"  # 16 experts, top-2: misses and evictions every step


@pytest.fixture(scope="module")
def streamed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from qnpipe.convert import convert
    from qnpipe.convert.tiny import make_tiny

    root = tmp_path_factory.mktemp("trace-model")
    hf = make_tiny(root / "hf", layout="hf", seed=3, config_overrides=SHAPE)
    convert(hf, root / "q")
    return root / "q"


def _generate(model: Path, *extra: str) -> None:
    assert main(["generate", str(model), "--tokens", "5,6,7,8,9", "-n", "4", "--json",
                 "--set", f"pool.expert_slots={SLOTS}", *extra]) == 0


@pytest.fixture(scope="module")
def logged(streamed: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("trace") / "run.qtrace"
    _generate(streamed, "--trace", str(path))
    return path


def test_generate_trace_writes_a_typed_log_with_header_and_no_drops(logged: Path, streamed: Path) -> None:
    header, records, footer = trace.read_all(logged)
    assert not logged.with_name(logged.name + ".partial").exists()
    assert header.schema_version == trace.SCHEMA_VERSION
    assert header.contents == "events"
    assert header.model is not None
    assert (header.model.num_layers, header.model.num_experts, header.model.top_k) == (3, 16, 2)
    assert header.model.moe_layers and header.capacities == {layer: 4 for layer in header.model.moe_layers}
    assert header.wall_start_unix_s > 1.6e9
    cfg = config.load(None, overrides={"pool.expert_slots": SLOTS, "trace.event_log_path": str(logged),
                                       "model.model_dir": str(streamed)})
    assert header.fingerprint == cfg.fingerprint()
    assert footer.dropped == 0 and footer.records == len(records)
    kinds = {type(r) for r in records}
    assert {trace.Route, Acquire, Granted, Release, ForwardDone, ReadExpert, trace.ReadStarted, ReadDone,
            trace.Evicted, trace.Stalled} <= kinds
    # one iterator pass sees the same records
    it = list(trace.iter_records(logged))
    assert it[0] == header and it[-1] == footer and it[1:-1] == records


def test_read_times_are_ordered_and_every_grant_follows_its_acquire(logged: Path) -> None:
    _, records = trace.read(logged)
    done = [r for r in records if isinstance(r, ReadDone)]
    assert done
    for r in done:
        assert r.issued_t <= r.started_t <= r.t
    acquired = {(r.step, r.layer, r.part): r for r in records if isinstance(r, Acquire)}
    grants = [r for r in records if isinstance(r, Granted)]
    assert grants and len(grants) == len(acquired)
    for g in grants:
        a = acquired[(g.step, g.layer, g.part)]
        assert a.t <= g.t and a.experts == g.experts
    stalls = [r for r in records if isinstance(r, trace.Stalled)]
    assert len(stalls) == sum(g.misses > 0 for g in grants)
    # the canonical order sorts by time, and keeps every record
    ordered = trace.canonical(records)
    assert [r.t for r in ordered] == sorted(r.t for r in records) and len(ordered) == len(records)


def test_route_records_match_the_acquires_and_carry_the_gate_weights(logged: Path) -> None:
    _, records = trace.read(logged)
    acquired: dict[tuple[int, int], set[int]] = defaultdict(set)
    for r in records:
        if isinstance(r, Acquire):
            acquired[(r.step, r.layer)] |= set(r.experts)
    routes = [r for r in records if isinstance(r, trace.Route)]
    assert routes and len(routes) == len(acquired)
    for r in routes:
        assert r.top_k == 2 and len(r.experts) % 2 == 0 and len(r.weights) == len(r.experts)
        assert set(r.experts) == acquired[(r.step, r.layer)]
        for i in range(0, len(r.weights), 2):  # norm_topk_prob: each token's weights sum to 1
            assert sum(r.weights[i:i + 2]) == pytest.approx(1.0, abs=1e-5)
    # every layer routed the 5 prompt tokens (in prefill chunks) and the decode steps one token each
    first = routes[0].layer
    assert sum(len(r.experts) // 2 for r in routes if r.layer == first) >= 5
    assert 1 in {len(r.experts) // 2 for r in routes}


def test_evictions_name_the_slot_the_read_then_fills(logged: Path) -> None:
    _, records = trace.read(logged)
    for i, r in enumerate(records):
        if isinstance(r, trace.Evicted):
            nxt = records[i + 1]
            assert isinstance(nxt, ReadExpert)
            assert (nxt.layer, nxt.slot, nxt.expert) == (r.layer, r.slot, r.for_expert) and r.expert != r.for_expert


def test_a_truncated_log_fails_naming_the_file_and_the_record(logged: Path, tmp_path: Path) -> None:
    data = logged.read_bytes()
    cut = tmp_path / "cut.qtrace"
    cut.write_bytes(data[:len(data) // 2])
    with pytest.raises(TraceSchemaError, match=r"cut\.qtrace: truncated at record \d+"):
        trace.read(cut)
    # cut exactly at a frame boundary: the footer is missing
    header_end = len(trace.MAGIC) + 4 + int.from_bytes(data[8:12], "little")
    cut.write_bytes(data[:header_end])
    with pytest.raises(TraceSchemaError, match=r"cut\.qtrace: truncated after record 0: no footer"):
        trace.read(cut)


def test_a_corrupt_record_fails_naming_its_number(logged: Path, tmp_path: Path) -> None:
    data = bytearray(logged.read_bytes())
    header_end = len(trace.MAGIC) + 4 + int.from_bytes(data[8:12], "little")
    size = int.from_bytes(data[header_end:header_end + 4], "little")
    data[header_end + 4:header_end + 4 + size] = b"\xc1" * size  # 0xc1: never used in msgpack
    bad = tmp_path / "bad.qtrace"
    bad.write_bytes(bytes(data))
    with pytest.raises(TraceSchemaError, match=r"bad\.qtrace: record 1 is corrupt"):
        trace.read(bad)


def test_a_newer_schema_version_fails(tmp_path: Path) -> None:
    path = tmp_path / "new.qtrace"
    w = trace.TraceWriter(path, trace.Header(schema_version=trace.SCHEMA_VERSION + 1, fingerprint="x", model=None,
                                             clock_start_t=0.0, wall_start_unix_s=0.0, contents="events"))
    w.close(dropped=0, clock_end_t=0.0)
    with pytest.raises(TraceSchemaError, match=rf"new\.qtrace: schema version {trace.SCHEMA_VERSION + 1} is newer"):
        trace.read(path)
    path.write_bytes(b"not a trace")
    with pytest.raises(TraceSchemaError, match="not a qnpipe trace"):
        trace.read(path)


def test_the_routing_log_holds_only_the_routes_of_its_layers(streamed: Path, tmp_path: Path) -> None:
    path = tmp_path / "routes.qtrace"
    _generate(streamed, "--set", "trace.route_trace=1", "--set", f"trace.route_trace_path={path}",
              "--set", "trace.route_trace_layers=1")
    header, records = trace.read(path)
    assert header.contents == "routes" and header.layers == (1,)
    assert records and all(isinstance(r, trace.Route) and r.layer == 1 for r in records)


def test_no_trace_configured_runs_no_recorder(streamed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import qnpipe.actors.recorder as rec

    def boom(*a: object, **k: object) -> None:
        raise AssertionError("a recorder ran without a trace configured")

    monkeypatch.setattr(rec, "recorder", boom)
    monkeypatch.setattr(rec, "TraceWriter", boom)
    monkeypatch.chdir(tmp_path)
    _generate(streamed)
    assert list(tmp_path.iterdir()) == []
