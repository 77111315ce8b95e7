"""Issue 13: prefix snapshots with the experts streaming through the pool: a resumed prompt is bit-identical."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import qnpipe

HEAD = 16


@pytest.mark.slow
@pytest.mark.parametrize("kv_quant", [False, True])
def test_resume_with_streamed_experts_equals_full_prefill(streamed_models: dict[str, Path], tmp_path: Path,
                                                          kv_quant: bool) -> None:
    model = streamed_models["trained-fp32"]
    text = "import os\nimport sys\n\n\ndef main(argv):\n    \"\"\"Entry point.\"\"\"\n"
    tails = ["    return len(argv)\n", "    for a in argv:\n        print(a)\n"]
    small: dict[str, Any] = {"expert_slots": 8, "autopin": False}  # of 44: every step reads experts
    if kv_quant:
        small |= {"kv_quant": True, "group_size": 32}
    with qnpipe.Engine(model, snapshot_head_tokens=0, **small) as eng:
        ids = [eng.encode(text + t) for t in tails]
        ref = [(eng.next_logits(p), eng.generate(p, max_tokens=16, stop_at_eos=False).tokens) for p in ids]
    assert ids[0][:HEAD] == ids[1][:HEAD] and len(ids[1]) > HEAD + 4
    with qnpipe.Engine(model, snapshot_head_tokens=HEAD, snapshot_dir=str(tmp_path), **small) as eng:
        got = [(eng.next_logits(p), eng.generate(p, max_tokens=16, stop_at_eos=False).tokens) for p in ids]
        st = eng.stats()
    assert st.expert_source == "pool" and st.pool is not None and st.pool.misses > 0
    assert st.prefix is not None and st.prefix.hits == 3 and st.prefix.tokens_reused >= 3 * HEAD
    for (a, ta), (b, tb) in zip(ref, got, strict=True):
        assert np.array_equal(a, b) and ta == tb
