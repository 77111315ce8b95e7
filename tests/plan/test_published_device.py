"""Published device profiles (qnpipe/data/devices/): every figure names its public source, `qnpipe plan
--device m5` plans the 80B's shape with the profile's own cost, and a bad file is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from qnpipe.errors import ConfigError, DeviceProfileError
from qnpipe.plan import make_plans
from qnpipe.plan import published as pub
from qnpipe.replay.synth import SynthSpec, write_synth

SHAPE = Path(__file__).parent / "data" / "qwen3-next-80b-a3b.config.json"


@pytest.mark.parametrize("name", ["m5", "m5-seed-reads"])
def test_every_figure_of_a_published_profile_names_its_source(name: str) -> None:
    dev = pub.load_published(name)
    assert name in pub.published_names() and "M5, 32 GB" in dev.machine
    named = " ".join(s.how for s in dev.sources)
    # Every figure that is not zero is set by a source; every zero is listed as unpublished.
    for part, struct in (("device", dev.device), ("cost", dev.cost)):
        for field, value in msgspec.structs.asdict(struct).items():
            if isinstance(value, dict):
                continue
            if value:
                assert field in named, (part, field)
            else:
                assert any(field in u for u in dev.unpublished) or field in ("per_mb_latency_s", "per_token_s",
                                                                           "per_step_s"), (part, field)
    assert all(s.source and s.value for s in dev.sources)


def test_plan_on_the_80b_shape_takes_the_published_device_and_its_cost(tmp_path: Path) -> None:
    log = write_synth(tmp_path / "80b.qtrace", SynthSpec(layers=48, experts=512, top_k=10, tokens=60, seed=1,
                                                        locality=0.7, reuse_depth=16, popularity="zipf:0.18"))
    [plan] = make_plans(SHAPE, ["8GB"], log=log, device="m5", bits=4, window_layer_steps=48 * 20)
    m5 = pub.load_published("m5")
    assert plan.device_name == "m5" and plan.cost == m5.cost and plan.predicted_tok_s > 0
    with pytest.raises(ConfigError, match="--device nope: neither a device profile .*m5.*nor a profile file"):
        make_plans(SHAPE, ["8GB"], log=log, device="nope", bits=4)


def test_a_bad_published_file_is_refused_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    good = json.loads((pub.PUBLISHED_DIR / "m5.json").read_text())
    monkeypatch.setattr(pub, "PUBLISHED_DIR", tmp_path)
    (tmp_path / "broken.json").write_text("{")
    (tmp_path / "renamed.json").write_text(json.dumps(good))
    (tmp_path / "slow.json").write_text(json.dumps({**good, "name": "slow", "device": {**good["device"],
                                                                                     "queue_depth": 0}}))
    with pytest.raises(DeviceProfileError, match="broken.json: not a published device profile"):
        pub.load_published("broken")
    with pytest.raises(DeviceProfileError, match="renamed.json: kind .* and name 'm5': expected"):
        pub.load_published("renamed")
    with pytest.raises(DeviceProfileError, match="slow.json: device.queue_depth=0"):
        pub.load_published("slow")
    with pytest.raises(DeviceProfileError, match="published device 'm5': unknown, known: broken, renamed, slow"):
        pub.load_published("m5")
