"""How much slower the pipeline's kind of Python runs right after a wait, on this machine (issue 37).

A decode gives the engine's loop thread its host work in short bursts between waits: ~4 ms for the
model's compute before a layer's route, ~1 ms for its reads. On some machines (this project's CI VM)
code run right after such a wait takes several times as long as the same code run back to back, whatever
the thread does while it waits, which no arrangement of the pipeline's own work can avoid. This measures
it directly, with no model and no disk: the victim choice of a 32-slot LFU table (`LFU.pick_many`, the
pool's own code) timed back to back, and right after a wait of each length, the wait either blocked
(`threading.Event.wait`: the thread sleeps, as it does in MLX's eval and in trio's epoll) or spun (a
busy loop in Python: the thread never leaves the CPU). Each figure is the median of `--calls` calls,
over `--rounds` rounds interleaved (all the waits, then again), the median of rounds. One JSON line:

  us_back_to_back           one call, right after the previous one
  us_after_block_<ms>       one call, right after a blocked wait of <ms> milliseconds
  us_after_spin_<ms>        ... after a spun wait
  ratio_after_block_4ms     us_after_block_4 / us_back_to_back: the cost of the wait before a route here
  ratio_after_block_1ms     ... before a batch of reads ends
  loadavg_start_end         the machine's load

    python tools/bench_cold.py
    python tools/bench_cold.py --rounds 5 --calls 100
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable

from qnpipe.policy.eviction import LFU

WAITS_MS = (0.1, 0.5, 1.0, 2.0, 4.0, 20.0)


def lfu_call() -> Callable[[], list[int]]:
    """One acquire's victim choice: 4 victims among 32 resident experts, 8 of them held (as the bench model's)."""
    lfu = LFU()
    for tick, e in enumerate(range(0, 64, 2)):
        for _ in range(1 + (e * 7) % 5):
            lfu.accessed(e, tick)
    held = set(range(0, 16, 2))
    loading: set[int] = set()
    pinned: set[int] = set()
    return lambda: lfu.pick_many(4, loading, held, pinned)


def timed_after(wait: Callable[[], object], call: Callable[[], object], calls: int) -> float:
    """Median µs of `call` right after `wait`, over `calls` calls."""
    pc = time.perf_counter
    out = []
    for _ in range(calls):
        wait()
        t0 = pc()
        call()
        out.append(pc() - t0)
    return statistics.median(out) * 1e6


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    ap.add_argument("--calls", type=int, default=200, help="calls per figure per round (default 200)")
    ap.add_argument("--waits-ms", type=float, nargs="+", default=list(WAITS_MS), metavar="MS",
                    help=f"wait lengths (default {' '.join(str(w) for w in WAITS_MS)}); 1 and 4 give the ratios")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.calls < 1 or any(w <= 0 for w in args.waits_ms):
        ap.error("--rounds, --calls and every --waits-ms must be positive")
    load0 = os.getloadavg()
    call = lfu_call()
    ev = threading.Event()
    rows: dict[str, list[float]] = {}
    for r in range(args.rounds):
        rows.setdefault("us_back_to_back", []).append(timed_after(lambda: None, call, args.calls))
        for ms in args.waits_ms:
            s = ms / 1000
            rows.setdefault(f"us_after_block_{ms:g}", []).append(timed_after(lambda s=s: ev.wait(s), call, args.calls))
            rows.setdefault(f"us_after_spin_{ms:g}", []).append(timed_after(lambda s=s: spin(s), call, args.calls))
        print(f"[bench_cold] round {r + 1}/{args.rounds}: back to back {rows['us_back_to_back'][-1]:.1f} us",
              file=sys.stderr)
    out: dict[str, object] = {k: round(statistics.median(v), 2) for k, v in rows.items()}
    base = statistics.median(rows["us_back_to_back"])
    for ms in (4.0, 1.0):
        key = f"us_after_block_{ms:g}"
        out[f"ratio_after_block_{ms:g}ms"] = round(statistics.median(rows[key]) / base, 2) if key in rows else None
    out["loadavg_start_end"] = [round(load0[0], 2), round(os.getloadavg()[0], 2)]
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
