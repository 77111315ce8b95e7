"""Belady's bound on every imported real trace: no demand-only eviction policy hits more often, per layer.

Each trace is replayed through the real pool (`qnpipe.replay`, a routing log: the record size
is given) with every demand policy at two capacities. To keep the test fast the logs are cut
to their first steps at import (`max_steps`): 16 steps of Mixtral (32 layers; routing_raw's
first step is its 135-token prefill), 200 of the single-layer vLLM logs (the first requests),
48 of FLAME (8 layers). Run with `-s` to see the gap table.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from real_traces import MARIO, TOTANI, WEIRAN

from qnpipe import config
from qnpipe.replay import replay
from qnpipe.trace.importers import import_log

POLICIES = ("lru", "lfu", "fifo", "lrfu", "clock", "sieve", "arc", "s3fifo")

# (name, format, source under tests/data/traces or the unpacked FLAME folder, steps kept, capacities)
TRACES = [
    ("mixtral-humaneval", "mixtral-jsonl", MARIO / "humaneval_2_routing.jsonl.gz", 16, (4, 6)),
    ("mixtral-raw", "mixtral-jsonl", MARIO / "routing_raw.jsonl.gz", 16, (4, 6)),
    *[(f"qwen-layer{n}", "vllm-jsonl", WEIRAN / f"moe_layer{n}.jsonl.gz", 200, (8, 24)) for n in (0, 8, 12, 18, 23)],
    ("qwen-totani", "vllm-jsonl", TOTANI, 200, (8, 24)),
    ("flame-sequences", "flame-pt", Path("Encoder_Batch_0-32"), 48, (12, 32)),
    ("flame-positions", "flame-pt", Path("Decoder_Batch_0-64"), 48, (12, 32)),
]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "fmt", "src", "steps", "caps"), TRACES, ids=[t[0] for t in TRACES])
def test_no_demand_policy_beats_belady_on_a_real_trace(name: str, fmt: str, src: Path, steps: int,
                                                       caps: tuple[int, int], flame_dir: Path,
                                                       tmp_path: Path) -> None:
    log = tmp_path / f"{name}.qtrace"
    s = import_log(fmt, src if src.is_absolute() else flame_dir / src, log, max_steps=steps)
    assert s.steps == steps
    gaps = []
    for slots in caps:
        for policy in POLICIES:
            cfg = config.load(None, overrides={"pool.expert_slots": str(slots), "pool.evict_policy": policy})
            r = replay(log, cfg, record_nbytes=1 << 20)
            layers = [x for x in r.layers if x.requests]
            assert {x.layer for x in layers} == set(s.layers)
            for x in layers:
                assert x.hit_rate <= x.belady_hit_rate, (name, policy, slots, x)
            gap = [x.belady_hit_rate - x.hit_rate for x in layers]
            gaps.append(max(gap))
            print(f"{name:18} {policy:5} slots={slots:<3} hit {r.hit_rate:.3f}  Belady gap per layer: "
                  f"min {min(gap):.3f} mean {sum(gap) / len(gap):.3f} max {max(gap):.3f}")
    assert max(gaps) > 0  # the bound is not vacuous: the optimum beats some policy somewhere
