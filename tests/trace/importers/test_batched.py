"""`batched`: a batched source replayed as multi-token steps (the forward passes as they ran), not request by request."""

from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path

import pytest
from real_traces import MARIO, TOTANI, WEIRAN

from qnpipe import trace
from qnpipe.errors import TraceImportError
from qnpipe.replay import load_log
from qnpipe.trace.importers import import_log, vllm_jsonl


def _routes(path: Path) -> list[trace.Route]:
    _, records = trace.read(path)
    return [r for r in records if isinstance(r, trace.Route)]


def test_vllm_batched_keeps_every_real_pass_as_one_step_of_its_rows(tmp_path: Path) -> None:
    src = WEIRAN / "moe_layer0.jsonl.gz"
    s = import_log("vllm-jsonl", src, tmp_path / "b.qtrace", batched=True)
    routes = _routes(tmp_path / "b.qtrace")
    tokens = [len(r.experts) // 4 for r in routes]
    # the 65-row pass, the 1,406-token prefill of the 25 prompts, then 127 decode passes: 82 of all 25 rows
    assert (s.requests, s.steps, s.batched) == (1, 129, True) and tokens[:2] == [65, 1406]
    assert Counter(tokens[2:])[25] == 82 and tokens[2:] == sorted(tokens[2:], reverse=True)
    assert s.skipped == {vllm_jsonl.DUMMY: 8192 + 256}  # nothing else left out
    assert s.token_routes + 8192 + 256 == 12_805
    rows = [json.loads(line) for line in gzip.open(src)][1:]
    first_decode = 8192 + 256 + 65 + 1406
    assert list(routes[2].experts) == [e for r in rows[first_decode:first_decode + 25] for e in r["topk_ids"]]
    # the per-request import is these passes' rows regrouped: request i's token t is row i of decode pass t
    import_log("vllm-jsonl", src, tmp_path / "r.qtrace")
    per_request = _routes(tmp_path / "r.qtrace")
    assert per_request[82 * 7 + 5].experts == routes[2 + 5].experts[7 * 4:8 * 4]
    log = load_log(tmp_path / "b.qtrace")  # replay reads the multi-token steps
    assert len(log.steps) == 129


def test_vllm_batched_file_of_two_runs_is_two_requests(tmp_path: Path) -> None:
    s = import_log("vllm-jsonl", TOTANI, tmp_path / "t.qtrace", batched=True)
    assert s.requests == 2 and s.token_routes + sum(s.skipped.values()) == 18_818
    assert list(s.skipped) == [vllm_jsonl.DUMMY]


def test_flame_batched_runs_the_sequences_in_lockstep(flame_dir: Path, tmp_path: Path) -> None:
    src = flame_dir / "Encoder_Batch_0-32"
    s = import_log("flame-pt", src, tmp_path / "b.qtrace", batched=True)
    batch = _routes(tmp_path / "b.qtrace")
    assert (s.requests, s.steps) == (1, 64) and all(len(r.experts) == 32 * 6 for r in batch)
    import_log("flame-pt", src, tmp_path / "r.qtrace")
    one = {(r.step, r.layer): r for r in _routes(tmp_path / "r.qtrace")}
    # step t of the batch, layer 5: sequence q's token t (step q * 64 + t + 1 of the request-by-request log)
    r = next(x for x in batch if x.step == 4 and x.layer == 5)
    for q in (0, 9, 31):
        assert r.experts[q * 6:(q + 1) * 6] == one[(q * 64 + 3 + 1, 5)].experts
        assert r.weights[q * 6:(q + 1) * 6] == one[(q * 64 + 3 + 1, 5)].weights
    d = import_log("flame-pt", flame_dir / "Decoder_Batch_0-64", tmp_path / "d.qtrace", batched=True)
    assert (d.requests, d.steps, d.token_routes) == (1, 10, 10 * 64 * 8)


def test_batched_is_refused_where_the_source_does_not_say_what_ran_together(tmp_path: Path) -> None:
    with pytest.raises(TraceImportError, match=r"routing_raw.jsonl.gz: --batched does not apply to mixtral-jsonl"):
        import_log("mixtral-jsonl", MARIO / "routing_raw.jsonl.gz", tmp_path / "x.qtrace", batched=True)
    (tmp_path / "r.csv").write_text("step,layer,expert\n1,0,1\n")
    with pytest.raises(TraceImportError, match=r"r.csv: --batched does not apply to csv"):
        import_log("csv", tmp_path / "r.csv", tmp_path / "x.qtrace", batched=True)


def test_the_five_vllm_runs_have_the_same_passes_batched_and_merge(tmp_path: Path) -> None:
    # five runs of the same prompts and seed at temperature 0: every pass the same size at every logged layer
    s = import_log("vllm-jsonl", WEIRAN, tmp_path / "b.qtrace", batched=True)
    assert (s.requests, s.steps, s.layers, s.token_routes) == (1, 129, (0, 8, 12, 18, 23), 5 * 4357)
    assert s.skipped == {vllm_jsonl.DUMMY: 5 * (8192 + 256)}
