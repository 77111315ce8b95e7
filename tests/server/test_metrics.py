"""/metrics on a streamed model: the pool's hits, misses by cause and bytes read, as the engine counts them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.server.conftest import MODEL, ServerThread, metrics


@pytest.fixture(scope="module")
def streamed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from qnpipe.convert import convert

    out = tmp_path_factory.mktemp("served") / "trained-4bit"
    convert(MODEL, out, bits=4, group_size=32)
    return out


def test_metrics_report_the_pool_as_the_engine_counts_it(streamed: Path) -> None:
    with ServerThread(model_dir=streamed, expert_slots=8) as srv:
        out = srv.client().completions.create(model="m", prompt="def parse(text):\n", max_tokens=12, temperature=0)
        m = metrics(srv)
        st = srv.call(_stats, srv.engine)
    assert st.pool is not None and st.pool.misses > 0 and st.pool.hits > 0
    assert m["qnpipe_expert_hits_total"] == st.pool.hits
    assert sum(v for k, v in m.items() if k.startswith("qnpipe_expert_misses_total{")) == st.pool.misses
    for cause, n in st.pool.misses_by_cause.items():
        assert m[f'qnpipe_expert_misses_total{{cause="{cause}"}}'] == n
    assert m["qnpipe_expert_bytes_read_total"] == st.expert_bytes_read > 0
    assert m["qnpipe_pool_hit_rate"] == pytest.approx(st.pool.hit_rate)
    assert m["qnpipe_engine_requests"] == 1
    assert out.usage is not None
    assert m["qnpipe_completion_tokens_total"] == out.usage.completion_tokens
    assert m["qnpipe_prompt_tokens_total"] == out.usage.prompt_tokens
    assert m["qnpipe_running"] == 0 and m["qnpipe_queue_depth"] == 0


async def _stats(eng: Any) -> Any:
    return eng.stats()
