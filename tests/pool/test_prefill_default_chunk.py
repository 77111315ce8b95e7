"""The default prefill chunk (forward.prefill_chunk_tokens, qnpipe.policy.prefill) does not depend on the
pool, so a prompt longer than one chunk gives the all-resident logits bit for bit at any capacity."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import qnpipe
from qnpipe.policy.prefill import DEFAULT_CHUNK


@pytest.mark.slow
def test_a_prompt_of_several_default_chunks_is_exact_across_pool_sizes(streamed_models: dict[str, Path]) -> None:
    d = streamed_models["3L-e16k2-fp32"]
    prompt = [int(t) for t in np.random.default_rng(11).integers(0, 1000, DEFAULT_CHUNK + 37)]
    with qnpipe.Engine(d, eager_load=True) as ref:  # the default chunk
        E, k = ref.args.num_experts, ref.args.num_experts_per_tok
        want = ref.generate(prompt, max_tokens=4, stop_at_eos=False).tokens
        want_logits = ref.logits(prompt[:DEFAULT_CHUNK + 5])
    for cap in (k, E // 2, E):
        with qnpipe.Engine(d, expert_slots=cap) as eng:
            assert eng.generate(prompt, max_tokens=4, stop_at_eos=False).tokens == want, cap
            assert np.array_equal(eng.logits(prompt[:DEFAULT_CHUNK + 5]), want_logits), cap
            st = eng.stats()
        assert st.pool is not None
        if cap < E:
            assert st.pool.split_layer_steps > 0  # a default chunk's union exceeds the slots: parts ran
