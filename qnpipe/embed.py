"""The embedded API: `Engine` (sync facade) and `open_engine` (trio-native).

Both run every MLX call on the engine's own MLX thread; the caller's thread (or trio
loop) only waits for results.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import trio

from qnpipe.config import Config
from qnpipe.mlx_thread import MLXThread
from qnpipe.stats import EngineStats, GenerateResult

Prompt = str | Sequence[int]


def _resolve(model_dir: str | Path | None, cfg: Config | None, overrides: dict[str, Any]) -> Config:
    """The engine's Config: `cfg` (or defaults < TOML < environment) + `overrides` + `model_dir`."""
    from qnpipe import config as config_mod

    if model_dir is not None:
        overrides = {**overrides, "model.model_dir": str(model_dir)}
    if cfg is None:
        return config_mod.load(overrides=overrides)
    return config_mod.with_overrides(cfg, overrides) if overrides else cfg


class _Core:
    """State shared by both facades; its methods run on the MLX thread."""

    def __init__(self, model_dir: Path, cfg: Config):
        from qnpipe.model.runner import Runner

        self.cfg = cfg
        self.runner = Runner(model_dir, prefill_chunk=cfg.forward.prefill_chunk_tokens,
                             expert_dir=cfg.model.expert_dir or None)
        self.totals = EngineStats(resident_expert_bytes=self.runner.loaded.experts.nbytes)

    def ids(self, prompt: Prompt) -> list[int]:
        return self.runner.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]

    def generate(self, prompt: Prompt, kw: dict[str, Any], on_text: Callable[[str], None] | None,
                 on_prefill: Callable[[int, int], None] | None = None) -> GenerateResult:
        res = self.runner.generate(self.ids(prompt), on_text=on_text, on_prefill=on_prefill, **kw)
        self.totals = self.totals.add(res.stats)
        return res

    def logits(self, prompt: Prompt) -> np.ndarray:
        return self.runner.logits(self.ids(prompt))


def _gen_kwargs(max_tokens: int, temperature: float, top_p: float, seed: int | None,
                stop_at_eos: bool) -> dict[str, Any]:
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    return {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "seed": seed,
            "stop_at_eos": stop_at_eos}


def _release(core: _Core) -> None:
    """Drop the core's model on the MLX thread and return MLX's cached buffers."""
    import mlx.core as mx

    core.runner = None  # type: ignore[assignment]
    mx.clear_cache()


class Engine:
    """Synchronous engine: `with qnpipe.Engine(model_dir, **overrides) as eng: ...`.

    `overrides` are configuration fields by name (`expert_slots=32`, `prefill_chunk_tokens=0`)
    applied on top of defaults, the TOML file and the environment (see docs/config.md);
    `model_dir` None means `cfg.model.model_dir` (the `MODEL` environment name).
    """

    def __init__(self, model_dir: str | Path | None = None, cfg: Config | None = None, **overrides: Any):
        self.cfg = _resolve(model_dir, cfg, overrides)
        self.model_dir = Path(self.cfg.model.model_dir)
        self._thread = MLXThread.shared()
        self._core: _Core = self._thread.call(_Core, self.model_dir, self.cfg)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release the model (its memory is freed once no result refers to it)."""
        if self._core.runner is not None:
            self._thread.call(_release, self._core)

    @property
    def core(self) -> _Core:
        if self._core.runner is None:
            raise RuntimeError("this Engine is closed")
        return self._core

    @property
    def tokenizer(self) -> Any:
        return self.core.runner.tokenizer

    @property
    def args(self) -> Any:
        """The model's ModelArgs (sizes, layer kinds)."""
        return self.core.runner.loaded.args

    def encode(self, text: str) -> list[int]:
        return self._thread.call(self.core.runner.encode, text)

    def logits(self, prompt: Prompt) -> np.ndarray:
        """Logits `(len, vocab)` float32 of `prompt` (text or token ids) as a fresh sequence."""
        return self._thread.call(self.core.logits, prompt)

    def generate(self, prompt: Prompt, *, max_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int | None = None, stop_at_eos: bool = True,
                 on_text: Callable[[str], None] | None = None,
                 on_prefill: Callable[[int, int], None] | None = None) -> GenerateResult:
        """Generate after `prompt` (text or token ids); greedy when temperature is 0.

        Stops at an EOS token (unless `stop_at_eos` is False) or after `max_tokens`. `on_text`
        receives detokenized text pieces as they are produced and `on_prefill(done, total)`
        the prompt tokens processed after each prefill chunk (both called on the MLX thread).
        """
        kw = _gen_kwargs(max_tokens, temperature, top_p, seed, stop_at_eos)
        return self._thread.call(self.core.generate, prompt, kw, on_text, on_prefill)

    def stats(self) -> EngineStats:
        """Totals since the engine opened (still readable after close)."""
        return self._core.totals


def _to_trio(fn: Callable[..., None] | None) -> Callable[..., None] | None:
    """`fn` wrapped to run in the current trio thread when called from the MLX thread (FIFO order)."""
    if fn is None:
        return None
    token = trio.lowlevel.current_trio_token()

    def call(*args: Any) -> None:
        token.run_sync_soon(fn, *args)

    return call


async def _on_thread(thread: MLXThread, fn: Callable[..., Any], *args: Any) -> Any:
    """Run `fn(*args)` on `thread`, waiting in trio without blocking the loop."""
    done = trio.Event()
    token = trio.lowlevel.current_trio_token()
    fut = thread.submit(fn, *args)
    fut.add_done_callback(lambda _: token.run_sync_soon(done.set))
    await done.wait()
    return fut.result()


class AsyncEngine:
    """Trio-native engine handle; get one from `open_engine`."""

    def __init__(self, thread: MLXThread, core: _Core):
        self._thread = thread
        self._core = core
        self.cfg = core.cfg

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await _on_thread(self._thread, fn, *args)

    @property
    def tokenizer(self) -> Any:
        return self._core.runner.tokenizer

    async def logits(self, prompt: Prompt) -> np.ndarray:
        return await self._run(self._core.logits, prompt)

    async def generate(self, prompt: Prompt, *, max_tokens: int = 64, temperature: float = 0.0,
                       top_p: float = 1.0, seed: int | None = None, stop_at_eos: bool = True,
                       on_text: Callable[[str], None] | None = None,
                       on_prefill: Callable[[int, int], None] | None = None) -> GenerateResult:
        """As `Engine.generate`; `on_text` and `on_prefill` are called in the trio thread, in order."""
        kw = _gen_kwargs(max_tokens, temperature, top_p, seed, stop_at_eos)
        return await self._run(self._core.generate, prompt, kw, _to_trio(on_text), _to_trio(on_prefill))

    def stats(self) -> EngineStats:
        return self._core.totals


@asynccontextmanager
async def open_engine(model_dir: str | Path | None = None, cfg: Config | None = None,
                      **overrides: Any) -> AsyncIterator[AsyncEngine]:
    """`async with open_engine(model_dir, cfg) as eng:` — the engine, closed on exit.

    `model_dir` None means `cfg.model.model_dir` (the `MODEL` environment name).
    """
    cfg = _resolve(model_dir, cfg, overrides)
    thread = MLXThread.shared()
    core = await _on_thread(thread, _Core, Path(cfg.model.model_dir), cfg)
    try:
        yield AsyncEngine(thread, core)
    finally:
        with trio.CancelScope(shield=True):
            await _on_thread(thread, _release, core)
