"""Chat and serve on the generic tier: a converted qwen3_moe model streamed through a small pool answers the
OpenAI chat endpoint with what the engine generates from the family's chat template (the tokenizer's own),
and mlx-lm's `generate_step` gives the same greedy tokens for that prompt."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.utils import load as mlx_lm_load

import qnpipe
from qnpipe.convert import convert
from qnpipe.model.family import tiny
from tests.families.test_engine_families import save_mlx_lm_dir
from tests.server.conftest import ServerThread

USER = [{"role": "user", "content": "Write a loop."}]


def test_chat_and_serve_on_a_streamed_family(tmp_path: Path) -> None:
    cfg = save_mlx_lm_dir(tmp_path / "src", "qwen3_moe", "affine4")
    out = tmp_path / "qn"
    convert(tmp_path / "src", out)
    slots = tiny.top_k(cfg) + 1
    with qnpipe.Engine(out, expert_slots=slots) as eng:
        prompt = eng.render_chat(USER)
        ids = eng.encode(prompt)
        want = eng.generate(prompt, max_tokens=8, temperature=0, stop_at_eos=False)
        assert eng.stats().expert_source == "pool"
    ref = mlx_lm_load(str(tmp_path / "src"))[0]
    greedy = [int(t) for t, _ in generate_step(mx.array(ids), ref, max_tokens=8)]
    assert list(want.tokens) == greedy
    with ServerThread(model_dir=out, expert_slots=slots) as srv:
        got = srv.client().chat.completions.create(model=out.name, messages=USER, temperature=0, max_tokens=8)
    assert got.choices[0].message.content == want.text != ""
    assert got.choices[0].finish_reason == "length"
