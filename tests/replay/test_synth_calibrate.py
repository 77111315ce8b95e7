"""`qnpipe trace synth --calibrate`: a log of the 80B's geometry (512 experts, top-10) fitted to llama.cpp
PR #27861's per-layer points, checked by `qnpipe replay --mrc` (the curve the planner allocates from)."""

from __future__ import annotations

import contextlib
import csv
import io
from pathlib import Path

import pytest

from qnpipe.cli import main
from qnpipe.errors import ConfigError
from qnpipe.replay.synth import SynthSpec, synth
from qnpipe.replay.synth_calibrate import parse_targets, zipf_share

POINTS = "lru:64=0.67,lru:128=0.81,hot:32=0.10"
# The tolerance held: the fitted point (LRU-64) to 0.01, the other LRU point to 0.035 (the generator's
# reuse depths are a grid), the hot list's learned share to 0.02 (fitted on 8 layers, a noisy measure).
FITTED_TOL, OTHER_TOL, HOT_TOL = 0.01, 0.035, 0.02


@pytest.mark.slow
def test_the_calibrated_logs_mrc_lands_on_the_published_points(tmp_path: Path) -> None:
    log, table = tmp_path / "80b.qtrace", tmp_path / "80b.mrc.csv"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["trace", "synth", "-o", str(log), "--layers", "8", "--experts", "512", "--top-k", "10",
                     "--tokens", "1000", "--seed", "1", "--calibrate", POINTS]) == 0
        assert main(["replay", str(log), "--mrc", "--mrc-policies", "lru", "--csv", str(table),
                     "--plot", str(tmp_path / "80b.mrc.png")]) == 0
    said = out.getvalue()
    assert "calibrated: --popularity zipf:" in said
    hot = float(said.split("hot:32: ")[1].split()[0])
    assert abs(hot - 0.10) <= HOT_TOL, said
    with table.open() as f:
        rate = {int(r["capacity"]): float(r["hit_rate"]) for r in csv.DictReader(f)
                if r["policy"] == "lru" and r["layer"] == "all"}
    assert abs(rate[64] - 0.67) <= FITTED_TOL, rate[64]
    assert abs(rate[128] - 0.81) <= OTHER_TOL, rate[128]


def test_targets_parse_and_bad_points_are_named() -> None:
    t = parse_targets(POINTS)
    assert t.lru == {64: 0.67, 128: 0.81} and (t.hot_k, t.hot_share) == (32, 0.10)
    for bad in ("lru:64", "lru:x=0.5", "lru:64=1.5", "hot:32=0.1", "foo:3=0.5", "lru:64=0.6,hot:1=0.2,hot:2=0.3"):
        with pytest.raises(ConfigError, match="--calibrate"):
            parse_targets(bad)
    assert zipf_share(0.0, 512, 32) == pytest.approx(32 / 512)


def test_a_reuse_depth_of_one_keeps_the_old_bytes_and_fingerprint() -> None:
    """Depth 1 draws nothing more and hashes as before: every older synthetic log and plan key holds."""
    import hashlib

    import msgspec

    spec = SynthSpec(layers=3, experts=16, top_k=2, tokens=20, seed=4, locality=0.5)
    old = {k: v for k, v in msgspec.to_builtins(spec).items() if k != "reuse_depth"}
    assert spec.digest() == hashlib.sha256(b"synth:" + msgspec.json.encode(old)).hexdigest()
    deep = msgspec.structs.replace(spec, reuse_depth=4)
    assert deep.digest() != spec.digest() and synth(deep) != synth(spec)
    assert all(len(set(x)) == 2 for row in synth(deep) for x in row)
