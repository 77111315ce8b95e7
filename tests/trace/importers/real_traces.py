"""Where the real traces are: tests/data/traces (gzipped copies; README.md there credits the sources)."""

from __future__ import annotations

from pathlib import Path

DATA = Path(__file__).resolve().parent.parent.parent / "data" / "traces"
MARIO = DATA / "Mario928__speculative-moe"
WEIRAN = DATA / "weiran0129__vLLM-MoE-Logger"
TOTANI = DATA / "TotaniYash__vllm_moe_routelogging_patch" / "moe_routes.jsonl.gz"
FLAME_TAR = DATA / "Akash-N-Pai__DynaNDE-Simulator" / "Sample_routing_traces.tar.gz"
