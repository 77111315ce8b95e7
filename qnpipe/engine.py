"""The embedded API: `Engine` (sync facade) and `open_engine` (trio-native).

Both run the same pipeline (qnpipe.actors.pipeline): the forward's step loop and the pool and
read-scheduler actors in trio, every MLX call on the process's one MLX thread. The sync
facade runs its pipeline as tasks of the MLX thread's own trio loop (qnpipe.live.mlx_thread:
MLX calls then run inline, no thread hand-off per layer), or with prefetch on in a loop
on a thread of its own; a KeyboardInterrupt in the caller
stops the generation in progress at its next layer and leaves the engine usable.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import trio

from qnpipe.actors.pipeline import Pipeline
from qnpipe.compute import blas
from qnpipe.config import Config
from qnpipe.config.launch import launch_rank, read_launch
from qnpipe.engine_args import Prompt, check_trio, gen_kwargs, planned, resolve, settings_of
from qnpipe.errors import DistributedError, PipelineError
from qnpipe.io.reader import ExpertReader
from qnpipe.live import decoding
from qnpipe.live.loaded import LoadedModel, load_model, open_model_pipeline, release_model, warm_up_model
from qnpipe.live.mlx_thread import MLXThread, run_on
from qnpipe.live.mtp.engine import options as spec_options
from qnpipe.live.mtp.engine import speculate
from qnpipe.live.parallel.ctrl_c import deferring_ctrl_c
from qnpipe.live.prefix import Peers, PrefixCache
from qnpipe.model.kvquant import model_bytes_per_token
from qnpipe.model.snapshots import engine_fingerprint
from qnpipe.stats import EngineStats, GenerateResult
from qnpipe.stats_lines import summary_lines
from qnpipe.stats_snapshot import engine_stats


def _layers_tag(core: LoadedModel) -> str:
    from qnpipe.live.parallel.snap import layers_tag

    assert core.stage is not None
    return layers_tag(core.stage)


class _Runtime:
    """One engine's trio side: its pipeline, one request at a time, and the totals."""

    def __init__(self, core: LoadedModel, thread: MLXThread, pipe: Pipeline, *, load_s: float = 0.0,
                 warmup_s: float = 0.0, rank: int = 0, peers: Peers | None = None) -> None:
        self.rank = rank
        self.core = core
        self.thread = thread
        self.pipe = pipe
        self.lock = trio.Lock()
        resident = core.runner.loaded.experts.nbytes
        self.totals = EngineStats(cpu_blas=blas.in_use(), load_s=load_s, warmup_s=warmup_s,
                                  resident_expert_bytes=resident,
                                  expert_source="resident" if core.streaming is None else "pool",
                                  kv_bytes_per_token=model_bytes_per_token(
                                      core.runner.loaded.model, core.cfg.kv if core.cfg.kv.quantize else None))
        # Rank 0 of a ring (`peers`): the other ranks keep their layers' states; files name this rank's.
        # An MTP engine's states hold the MTP layer's rows (on a ring, the last rank's: `mtp_ring`).
        self.prefix = PrefixCache(core.cfg.prefix, lambda: engine_fingerprint(core),
                                  lookahead=core.mtp is not None or core.mtp_ring,
                                  tag=_layers_tag(core) if peers is not None else "", peers=peers)

    def ids(self, prompt: Prompt) -> list[int]:
        if self.rank:
            raise DistributedError(f"rank {self.rank} ran rank 0's steps and has stopped: only rank 0 generates")
        runner = self.core.runner
        ids = runner.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        runner.check_tokens(ids)
        return ids

    async def generate(self, prompt: Prompt, kw: dict[str, Any], on_text: Callable[[str], None] | None,
                       on_prefill: Callable[[int, int], None] | None,
                       partial: list[int] | None = None) -> GenerateResult:
        async with self.lock:
            runner = self.core.runner
            ids = await run_on(self.thread, self.ids, prompt)
            if self.core.mtp is not None or self.core.mtp_ring:
                res = await speculate(self.pipe.forward, self.pipe.recording, self.thread, self.core, ids, kw, on_text,
                                      on_prefill, partial, self.prefix if self.prefix.enabled else None)
                self.totals = self.totals.add(res.stats)
                return res
            res = await decoding.generate(
                self.pipe.forward, self.thread, runner.loaded.model, runner.tokenizer, ids,
                max_tokens=kw["max_tokens"], temperature=kw["temperature"], top_p=kw["top_p"], seed=kw["seed"],
                top_k=kw["top_k"], min_p=kw["min_p"],
                eos=runner.eos_ids if kw["stop_at_eos"] else set(), chunk=self.core.cfg.forward.prefill_chunk_tokens,
                on_text=on_text, on_prefill=on_prefill, partial=partial,
                prefix=self.prefix if self.prefix.enabled else None)
            self.totals = self.totals.add(res.stats)
            return res

    async def logits(self, prompt: Prompt) -> np.ndarray:
        async with self.lock:
            ids = await run_on(self.thread, self.ids, prompt)
            return await decoding.logits(self.pipe.forward, self.thread, self.core.runner.loaded.model, ids,
                                         self.core.cfg.forward.prefill_chunk_tokens)

    async def next_logits(self, prompt: Prompt) -> np.ndarray:
        async with self.lock:
            ids = await run_on(self.thread, self.ids, prompt)
            return await decoding.next_logits(self.pipe.forward, self.thread, self.core.runner.loaded.model, ids,
                                              self.core.cfg.forward.prefill_chunk_tokens,
                                              # an MTP engine's states hold the MTP rows this prefill does not make
                                              self.prefix if self.prefix.enabled and self.core.mtp is None
                                              and not self.core.mtp_ring else None)

    def stats(self) -> EngineStats:
        totals = self.totals
        if self.prefix.enabled:
            totals = msgspec.structs.replace(totals, prefix=self.prefix.current_stats())
        st = self.core.streaming
        return engine_stats(totals, self.pipe.statistics(),
                            slot_bytes=sum(s.nbytes for s in st.slots.values()) if st is not None else 0)


class AsyncEngine:
    """Trio-native engine handle; get one from `open_engine`."""

    def __init__(self, rt: _Runtime, plan: Any = None) -> None:
        self._rt = rt
        self.cfg = rt.core.cfg
        self.plan = plan  # the qnpipe.plan.Plan applied for `memory` (plan.memory), else None

    @property
    def tokenizer(self) -> Any:
        return self._rt.core.runner.tokenizer

    @property
    def rank(self) -> int:
        """This process's rank with `distributed` (0 otherwise): only rank 0 generates."""
        return self._rt.rank

    @property
    def args(self) -> Any:
        """The model's ModelArgs (sizes, layer kinds)."""
        return self._rt.core.args

    async def encode(self, text: str) -> list[int]:
        return await run_on(self._rt.thread, self._rt.core.runner.encode, text)

    async def logits(self, prompt: Prompt) -> np.ndarray:
        """Logits `(len, vocab)` float32 of `prompt` (text or token ids) as a fresh sequence."""
        return await self._rt.logits(prompt)

    async def next_logits(self, prompt: Prompt) -> np.ndarray:
        """Logits `(vocab,)` float32 of the token after `prompt`, using and keeping prefix snapshots as `generate` does."""
        return await self._rt.next_logits(prompt)

    async def generate(self, prompt: Prompt, *, max_tokens: int = 64, temperature: float = 0.0,
                       top_p: float = 1.0, seed: int | None = None, stop_at_eos: bool = True,
                       on_text: Callable[[str], None] | None = None,
                       on_prefill: Callable[[int, int], None] | None = None,
                       partial: list[int] | None = None, top_k: int = 0, min_p: float = 0.0) -> GenerateResult:
        """Generate after `prompt` (text or token ids); greedy when temperature is 0.

        Sampling keeps the tokens mlx-lm's sampler keeps: `top_p` (nucleus mass), `min_p` (probability
        relative to the most likely token's) and `top_k` (0 = off), in that order, then `temperature`.

        Stops at an EOS token (unless `stop_at_eos` is False) or after `max_tokens`.
        `on_text` receives detokenized text pieces as they are produced and
        `on_prefill(done, total)` the prompt tokens processed after each prefill chunk, both
        in the trio thread, in order. `partial` (a list) collects the tokens as they come,
        which is what is left after a cancellation. Cancelling stops the work at the next
        layer; the engine stays usable. With `prefix.snapshot_head_tokens` on, a prompt that
        starts like an earlier one resumes from its kept state (qnpipe.live.prefix): same result,
        bit for bit, without prefilling the shared part again.
        """
        kw = gen_kwargs(prompt, max_tokens, temperature, top_p, seed, stop_at_eos, top_k, min_p)
        if self._rt.core.backend.ring_tail is not None and (top_k or min_p):
            raise ValueError("top_k and min_p are not sent across the ranks of a ring yet: sample with "
                             "temperature and top_p when distributed")
        return await self._rt.generate(prompt, kw, on_text, on_prefill, partial)

    def stats(self) -> EngineStats:
        """Totals since the engine opened, with the pool's figures when experts stream."""
        return self._rt.stats()

    def summary(self) -> str:
        """`stats()` as the lines `qnpipe generate --stats` prints: totals, BLAS, experts, pool occupancy."""
        return "\n".join(summary_lines(self.stats()))

    def render_chat(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None,
                    *, add_generation_prompt: bool = True) -> str:
        """The prompt text of `messages` and `tools` under the model's chat template, tools kept by `chat.tools_allow`.

        See qnpipe.chat.template.render_prompt (ChatError names a bad message or tool).
        """
        from qnpipe.chat.template import render_prompt

        return render_prompt(self.tokenizer, messages, tools, allow=self.cfg.chat.tools_allow,
                             add_generation_prompt=add_generation_prompt)


@asynccontextmanager
async def open_engine(model_dir: str | Path | None = None, cfg: Config | None = None, *,
                      reader: ExpertReader | None = None, warm_up: bool = False, distributed: bool | None = None,
                      settings: Mapping[str, Any] | None = None, **overrides: Any) -> AsyncIterator[AsyncEngine]:
    """`async with open_engine(model_dir, cfg) as eng:` — the engine, its actors stopped on exit.

    `model_dir` None means `cfg.model.model_dir` (the `MODEL` environment name). `reader`
    replaces the SSD reader of a streamed model (an `ExpertReader`; the engine closes it).
    `warm_up` runs a throwaway forward first, so the first prompt's prefill time is not MLX's
    one-time start-up; `stats()` has the seconds of both (`load_s`, `warmup_s`).

    `distributed` (default `distributed.enabled`): this process is one rank of an
    `mx.distributed` ring started by `mlx.launch` (docs/distributed.md), running its share of
    the layers. On rank 0 the engine is used as usual; on the other ranks entering the block
    serves rank 0's steps until rank 0 closes its engine, then yields an engine with
    `eng.rank` > 0 that does not generate. A lost rank is a DistributedError naming it.

    `memory="8GB"` (`plan.memory`) plans the pool for that budget before the model loads
    (qnpipe.plan.startup: from `plan.log`, the model's recorded log, or a synthetic one; cached);
    the plan is `eng.plan`. A budget that cannot fit is a ConfigError naming the smallest that does.
    Distributed, the budget is each rank's own: the layers are split by the memory account and each
    rank plans its own (`eng.plan` is this rank's; a rank whose budget is too small is named).
    """
    check_trio()
    cfg = resolve(model_dir, cfg, settings_of(settings, overrides))
    # Checked before anything else: MLX's ring crashes on launch variables it cannot use.
    launch = read_launch() if (cfg.distributed.enabled if distributed is None else distributed) else None
    cfg, plan = planned(cfg, distributed)
    thread = MLXThread.shared()
    t0 = time.perf_counter()
    ring = stage = None
    if launch is not None:
        from qnpipe.live.parallel.join import join

        ring, stage, cfg, rank_plan = await join(cfg, thread, launch)
        plan = plan if rank_plan is None else rank_plan
    core = await run_on(thread, load_model, Path(cfg.model.model_dir), cfg, reader, stage)
    load_s = time.perf_counter() - t0
    try:
        warmup_s = await run_on(thread, warm_up_model, core) if warm_up else 0.0
        t1 = time.perf_counter()
        lost: DistributedError | None = None
        async with open_model_pipeline(core, thread) as pipe:
            load_s += time.perf_counter() - t1
            rank = 0 if ring is None else ring.rank
            lead = peers = keep_alive = None
            if ring is not None and ring.size > 1:
                from qnpipe.live.parallel.follow import follow
                from qnpipe.live.parallel.lead import Lead
                from qnpipe.live.parallel.snap import RankStates, RingPeers

                if rank > 0:
                    states = RankStates(cfg.prefix, lambda: engine_fingerprint(core), _layers_tag(core), rank)
                    opts = spec_options(cfg, mtp_streamed=core.streaming is not None and core.streaming.mtp is not None)
                    try:
                        with deferring_ctrl_c(rank):  # rank 0 stops the ring (in trio's main thread)
                            await follow(pipe.forward, thread, core.runner.loaded.model, ring, states, core.mtp, opts)
                    except DistributedError as e:  # raised below, not inside the actors' nursery's group
                        lost = e
                else:
                    from qnpipe.live.parallel.keepalive import KeepAlive

                    lead = Lead(ring, core.args.vocab_size, pipe.forward)
                    core.backend.ring_tail = lead.tail
                    peers = RingPeers(lead, thread, cfg.mtp.num_draft_tokens if core.mtp_ring else 0)
                    keep_alive = KeepAlive(ring, thread)
                    keep_alive.start()
            if lost is None:
                try:
                    yield AsyncEngine(_Runtime(core, thread, pipe, load_s=load_s, warmup_s=warmup_s, rank=rank,
                                               peers=peers), plan)
                finally:
                    if keep_alive is not None:
                        keep_alive.stop()
                    if lead is not None:
                        with trio.CancelScope(shield=True):
                            await run_on(thread, lead.close)
        if lost is not None:
            raise lost
    finally:
        with trio.CancelScope(shield=True):
            await run_on(thread, release_model, core)


class Engine:
    """Synchronous engine: `with qnpipe.Engine(model_dir, **overrides) as eng: ...`.

    `overrides` are configuration fields by name (`expert_slots=32`, `prefill_chunk_tokens=0`,
    `memory__mlx_cache_limit_gb=2` for `memory.mlx_cache_limit_gb`), and `settings` a mapping of
    any setting names (`settings={"memory.mlx_cache_limit_gb": 2}`), applied on top of defaults,
    the TOML file and the environment (see docs/config.md);
    `model_dir` None means `cfg.model.model_dir` (the `MODEL` environment name). The
    pipeline runs as tasks of the MLX thread's trio loop (qnpipe.live.mlx_thread), apart from the
    caller's thread; with prefetch on (`predict.cross_layer_prefetch`) in a trio loop on a
    thread of its own, so read completions are taken while the model computes. `loop_thread`
    is the thread that loop runs on (for measuring it, as tools/bench_stream.py does).
    `warm_up`, `distributed`, `memory` (`Engine(model_dir, memory="8GB")`): as `open_engine`'s;
    the plan applied is `self.plan`.
    """

    def __init__(self, model_dir: str | Path | None = None, cfg: Config | None = None, *,
                 reader: ExpertReader | None = None, warm_up: bool = False, distributed: bool | None = None,
                 settings: Mapping[str, Any] | None = None, **overrides: Any):
        # Planned here, in the caller's thread, before the model loads (open_engine then finds it applied).
        self.cfg, self.plan = planned(resolve(model_dir, cfg, settings_of(settings, overrides)), distributed)
        self._distributed = distributed
        self._reader = reader
        self._warm_up = warm_up
        self.model_dir = Path(self.cfg.model.model_dir)
        self._aeng: AsyncEngine | None = None
        self._last_stats = EngineStats()
        self._token: trio.lowlevel.TrioToken | None = None
        self._closing: trio.Event | None = None
        self._nursery: trio.Nursery | None = None
        started: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._loop: concurrent.futures.Future[None]
        if self.cfg.predict.cross_layer_prefetch:
            # Prefetch reads complete while the model computes: a loop blocked in inline MLX calls
            # would take their completions and issue the next reads only between layers (measured
            # side by side: 10x the late misses). So this loop gets a thread of its own.
            self._loop = concurrent.futures.Future()
            self.loop_thread = threading.Thread(target=self._run_own, args=(started,), name="qnpipe-engine",
                                                daemon=True)
            self.loop_thread.start()
        else:
            # The pipeline's tasks run in the MLX thread's loop: no thread hand-off per MoE layer.
            self.loop_thread = MLXThread.shared().thread
            self._loop = MLXThread.shared().host(partial(self._main, started))
        # A later rank of a ring is open once rank 0 stopped it: this thread waits until then.
        with deferring_ctrl_c(launch_rank()[0] if self.cfg.distributed.enabled else None):
            started.result()

    def _run_own(self, started: concurrent.futures.Future[None]) -> None:
        try:
            self._loop.set_result(trio.run(self._main, started))
        except BaseException as e:  # close() re-raises it
            self._loop.set_exception(e)

    async def _main(self, started: concurrent.futures.Future[None]) -> None:
        try:
            async with open_engine(cfg=self.cfg, reader=self._reader, warm_up=self._warm_up,
                                   distributed=self._distributed) as eng, \
                    trio.open_nursery() as nursery:
                self._aeng, self._nursery = eng, nursery
                if eng.plan is not None:  # distributed: the rank's own, made once the ring split the layers
                    self.plan = eng.plan
                self._token = trio.lowlevel.current_trio_token()
                self._closing = trio.Event()
                started.set_result(None)
                await self._closing.wait()
                self._last_stats = eng.stats()
                nursery.cancel_scope.cancel()
        except BaseException as e:
            if not started.done():
                started.set_exception(e)
                return
            raise

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the actors and release the model (its memory is freed once no result refers to it)."""
        if self._aeng is None:
            return
        closing, token = self._closing, self._token
        assert closing is not None and token is not None
        token.run_sync_soon(closing.set)
        self._loop.result()
        self._aeng = None

    @property
    def _eng(self) -> AsyncEngine:
        if self._aeng is None:
            raise RuntimeError("this Engine is closed")
        return self._aeng

    def _call(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """Run `await fn(*args)` in the engine's loop; a KeyboardInterrupt here cancels it first."""
        eng, token, nursery = self._eng, self._token, self._nursery
        assert token is not None and nursery is not None
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        scope = trio.CancelScope()

        async def job() -> None:
            try:
                with scope:
                    res = await fn(*args)
            except Exception as e:
                fut.set_exception(e)
                return
            except BaseException:
                # The loop itself is going (its nursery cancelled, a KeyboardInterrupt in its
                # thread): the caller must still be answered, or it waits forever.
                fut.set_exception(PipelineError("the engine's loop stopped while a call was running"))
                raise
            if scope.cancelled_caught:
                fut.set_exception(KeyboardInterrupt())
            else:
                fut.set_result(res)

        del eng
        token.run_sync_soon(nursery.start_soon, job)  # non-blocking: also safe from another trio thread
        try:
            return fut.result()
        except KeyboardInterrupt:
            if not fut.done():
                token.run_sync_soon(scope.cancel)
                concurrent.futures.wait([fut])
            raise

    @property
    def tokenizer(self) -> Any:
        return self._eng.tokenizer

    @property
    def rank(self) -> int:
        """As `AsyncEngine.rank`: with `distributed`, a rank > 0 returns from the constructor once rank 0 closed."""
        return self._eng.rank

    @property
    def args(self) -> Any:
        """The model's ModelArgs (sizes, layer kinds)."""
        return self._eng.args

    def encode(self, text: str) -> list[int]:
        return self._call(self._eng.encode, text)

    def logits(self, prompt: Prompt) -> np.ndarray:
        """Logits `(len, vocab)` float32 of `prompt` (text or token ids) as a fresh sequence."""
        return self._call(self._eng.logits, prompt)

    def next_logits(self, prompt: Prompt) -> np.ndarray:
        """Logits `(vocab,)` float32 of the token after `prompt` (prefix snapshots used as in `generate`)."""
        return self._call(self._eng.next_logits, prompt)

    def generate(self, prompt: Prompt, *, max_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int | None = None, stop_at_eos: bool = True,
                 on_text: Callable[[str], None] | None = None,
                 on_prefill: Callable[[int, int], None] | None = None,
                 partial: list[int] | None = None, top_k: int = 0, min_p: float = 0.0) -> GenerateResult:
        """As `AsyncEngine.generate`; the callbacks run on the engine's loop thread.

        A KeyboardInterrupt while waiting stops the generation at its next layer, then
        propagates; `partial` then holds the tokens generated so far.
        """
        gen_kwargs(prompt, max_tokens, temperature, top_p, seed, stop_at_eos, top_k, min_p)  # errors in the caller's thread
        eng = self._eng

        async def run() -> GenerateResult:
            return await eng.generate(prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                      seed=seed, stop_at_eos=stop_at_eos, on_text=on_text,
                                      on_prefill=on_prefill, partial=partial, top_k=top_k, min_p=min_p)

        return self._call(run)

    def render_chat(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None,
                    *, add_generation_prompt: bool = True) -> str:
        """As `AsyncEngine.render_chat` (pure text work: runs in the caller's thread)."""
        return self._eng.render_chat(messages, tools, add_generation_prompt=add_generation_prompt)

    def stats(self) -> EngineStats:
        """Totals since the engine opened (still readable after close)."""
        if self._aeng is None:
            return self._last_stats

        async def snap() -> EngineStats:
            return self._eng.stats()

        return self._call(snap)

    def summary(self) -> str:
        """`stats()` as the lines `qnpipe generate --stats` prints: totals, BLAS, experts, pool occupancy."""
        return "\n".join(summary_lines(self.stats()))
