"""Each importer on the real traces: the log reads back with the right shape, requests and counts."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
from real_traces import MARIO, TOTANI, WEIRAN

from qnpipe import trace
from qnpipe.replay import load_log
from qnpipe.trace.importers import import_log, vllm_jsonl
from qnpipe.trace.importers.common import MIXTRAL_8X7B, QWEN15_MOE_A27B
from qnpipe.trace.importers.torch_zip import load as load_pt


def _read(path: Path) -> tuple[trace.Header, list[trace.RequestStart], list[trace.Route]]:
    header, records, footer = trace.read_all(path)
    assert footer.records == len(records)
    starts = [r for r in records if isinstance(r, trace.RequestStart)]
    routes = [r for r in records if isinstance(r, trace.Route)]
    assert len(starts) + len(routes) == len(records)
    return header, starts, routes


def _tokens(r: trace.Route) -> int:
    return len(r.experts) // r.top_k


def test_mixtral_per_layer_counters_become_one_request_per_problem(tmp_path: Path) -> None:
    src = MARIO / "humaneval_2_routing.jsonl.gz"
    s = import_log("mixtral-jsonl", src, tmp_path / "he.qtrace")
    header, starts, routes = _read(tmp_path / "he.qtrace")
    assert header.model == MIXTRAL_8X7B and header.contents == "routes" and header.layers == tuple(range(32))
    assert header.fingerprint.startswith("import:")
    assert [(x.request, x.name, x.first_step) for x in starts] == [(0, "humaneval/0", 1), (1, "humaneval/1", 84)]
    # 10,779 source records, one token each; problems of 83 and 255 tokens at their longest layer
    assert s.token_routes == sum(map(_tokens, routes)) == 10_779 and all(_tokens(r) == 1 for r in routes)
    assert s.steps == max(r.step for r in routes) == 83 + 255 and s.requests == 2
    assert s.skipped == {next(iter(s.skipped)): 338 * 32 - 10_779}  # the logger's dropped (token, layer) pairs
    first = json.loads(gzip.open(src).readline())
    assert routes[0].layer == 0 and list(routes[0].experts) == first["experts"]
    assert list(routes[0].weights) == pytest.approx(first["gating_probs"])
    assert all(abs(sum(r.weights) - 1) < 1e-5 for r in routes)  # renormalised top-2


def test_mixtral_raw_log_keeps_the_prefill_as_one_step_and_the_exact_gaps(tmp_path: Path) -> None:
    s = import_log("mixtral-jsonl", MARIO / "routing_raw.jsonl.gz", tmp_path / "raw.qtrace")
    _, starts, routes = _read(tmp_path / "raw.qtrace")
    assert len(starts) == 1 and starts[0].name == "humaneval/0"
    prefill = {r.layer: _tokens(r) for r in routes if r.step == 1}
    # the 135-token prompt, less the tokens the logger dropped at each layer (exact: token_pos has gaps)
    assert len(prefill) == 32 and prefill[0] == 135 and prefill[1] == 128 and prefill[6] == 124
    assert all(_tokens(r) == 1 for r in routes if r.step > 1)
    assert s.steps == 84 and s.token_routes == 6777 == sum(map(_tokens, routes))
    assert sum(s.skipped.values()) == 135 * 32 + 83 * 32 - 6777
    decode_layers = [sum(1 for r in routes if r.step == st) for st in range(2, 85)]
    assert max(decode_layers) == 32 and sum(decode_layers) == 6777 - sum(prefill.values())


@pytest.mark.slow
@pytest.mark.parametrize("name", ["moe_layer0", "moe_layer8", "moe_layer12", "moe_layer18", "moe_layer23"])
def test_vllm_logger_rows_become_25_requests_without_the_dummy_passes(name: str, tmp_path: Path) -> None:
    s = import_log("vllm-jsonl", WEIRAN / f"{name}.jsonl.gz", tmp_path / "v.qtrace")
    header, starts, routes = _read(tmp_path / "v.qtrace")
    layer = int(name.removeprefix("moe_layer"))
    assert header.model == QWEN15_MOE_A27B and header.layers == (layer,)
    # 82 passes of all 25 rows: row i is request i, one token per pass, requests one after another
    assert [x.first_step for x in starts] == [1 + 82 * i for i in range(25)] and s.steps == 25 * 82
    assert all(r.layer == layer and _tokens(r) == 1 for r in routes) and len(routes) == 2050
    assert s.skipped[vllm_jsonl.DUMMY] == 8192 + 256
    assert s.skipped[vllm_jsonl.BEFORE] == 65 + 1406  # warm-up and the batched prefill
    assert 2050 + sum(s.skipped.values()) == 12_805  # every route row is imported or counted
    rows = [json.loads(line) for line in gzip.open(WEIRAN / f"{name}.jsonl.gz")][1:]
    first_decode = 8192 + 256 + 65 + 1406
    assert list(routes[1].experts) == rows[first_decode + 25]["topk_ids"]  # request 0, its second token


def test_vllm_file_of_two_runs_gives_each_run_its_requests(tmp_path: Path) -> None:
    s = import_log("vllm-jsonl", TOTANI, tmp_path / "t.qtrace")
    _, starts, routes = _read(tmp_path / "t.qtrace")
    assert s.requests == 50 and [x.name for x in starts[24:26]] == ["run 0 row 24", "run 1 row 0"]
    assert s.steps == len(routes) == 50 * 33
    assert s.token_routes + sum(s.skipped.values()) == 18_818


def test_flame_sequences_become_requests_of_one_token_per_step(flame_dir: Path, tmp_path: Path) -> None:
    src = flame_dir / "Encoder_Batch_0-32"
    s = import_log("flame-pt", src, tmp_path / "f.qtrace")
    header, starts, routes = _read(tmp_path / "f.qtrace")
    assert header.model is not None and header.model.num_experts == 64 and header.model.top_k == 6
    assert header.layers == tuple(range(2, 10)) and s.requests == 32 and s.steps == 32 * 64
    assert len(routes) == 32 * 64 * 8 and all(_tokens(r) == 1 for r in routes) and not s.skipped
    pt = load_pt(next((src / "Layer_5").glob("*.pt")))
    assert pt["indices"].shape == (2048, 6) and pt["num_sequences"] == 32
    # sequence 1, token 3 of layer 5: row 1*64+3 of the capture, in step 64+3+1
    r = next(r for r in routes if r.step == 68 and r.layer == 5)
    assert list(r.experts) == pt["indices"][67].tolist()
    assert list(r.weights) == pytest.approx(pt["scores"][67].tolist())
    mass = [sum(x.weights) for x in routes]
    assert 0 < min(mass) and max(mass) < 0.95  # the top-6's softmax mass, not renormalised


def test_flame_token_positions_stack_into_requests(flame_dir: Path, tmp_path: Path) -> None:
    s = import_log("flame-pt", flame_dir / "Decoder_Batch_0-64", tmp_path / "d.qtrace")
    _, starts, routes = _read(tmp_path / "d.qtrace")
    assert s.requests == 64 and s.steps == 640 and len(routes) == 640 * 8
    third = load_pt(next((flame_dir / "Decoder_Batch_0-64" / "3rd" / "Layer_9").glob("*.pt")))
    assert third["token_position"] == 2
    r = next(r for r in routes if r.step == starts[7].first_step + 2 and r.layer == 9)  # sequence 7, position 2
    assert list(r.experts) == third["indices"][7].tolist()


def test_an_imported_log_loads_for_replay_and_max_steps_cuts_it(tmp_path: Path) -> None:
    s = import_log("mixtral-jsonl", MARIO / "routing_raw.jsonl.gz", tmp_path / "cut.qtrace", max_steps=5)
    log = load_log(tmp_path / "cut.qtrace")
    assert s.steps == len(log.steps) == 5 and log.shape == MIXTRAL_8X7B and not log.record_nbytes
    assert any("after step 5" in k for k in s.skipped)


def test_progress_is_told_every_byte_of_the_source(tmp_path: Path) -> None:
    seen: list[int] = []
    src = WEIRAN / "moe_layer0.jsonl.gz"
    import_log("vllm-jsonl", src, tmp_path / "p.qtrace", progress=seen.append)
    assert sum(seen) == src.stat().st_size and len(seen) > 2


def test_vllm_rows_are_requests_their_tokens_share_experts_over_time(tmp_path: Path) -> None:
    import_log("vllm-jsonl", WEIRAN / "moe_layer23.jsonl.gz", tmp_path / "l23.qtrace")
    _, _, routes = _read(tmp_path / "l23.qtrace")
    tokens = np.asarray([r.experts for r in routes]).reshape(25, 82, 4)  # request, step, top-4

    def overlap(a: np.ndarray, b: np.ndarray) -> float:
        return float((a[..., :, None] == b[..., None, :]).sum() / a.size)

    same = overlap(tokens[:, :-1], tokens[:, 1:])  # a request's token and its next
    other = overlap(tokens[:, :-1], np.roll(tokens, -1, axis=0)[:, 1:])  # ... and the next row's next
    assert same > 0.12 and other < 0.09  # measured 0.130 and 0.081: row i of every pass is one request


def test_the_two_mixtral_files_of_one_run_agree_token_for_token(tmp_path: Path) -> None:
    # humaneval_2's problem 0 and routing_raw are the same generation of HumanEval/0 (83 decoded tokens).
    import_log("mixtral-jsonl", MARIO / "humaneval_2_routing.jsonl.gz", tmp_path / "he.qtrace")
    import_log("mixtral-jsonl", MARIO / "routing_raw.jsonl.gz", tmp_path / "raw.qtrace")
    _, _, he = _read(tmp_path / "he.qtrace")
    _, _, raw = _read(tmp_path / "raw.qtrace")
    full = 0
    for layer in range(32):
        counted = [r.experts for r in he if r.layer == layer and r.step <= 83]  # token_idx order
        exact = {r.step - 2: r.experts for r in raw if r.layer == layer and r.step > 1}  # decode token -> route
        agree = [counted[i] == exact[i] for i in range(len(counted)) if i in exact]
        if len(counted) == 83:  # this layer lost no token in humaneval_2: the raw log's steps line up exactly
            full += 1
            assert all(agree) and len(agree) == len(exact), layer
        else:  # a lost token shifts the rest (the token_idx caveat): they disagree from there on
            assert not all(agree), layer
    assert full == 25
