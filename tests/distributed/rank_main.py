"""One rank of a test ring: `python rank_main.py MODEL_DIR OUT.npz SCENARIO.json` (MLX_RANK, MLX_HOSTFILE set).

Rank 0 runs each engine setting of the scenario through `open_engine(distributed=True)` and saves
what it produced; the other ranks serve it. An engine with `mtp.enabled` runs on its own model
(`"models"`) and prompt (`"mtp_prompt"`): a generation cancelled part way, then greedy tokens, the
rounds' acceptance histogram, and speculative sampling's tokens at a seed. `"loop": true` (the last engine only) then keeps rank 0
generating until the ring fails (the killed-rank test), printing `generating` once it has begun.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np
import trio

from qnpipe.errors import DistributedError


async def main(model_dir: str, out: str, scenario: dict) -> int:
    from qnpipe import open_engine

    saved: dict[str, Any] = {}
    for name, overrides in scenario["engines"].items():
        async with open_engine(scenario.get("models", {}).get(name, model_dir), distributed=True, warm_up=True,
                               **overrides) as eng:
            if eng.rank:
                continue
            prompt = scenario["prompt"]
            if overrides.get("mtp.enabled"):
                prompt = scenario["mtp_prompt"]
                saved[f"{name}.cancelled_after"] = np.array(await _cancelled(eng, prompt, scenario["mtp_tokens"]))
                res = await eng.generate(prompt, max_tokens=scenario["mtp_tokens"], stop_at_eos=False)
                assert res.stats.mtp is not None
                saved[f"{name}.greedy"] = np.array(res.tokens)
                saved[f"{name}.accept_hist"] = np.array(res.stats.mtp.accept_hist)
                saved[f"{name}.drafted_at"] = np.array(res.stats.mtp.drafted_at)
                res = await eng.generate(prompt, max_tokens=scenario["sampled_tokens"], temperature=0.8, seed=3, stop_at_eos=False)
                saved[f"{name}.sampled"] = np.array(res.tokens)
            else:
                await _plain(eng, name, prompt, scenario["tokens"], saved)
            if eng.plan is not None:  # `memory`: rank 0's own plan (qnpipe.plan.ranks)
                saved[f"{name}.plan_layers"] = np.array(sorted(eng.plan.capacities))
            if scenario.get("loop") and name == list(scenario["engines"])[-1]:
                np.savez(out, **saved)
                print("generating", flush=True)
                while True:
                    await eng.generate(prompt, max_tokens=64, stop_at_eos=False)
    if saved:
        np.savez(out, **saved)
    return 0


async def _cancelled(eng: Any, prompt: Any, tokens: int) -> int:
    """A generation cancelled (as Ctrl-C does) once it has 5 tokens: how many it had."""
    partial: list[int] = []
    with trio.CancelScope() as scope:
        def on_text(_: str) -> None:
            if len(partial) >= 5:
                scope.cancel()

        await eng.generate(prompt, max_tokens=tokens, stop_at_eos=False, on_text=on_text, partial=partial)
    return len(partial)


async def _plain(eng: Any, name: str, prompt: Any, tokens: int, saved: dict[str, Any]) -> None:
    saved[f"{name}.logits"] = await eng.logits(prompt)
    saved[f"{name}.next"] = await eng.next_logits(prompt)
    greedy = await eng.generate(prompt, max_tokens=tokens, stop_at_eos=False)
    saved[f"{name}.greedy"] = np.array(greedy.tokens)
    sampled = await eng.generate(prompt, max_tokens=tokens, temperature=0.8, seed=3, stop_at_eos=False)
    saved[f"{name}.sampled"] = np.array(sampled.tokens)


if __name__ == "__main__":
    try:
        sys.exit(trio.run(main, sys.argv[1], sys.argv[2], json.loads(open(sys.argv[3]).read())))
    except* DistributedError as group:
        from qnpipe.errors import root_cause  # nested nursery groups: the error itself, as the CLI prints it

        print(f"DistributedError: {root_cause(group)}", file=sys.stderr, flush=True)
        sys.exit(3)
