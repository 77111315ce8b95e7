"""The server's counters and the Prometheus text exposition of them and of the engine's stats.

The engine's figures are taken from `AsyncEngine.stats()` when /metrics is read: every
numeric field of EngineStats and of each of its parts (`pool` when experts stream, `prefix`
when snapshots are on, ...) is exported, so figures other features add there (MTP
acceptance) appear without a change here; the misses by cause are one labelled family.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import msgspec

from qnpipe.server.scheduling import Scheduler


class Metrics:
    """Counted by the app as requests come and go (trio thread only)."""

    def __init__(self) -> None:
        self.requests: Counter[tuple[str, int]] = Counter()  # (endpoint, status)
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.disconnects = 0
        self.generations = 0

    def request(self, endpoint: str, status: int) -> None:
        self.requests[(endpoint, status)] += 1


def _esc(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class _Text:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_: str, samples: list[tuple[dict[str, str], float]]) -> None:
        self.lines.append(f"# HELP {name} {help_}")
        self.lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            lab = ",".join(f'{k}="{_esc(v)}"' for k, v in labels.items())
            self.lines.append(f"{name}{{{lab}}} {_num(value)}" if lab else f"{name} {_num(value)}")


def _num(v: float) -> str:
    return str(int(v)) if isinstance(v, bool | int) or float(v).is_integer() else repr(float(v))


def _numeric_fields(obj: Any) -> list[tuple[str, float]]:
    out = []
    for f in msgspec.structs.fields(obj):
        v = getattr(obj, f.name)
        if isinstance(v, int | float) and not isinstance(v, bool):
            out.append((f.name, float(v)))
    return out


def render(metrics: Metrics, sched: Scheduler, stats: Any) -> str:
    """The Prometheus text (format 0.0.4) of the server's counters and the engine's `stats`."""
    t = _Text()
    t.family("qnpipe_requests_total", "counter", "HTTP requests answered, by endpoint and status code",
             [({"endpoint": e, "code": str(c)}, n) for (e, c), n in sorted(metrics.requests.items())])
    t.family("qnpipe_prompt_tokens_total", "counter", "prompt tokens of the generations run",
             [({}, metrics.prompt_tokens)])
    t.family("qnpipe_completion_tokens_total", "counter", "tokens generated", [({}, metrics.completion_tokens)])
    t.family("qnpipe_generations_total", "counter", "generations started on the engine", [({}, metrics.generations)])
    t.family("qnpipe_client_disconnects_total", "counter", "requests whose client left before the answer ended",
             [({}, metrics.disconnects)])
    t.family("qnpipe_queue_rejected_total", "counter", "requests refused with 429 (queue full)",
             [({}, sched.rejected)])
    t.family("qnpipe_queue_depth", "gauge", "requests waiting for the engine", [({}, sched.waiting)])
    t.family("qnpipe_queue_depth_peak", "gauge", "the most requests that waited at once", [({}, sched.peak_waiting)])
    t.family("qnpipe_queue_max", "gauge", "the queue's bound (--max-queue)", [({}, sched.max_queue)])
    t.family("qnpipe_running", "gauge", "requests generating now (0 or 1)", [({}, sched.running)])
    pool = getattr(stats, "pool", None)
    hits = pool.hits if pool is not None else 0
    t.family("qnpipe_expert_hits_total", "counter", "expert uses found in the pool", [({}, hits)])
    t.family("qnpipe_expert_misses_total", "counter", "expert uses read from the store, by cause",
             [({"cause": k}, v) for k, v in sorted(stats.expert_misses_by_cause.items())])
    t.family("qnpipe_expert_bytes_read_total", "counter", "bytes of expert records read",
             [({}, stats.expert_bytes_read)])
    prefix = getattr(stats, "prefix", None)
    t.family("qnpipe_snapshot_hits_total", "counter", "prompts resumed from a prefix snapshot",
             [({}, prefix.hits if prefix is not None else 0)])
    t.family("qnpipe_snapshot_tokens_reused_total", "counter", "prompt tokens resumed, not prefilled again",
             [({}, prefix.tokens_reused if prefix is not None else 0)])
    for name, v in _numeric_fields(stats):
        t.family(f"qnpipe_engine_{name}", "gauge", f"EngineStats.{name} since the engine opened", [({}, v)])
    for f in msgspec.structs.fields(stats):  # pool, prefix, and whatever part later features add
        part = getattr(stats, f.name)
        if isinstance(part, msgspec.Struct):
            for name, v in _numeric_fields(part):
                t.family(f"qnpipe_{f.name}_{name}", "gauge", f"EngineStats.{f.name}.{name} since the engine opened",
                         [({}, v)])
    return "\n".join(t.lines) + "\n"
