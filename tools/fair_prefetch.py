"""Prefetch against demand-only caching at equal memory, on real routing traces (docs/measurements.md).

    PYTHONPATH=. python tools/fair_prefetch.py            # about 4 minutes on one core

Imports three of the real traces in tests/data/traces (Mixtral-8x7B routing_raw and humaneval_2,
FLAME-MoE-290M's encoder captures) into routing logs in a temporary directory, then replays each:

- at one memory per trace (R resident + S side slots per layer, T = R + S): demand-only with T
  resident slots, and each predictor (previous, transition, oracle at recall 1) with R + S slots,
  prefetches into the side region and into the resident one (pool.prefetch_into), and with T
  resident slots and no side region (prefetch_into=main). Every run replays the same steps: the
  first --train-frac of each log trains `transition` and is skipped by all;
- the oracle at recall 0.5, 0.6, ..., 1.0 with prefetch_into=main (R + S and T + 0), and side;
- `previous` with --train-frac 0 and 0.01 (a cold start's effect).

Prints markdown tables; the best hit rate of each row is bold.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from qnpipe import config
from qnpipe.cli import main as cli
from qnpipe.replay import PredictorOpts, replay

DATA = Path(__file__).resolve().parent.parent / "tests" / "data" / "traces"
NBYTES = 1 << 20  # one expert record: the hit rates do not depend on it, the memory column does
# (name, importer, source, resident, side)
TRACES = [
    ("mixtral-raw", "mixtral-jsonl", "Mario928__speculative-moe/routing_raw.jsonl.gz", 4, 3),
    ("mixtral-he2", "mixtral-jsonl", "Mario928__speculative-moe/humaneval_2_routing.jsonl.gz", 4, 3),
    ("flame-enc", "flame-pt", "Akash-N-Pai__DynaNDE-Simulator/Sample_routing_traces.tar.gz", 16, 12),
]
PREDICTORS = ("previous", "transition", "oracle")
RECALLS = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


def _import(tmp: Path, name: str, fmt: str, src: str) -> Path:
    path = DATA / src
    if src.endswith(".tar.gz"):
        with tarfile.open(path) as tar:
            tar.extractall(tmp, filter="data")
        path = tmp / "Sample_routing_traces" / "Encoder_Batch_0-32"
    out = tmp / f"{name}.qtrace"
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli(["trace", "import", fmt, str(path), "-o", str(out), "-q"]) == 0
    return out


def _hit(log: Path, resident: int, side: int, predictor: str, into: str = "side", *, train_frac: float,
         recall: float = 1.0) -> float:
    cfg = config.load(None, overrides={"pool.expert_slots": resident, "pool.side_region_slots": side,
                                       "pool.prefetch_into": into})
    r = replay(log, cfg, record_nbytes=NBYTES, predictor=predictor,
               opts=PredictorOpts(train_frac=train_frac, recall=recall))
    return r.hit_rate


def _row(cells: list[float]) -> list[str]:
    best = max(cells)
    return [f"**{c:.3f}**" if c == best else f"{c:.3f}" for c in cells]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train-frac", type=float, default=0.2, help="steps that train transition, skipped by all")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        logs = [(name, _import(tmp, name, fmt, src), r, s) for name, fmt, src, r, s in TRACES]
        head: list[str] = ["trace", "slots R+S (MiB per layer)", "demand-only T+0"]
        for p in PREDICTORS:
            head += [f"{p} side R+S", f"{p} main R+S", f"{p} main T+0"]
        print("| " + " | ".join(head) + " | winner |")
        print("|" + "---|" * (len(head) + 1))
        for name, log, r, s in logs:
            t = r + s
            cells = [_hit(log, t, 0, "none", train_frac=a.train_frac)]
            for p in PREDICTORS:
                cells += [_hit(log, r, s, p, "side", train_frac=a.train_frac),
                          _hit(log, r, s, p, "main", train_frac=a.train_frac),
                          _hit(log, t, 0, p, "main", train_frac=a.train_frac)]
            winner = head[2 + cells.index(max(cells))]
            print(f"| {name} | {r}+{s} ({t * NBYTES / 2**20:.0f}) | " + " | ".join(_row(cells)) + f" | {winner} |")
        print()
        print("| trace | placement, slots | " + " | ".join(f"recall {x}" for x in RECALLS) + " | monotone |")
        print("|---|---|" + "---|" * (len(RECALLS) + 1))
        for name, log, r, s in logs:
            for into, res, side in (("main", r, s), ("main", r + s, 0), ("side", r, s)):
                rates = [_hit(log, res, side, "oracle", into, train_frac=a.train_frac, recall=x) for x in RECALLS]
                mono = all(x <= y for x, y in zip(rates, rates[1:], strict=False))
                print(f"| {name} | {into}, {res}+{side} | " + " | ".join(f"{x:.3f}" for x in rates)
                      + f" | {'yes' if mono else 'no'} |")
        print()
        print("| trace | placement, slots | previous, train-frac 0 | previous, train-frac 0.01 | demand-only, 0 | "
              "demand-only, 0.01 |")
        print("|---|---|---|---|---|---|")
        for name, log, r, s in logs:
            for into in ("side", "main"):
                cells: list[Any] = [_hit(log, r, s, "previous", into, train_frac=f) for f in (0.0, 0.01)]
                cells += [_hit(log, r + s, 0, "none", train_frac=f) for f in (0.0, 0.01)]
                print(f"| {name} | {into}, {r}+{s} | " + " | ".join(f"{x:.3f}" for x in cells) + " |")


if __name__ == "__main__":
    main()
