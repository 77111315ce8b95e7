"""Replay real MoE routing traces through qnpipe's SlotTable with each eviction policy.

One step = one token's top-k experts at one layer: `acquire`, complete every load,
`release`, `forward_done`. Each layer has its own table (as in the engine); a trace's hit
rate is hits / expert requests summed over its layers. Belady's farthest-next-use on the
same steps is the upper bound. Cold misses are included in every rate.

Traces (see /work/shared/traces/raw/SOURCES.md):
  mixtral-raw      Mixtral-8x7B, 8 experts top-2, layers 0-31, HumanEval/0 prompt + generation in time order
  mixtral-he2      Mixtral-8x7B, HumanEval/0 then /1, generated tokens only, token_idx order
  qwen15moe-dec    Qwen1.5-MoE-A2.7B, 60 experts top-4, layers 0,8,12,18,23; vLLM batch of 25 GSM8K
                   prompts: dummy/profiling passes and the batched prefill dropped, then the first 82
                   decode steps (all 25 rows, row r = request r), replayed request after request
  flame290m-enc    FLAME-MoE-290M, 64 experts top-6, layers 2-9, 32 sequences x 64 tokens, sequence-major
  switch128        Switch-base-128, 128 experts top-1, layers 1,3,...,11, one 75-100 token sample each

Usage: python tools/eviction_study.py [--raw /work/shared/traces/raw] [--traces NAME ...]
Prints a table, then one JSON line per (trace, capacity, policy).
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import pickle
import sys
import time
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from qnpipe.config import EvictPolicy
from qnpipe.policy.eviction import Eviction, make_eviction
from qnpipe.policy.slot_table import SlotTable

RAW = Path("/work/shared/traces/raw")
Steps = list[tuple[int, ...]]


@attrs.frozen
class Trace:
    name: str
    layers: str
    n_experts: int
    k: int
    by_layer: dict[int, Steps]


# --------------------------------------------------------------------------- loaders


def _steps(rows: Sequence[Sequence[int]]) -> Steps:
    return [tuple(dict.fromkeys(int(e) for e in r)) for r in rows]  # distinct, order kept


def load_mixtral_raw(raw: Path) -> Trace:
    by_layer: dict[int, Steps] = collections.defaultdict(list)
    with open(raw / "Mario928__speculative-moe" / "routing_raw.jsonl") as f:
        for line in f:
            r = json.loads(line)
            by_layer[r["layer"]].append(tuple(dict.fromkeys(r["experts"])))
    return Trace("mixtral-raw", "0-31", 8, 2, dict(by_layer))


def load_mixtral_he2(raw: Path) -> Trace:
    recs: dict[int, list[tuple[int, int, tuple[int, ...]]]] = collections.defaultdict(list)
    with open(raw / "Mario928__speculative-moe" / "humaneval_2_routing.jsonl") as f:
        for line in f:
            r = json.loads(line)
            recs[r["layer"]].append((r["problem_id"], r["token_idx"], tuple(dict.fromkeys(r["experts"]))))
    by_layer = {layer: [e for _, _, e in sorted(rs, key=lambda x: (x[0], x[1]))] for layer, rs in recs.items()}
    return Trace("mixtral-he2", "0-31", 8, 2, by_layer)


def load_qwen_decode(raw: Path) -> Trace:
    by_layer: dict[int, Steps] = {}
    for layer in (0, 8, 12, 18, 23):
        passes: list[list[tuple[int, ...]]] = []
        with open(raw / "weiran0129__vLLM-MoE-Logger" / f"moe_layer{layer}.jsonl") as f:
            for line in f:
                r = json.loads(line)
                if r["type"] != "route":
                    continue
                if r["token_idx"] == 0:
                    passes.append([])
                passes[-1].append(tuple(r["topk_ids"]))
        real = [p for p in passes if len(set(p)) > 1]  # vLLM's profiling passes repeat one expert set
        first = next(i for i, p in enumerate(real) if len(p) > 1000)  # the batched prefill of 25 prompts
        decode = []
        for p in real[first + 1:]:
            if len(p) != 25:
                break  # from here on finished requests leave the batch: rows no longer map to requests
            decode.append(p)
        by_layer[layer] = [tuple(dict.fromkeys(decode[t][r])) for r in range(25) for t in range(len(decode))]
    return Trace("qwen15moe-dec", "0,8,12,18,23", 60, 4, by_layer)


class _TorchZip(pickle.Unpickler):
    """Reads a torch zip pickle of plain tensors without torch (only the globals such files need)."""

    DTYPES = {"LongStorage": np.int64, "FloatStorage": np.float32, "IntStorage": np.int32}

    def __init__(self, zf: zipfile.ZipFile, prefix: str, data: bytes) -> None:
        import io

        super().__init__(io.BytesIO(data))
        self.zf, self.prefix = zf, prefix

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name in self.DTYPES:
            return self.DTYPES[name]
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            def rebuild(storage: np.ndarray, offset: int, size: tuple[int, ...], stride: tuple[int, ...],
                        *_: Any) -> np.ndarray:
                isz = storage.itemsize
                return np.lib.stride_tricks.as_strided(storage[offset:], size, [s * isz for s in stride]).copy()
            return rebuild
        raise pickle.UnpicklingError(f"refusing global {module}.{name}")

    def persistent_load(self, pid: Any) -> np.ndarray:
        _, dtype, key, _loc, _numel = pid
        return np.frombuffer(self.zf.read(f"{self.prefix}/data/{key}"), dtype=dtype)


def load_torch_zip(path: Path) -> dict[str, Any]:
    with zipfile.ZipFile(path) as zf:
        pkl = next(n for n in zf.namelist() if n.endswith("/data.pkl"))
        out: dict[str, Any] = _TorchZip(zf, pkl.rsplit("/", 1)[0], zf.read(pkl)).load()
        return out


def load_flame(raw: Path) -> Trace:
    base = raw / "Akash-N-Pai__DynaNDE-Simulator" / "Sample_routing_traces" / "Encoder_Batch_0-32"
    by_layer = {}
    for layer in range(2, 10):
        (path,) = (base / f"Layer_{layer}").glob("*.pt")
        by_layer[layer] = _steps(load_torch_zip(path)["indices"])
    return Trace("flame290m-enc", "2-9", 64, 6, by_layer)


def load_switch(raw: Path) -> Trace:
    data = json.loads((raw / "cyanmishra92__specMoE" / "sample_trace_paths.json").read_text())
    by_layer = {int(layer): [(int(e),) for s in samples for e in s["expert_sequence"]]
                for layer, samples in data.items()}
    return Trace("switch128", ",".join(str(x) for x in sorted(by_layer)), 128, 1, by_layer)


LOADERS: dict[str, Callable[[Path], Trace]] = {
    "mixtral-raw": load_mixtral_raw, "mixtral-he2": load_mixtral_he2, "qwen15moe-dec": load_qwen_decode,
    "flame290m-enc": load_flame, "switch128": load_switch,
}

# --------------------------------------------------------------------------- replay

POLICIES: dict[str, Callable[[int], Eviction]] = {  # capacity -> a fresh policy
    "lru": lambda cap: make_eviction(EvictPolicy.LRU, cap),
    "fifo": lambda cap: make_eviction(EvictPolicy.FIFO, cap),
    "lfu": lambda cap: make_eviction(EvictPolicy.LFU, cap),
    "lfu-decay64": lambda cap: make_eviction(EvictPolicy.LFU, cap, lfu_decay_interval=64),
    "lrfu-0.01": lambda cap: make_eviction(EvictPolicy.LRFU, cap, lrfu_lambda=0.01),
    "lrfu-0.05": lambda cap: make_eviction(EvictPolicy.LRFU, cap, lrfu_lambda=0.05),
    "lrfu-0.2": lambda cap: make_eviction(EvictPolicy.LRFU, cap, lrfu_lambda=0.2),
    "clock": lambda cap: make_eviction(EvictPolicy.CLOCK, cap),
    "sieve": lambda cap: make_eviction(EvictPolicy.SIEVE, cap),
    "arc": lambda cap: make_eviction(EvictPolicy.ARC, cap),
    "s3fifo": lambda cap: make_eviction(EvictPolicy.S3FIFO, cap),
}


def replay(steps: Steps, capacity: int, eviction: Eviction) -> int:
    """Hits of `steps` through a SlotTable of `capacity` slots."""
    t = SlotTable(0, capacity, eviction)
    hits = 0
    for experts in steps:
        plan = t.acquire(experts)
        hits += len(plan.hits)
        for ld in plan.loads:
            t.loaded(ld.expert, ld.slot)
        t.release(experts)
        t.forward_done()
    return hits


def belady(steps: Steps, capacity: int) -> int:
    """Hits of farthest-next-use eviction (never evicting an expert of the current step)."""
    nxt: list[dict[int, float]] = [{} for _ in steps]
    upcoming: dict[int, float] = {}
    for i in range(len(steps) - 1, -1, -1):
        for e in steps[i]:
            nxt[i][e] = upcoming.get(e, math.inf)
        for e in steps[i]:
            upcoming[e] = i
    resident: dict[int, float] = {}  # expert -> index of its next use
    hits = 0
    for i, experts in enumerate(steps):
        step = set(experts)
        for e in experts:
            if e in resident:
                hits += 1
            elif len(resident) >= capacity:
                victim = max((x for x in resident if x not in step), key=resident.__getitem__)
                del resident[victim]
            resident[e] = nxt[i][e]
        for e in experts:
            resident[e] = nxt[i][e]
    return hits


def capacities(tr: Trace) -> list[int]:
    return sorted({max(tr.k, tr.n_experts // 4), max(tr.k, tr.n_experts // 2), tr.k + 1})


def study(traces: Sequence[Trace]) -> list[dict[str, Any]]:
    rows = []
    for tr in traces:
        requests = sum(len(e) for steps in tr.by_layer.values() for e in steps)
        n_steps = sum(len(s) for s in tr.by_layer.values())
        for cap in capacities(tr):
            opt = sum(belady(s, cap) for s in tr.by_layer.values()) / requests
            for name, make in POLICIES.items():
                hits = sum(replay(s, cap, make(cap)) for s in tr.by_layer.values())
                rows.append({"trace": tr.name, "layers": tr.layers, "experts": tr.n_experts, "top_k": tr.k,
                             "steps": n_steps, "capacity": cap, "policy": name,
                             "hit_rate": round(hits / requests, 4), "belady_hit_rate": round(opt, 4)})
    return rows


def table(rows: Sequence[dict[str, Any]]) -> str:
    names = list(POLICIES)
    head = "| trace (E, top-k, steps) | layers | cap | " + " | ".join(names) + " | belady |"
    out = [head, "|" + "---|" * (len(names) + 4)]
    groups: dict[tuple[str, int], list[dict[str, Any]]] = collections.defaultdict(list)
    for r in rows:
        groups[(r["trace"], r["capacity"])].append(r)
    for (trace, cap), rs in groups.items():
        r0 = rs[0]
        by = {r["policy"]: r["hit_rate"] for r in rs}
        best = max(by.values())
        cells = [f"**{by[n]:.3f}**" if by[n] == best else f"{by[n]:.3f}" for n in names]
        out.append(f"| {trace} ({r0['experts']}, {r0['top_k']}, {r0['steps']}) | {r0['layers']} | {cap} | "
                   + " | ".join(cells) + f" | {r0['belady_hit_rate']:.3f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--raw", type=Path, default=RAW)
    ap.add_argument("--traces", nargs="*", choices=list(LOADERS), default=list(LOADERS))
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    traces = [LOADERS[name](args.raw) for name in args.traces]
    rows = study(traces)
    print(table(rows))
    for r in rows:
        print(json.dumps(r))
    print(f"# {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
