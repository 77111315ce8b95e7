"""`qnpipe plan` on the tiny model: the plan printed and written, the plot drawn, bad input a clean error."""

from __future__ import annotations

from pathlib import Path

import pytest

from qnpipe.cli import main
from qnpipe.plan import load_plan


def test_plan_writes_prints_and_plots(tiny_qn4: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    # 2GB: above the 1 GiB buffer-cache line and this (test) process's own resident set, the account's
    # "process outside MLX" line, measured (~150 MiB under pytest).
    assert main(["plan", str(tiny_qn4), "--memory", "2GB", "--context", "512", "-o", str(out), "--plot", str(png),
                 "--window-layer-steps", "800"]) == 0
    text = capsys.readouterr()
    plan = load_plan(out)
    assert "synthetic log" in text.err and (tmp_path / "plan.json.synth.qtrace").exists()
    assert f"{plan.predicted_tok_s:.3f} tok/s" in text.out and "memory account" in text.out
    assert "non-expert weights" in text.out and "KV cache" in text.out
    assert "activations" in text.out and "reader buffers" in text.out and "process outside MLX" in text.out
    lines = {x.name: x for x in plan.account.lines}
    assert lines["process outside MLX"].nbytes > 0 and "measured in this process" in lines["process outside MLX"].source
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(("argv", "says"), [
    (["--memory", "1MB"], "smallest budget that fits"),
    (["--memory", "lots"], "--memory='lots'"),
    (["--memory", "2GB", "--device", "nowhere.json"], "--device nowhere.json"),
])
def test_bad_input_is_one_line(tiny_qn4: Path, argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(tiny_qn4), *argv]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


def test_ranks_plans_each_ranks_layers_and_the_pipeline(tiny_qn4: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    pinned = ["--set", f"plan.process_bytes={100 * 2**20}"]  # measured, it would be this test process's size
    assert main(["plan", str(tiny_qn4), "--memory", "1.2GB", "--context", "512", "--ranks", "2", "-o", str(out),
                 "--window-layer-steps", "800", "-q", *pinned]) == 0
    text = capsys.readouterr().out
    plans = [load_plan(tmp_path / f"plan.rank{r}.json") for r in range(2)]
    assert [p.share.rank if p.share else None for p in plans] == [0, 1]
    assert sorted(ly for p in plans for ly in p.capacities) == list(range(8))  # each layer on one rank
    for p in plans:
        assert p.share is not None and all(p.share.holds(ly) for ly in p.capacities)
        assert f"{p.share.label} of 2 in 1.20 GiB" in text and p.account.total <= p.memory_bytes
    pipeline = 1 / sum(1 / p.predicted_tok_s for p in plans)
    assert f"pipeline of 2 ranks in 1.20 GiB each: predicted {pipeline:.3f} tok/s" in text
    assert main(["plan", str(tiny_qn4), "--memory", "100MB", "--context", "512", "--ranks", "2", "-q", *pinned]) == 2
    err = capsys.readouterr().err
    assert "on rank 1 (layers 4-7) of 2: below the smallest budget that fits its share" in err
    assert len(err.strip().splitlines()) == 1
