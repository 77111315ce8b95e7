"""Miss-ratio curves on every imported real trace: the one pass equals the replay's counts at every capacity.

The traces and their cuts are test_belady_on_real_traces' (its first steps only, to stay fast). At every
capacity from top-k to the expert count, each layer's one-pass LRU and Belady hits equal the pool's own
slot table and qnpipe.replay.belady run on the requests the forward makes at that capacity (its parts);
the replay itself (pool.evict_policy=lru, demand only) is run at every capacity of the small traces and at
every 16th (and the last) of the 128-expert ones, and must agree too.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_belady_on_real_traces import TRACES

from qnpipe import config
from qnpipe.policy.parts import Splitter, plan_parts_flat
from qnpipe.replay import load_log, miss_ratio_curves, replay
from qnpipe.replay.belady import belady_hits
from qnpipe.replay.mrc import lru_hits
from qnpipe.trace.importers import import_log


@pytest.mark.slow
@pytest.mark.parametrize("parts", ["experts", "tokens"])
@pytest.mark.parametrize(("name", "fmt", "src", "steps"), [t[:4] for t in TRACES], ids=[t[0] for t in TRACES])
def test_one_pass_curves_equal_the_replay_on_a_real_trace(name: str, fmt: str, src: Path, steps: int, parts: str,
                                                         flame_dir: Path, tmp_path: Path) -> None:
    log = tmp_path / f"{name}.qtrace"
    s = import_log(fmt, src if src.is_absolute() else flame_dir / src, log, max_steps=steps)
    by_expert = parts == "experts"
    result = miss_ratio_curves(log, by_expert=by_expert)
    routes = load_log(log)
    k, experts = routes.shape.top_k, routes.shape.num_experts
    caps = list(range(k, experts + 1))
    assert {c.layer for c in result.curves} == {*s.layers, "all"}
    for layer in s.layers:
        raw = [ex for step in routes.steps for ly, ex in step if ly == layer]
        lru, opt = result.curve("lru", layer), result.curve("belady", layer)
        for i, cap in enumerate(caps):
            # One run per capacity: an expert-major split depends on the layer's previous one.
            split = Splitter(by_expert).parts if by_expert else (lambda ex, k, c, layer: plan_parts_flat(ex, k, c, layer=layer))
            reqs = [p for ex in raw for _, _, p in split(ex, k, cap, layer)]
            assert lru.requests[i] == opt.requests[i] == sum(map(len, reqs))
            assert lru.hits[i] == lru_hits(reqs, cap), (layer, cap)
            assert opt.hits[i] == belady_hits(reqs, cap), (layer, cap)
    every = 1 if experts <= 16 else 16
    for i, cap in enumerate(caps):
        if i % every and cap != experts:
            continue
        cfg = config.load(None, overrides={"pool.expert_slots": str(cap), "pool.evict_policy": "lru",
                                                 "forward.parts": parts})
        r = replay(log, cfg, record_nbytes=1 << 20)
        for x in r.layers:
            if x.requests:
                assert (x.hits, x.requests) == (result.curve("lru", x.layer).hits[i],
                                                result.curve("lru", x.layer).requests[i]), (cap, x)
                assert x.belady_hit_rate == result.curve("belady", x.layer).hit_rate()[i], (cap, x)
