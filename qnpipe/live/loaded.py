"""The live engine's model side: the loaded model, its expert slots and store, the MLX-thread backend.

`load_model` runs on the MLX thread and makes what MLX owns: the model (without its
routed experts when they stream), the slot arrays, and the reader over the expert
store. `open_model_pipeline` starts the actors (qnpipe.actors.pipeline.open_pipeline) over the
live device: the SSD reader filling those slot arrays. Replay wires the same actors to
a simulated device and needs none of this, so it lives apart from the wiring and replay
never imports MLX's model code.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import trio

from qnpipe.actors.autopin import Autopin
from qnpipe.actors.pipeline import Pipeline, layer_capacities, open_pipeline, side_slots
from qnpipe.config import Config, PoolCfg
from qnpipe.errors import ConfigError, RouteError
from qnpipe.io.device import StoreDevice
from qnpipe.io.reader import ExpertReader
from qnpipe.io.store import ExpertStore
from qnpipe.live.mlx_thread import MLXThread, run_on
from qnpipe.live.streaming import Streaming
from qnpipe.model.args import ModelArgs, model_id
from qnpipe.model.checkpoint import Layout
from qnpipe.model.runner import Runner
from qnpipe.model.slots import make_layer_slots
from qnpipe.model.stage import Stage
from qnpipe.model.stepper import MlxBackend
from qnpipe.policy.predict import predict_targets
from qnpipe.steps import Event, Hits, LayerRoute, PartGrant, PredictPlan, Tail
from qnpipe.trace import ModelShape
from qnpipe.trace.format import RunPart


@attrs.define
class LoadedModel:
    """The engine's MLX-side state (touched only on the MLX thread)."""

    cfg: Config
    runner: Runner
    streaming: Streaming | None
    backend: Any  # MlxBackend (native) or the generic tier's (qnpipe.live.family)
    mtp: Any = None  # the MTP head (qnpipe.model.mtp.MtpHead) when `mtp.enabled` and the model has one
    stage: Stage | None = None  # pipeline parallel: this rank's layers (qnpipe.model.stage)
    # Pipeline parallel, rank 0: `mtp.enabled` and the model has an MTP head, which the last rank runs
    # (qnpipe.live.parallel.speculate).
    mtp_ring: bool = False

    @property
    def args(self) -> ModelArgs:
        """The native ModelArgs, or a generic-tier model's FamilyArgs (the same names the engine reads)."""
        return self.runner.loaded.args

    @property
    def generic(self) -> bool:
        return getattr(self.runner.loaded, "tier", "native") == "generic"


def load_model(model_dir: Path, cfg: Config, reader: ExpertReader | None = None, stage: Stage | None = None) -> LoadedModel:
    """Load the model and, when its experts stream, the pool's memory and reader. MLX thread only.

    `reader` replaces the SSD reader made from `cfg.read` (fault injection, slow devices);
    the engine closes it with the store. `stage` (pipeline parallel): only its layers, their
    weights, slots and pool.
    """
    from qnpipe.compute import blas
    from qnpipe.io.ssd import SsdReader
    from qnpipe.model.args import read_config
    from qnpipe.model.checkpoint import is_qnpipe_dir
    from qnpipe.model.memory import apply_memory_limits

    apply_memory_limits(cfg.memory)
    # Before the model computes anything: the batch-invariant mode is process-wide.
    blas.apply(cfg.compute)
    config = read_config(model_dir)
    stream = not cfg.pool.eager_load and is_qnpipe_dir(model_dir, config)
    if is_generic(config, cfg):
        from qnpipe.live.family import check_generic_cfg, load_generic

        check_generic_cfg(cfg, str(config["model_type"]), stage)  # before any weight is read
        runner = Runner(model_dir, prefill_chunk=cfg.forward.prefill_chunk_tokens,
                        expert_dir=cfg.model.expert_dir or None, resident_experts=not stream,
                        verify=cfg.read.verify_crc32, tier="generic")
        streaming, backend = load_generic(cfg, runner, model_dir, stream, reader)
        return LoadedModel(cfg, runner, streaming, backend, None, stage)
    runner = Runner(model_dir, prefill_chunk=cfg.forward.prefill_chunk_tokens,
                    expert_dir=cfg.model.expert_dir or None, resident_experts=not stream,
                    verify=cfg.read.verify_crc32, topk_override=cfg.forward.moe_topk_override, stage=stage)
    if (k := cfg.forward.moe_topk_override) is not None:
        _override_topk(runner, k)
    if cfg.kv.quantize:
        from qnpipe.model.kvquant import kv_factory

        runner.loaded.model.kv_factory = kv_factory(cfg.kv, runner.loaded.args.head_dim)
    mtp_ring = False
    if stage is not None and stage.size > 1 and cfg.mtp.enabled:
        # Only the last rank holds the head (its experts streamed through its pool as in one process);
        # rank 0 drives the rounds; the others only see verify steps.
        if stage.last:
            mtp, mtp_path = _load_mtp(cfg, runner, model_dir, resident=not stream)
            stream_mtp = mtp is not None
        else:
            mtp, mtp_path = None, model_dir
            mtp_ring = stage.first and _has_mtp(cfg, runner, model_dir)
            stream_mtp = False
    else:
        mtp, mtp_path = _load_mtp(cfg, runner, model_dir, resident=not stream)
        stream_mtp = mtp is not None
    if not stream:
        asked = cfg.pool.expert_slots != PoolCfg().expert_slots or cfg.pool.capacity_profile_path
        if asked and not cfg.pool.eager_load and runner.loaded.layout is not Layout.QNPIPE:
            warnings.warn(f"{model_dir} has no expert store: every expert is resident "
                          f"(`qnpipe convert` makes a directory whose experts stream)", stacklevel=2)
        return LoadedModel(cfg, runner, None, MlxBackend(runner.loaded.model, None), mtp, stage, mtp_ring)
    args = runner.loaded.args
    store = ExpertStore.open(cfg.model.expert_dir or model_dir)
    try:
        caps = layer_capacities(cfg, args)
        if stage is not None:
            caps = {layer: cap for layer, cap in caps.items() if stage.holds(layer)}
        side = side_slots(cfg)
        # One stacked array per layer holds the resident slots and, after them, the side region.
        slots = {layer: make_layer_slots(store.layer_file(layer), cap + side) for layer, cap in caps.items()}
        mtp_layer = None
        if stream_mtp:  # the head's MoE: a pool layer of its own, read from mtp.safetensors
            from qnpipe.live.mtp.mtp_store import MtpLayer

            mtp_layer = MtpLayer.open(args, mtp_path, SsdReader.from_config(cfg.read))
            caps[mtp_layer.layer] = min(cfg.pool.expert_slots, args.num_experts)
            slots[mtp_layer.layer] = make_layer_slots(mtp_layer.file, caps[mtp_layer.layer] + side)
        reader = reader if reader is not None else SsdReader.from_config(cfg.read)
    except BaseException:
        store.close()
        raise
    streaming = Streaming(store, reader, slots, caps, mtp_layer)
    plan = None
    if cfg.predict.cross_layer_prefetch:
        # A rank predicts for its own layers only: it has no other layer's gate.
        local = tuple(layer for layer in args.moe_layers if stage is None or stage.holds(layer))
        plan = PredictPlan(predict_targets(local, cfg.predict), cfg.predict.width_experts,
                           cfg.predict.use_moe_input)
    traced = bool(cfg.trace.event_log_path or cfg.trace.route_trace)
    backend = MlxBackend(runner.loaded.model, {layer: s.experts for layer, s in slots.items()}, plan, traced)
    if cfg.forward.speculate_hits:
        backend.speculate(streaming.writes)
    return LoadedModel(cfg, runner, streaming, backend, mtp, stage, mtp_ring)


def is_generic(config: dict[str, Any], cfg: Config) -> bool:
    """Whether the model of `config` runs on the generic tier (qnpipe.model.load.load_model's choice)."""
    from qnpipe.config import ModelTier
    from qnpipe.model.load import NATIVE_TYPES

    mt = config.get("model_type")
    return mt is not None and (mt not in NATIVE_TYPES or cfg.model.tier == ModelTier.GENERIC)


def _load_mtp(cfg: Config, runner: Runner, model_dir: Path, resident: bool) -> tuple[Any, Path]:
    """(the MTP head when `mtp.enabled`, the file it came from); a model without MTP weights runs
    without, and says so once.

    `model.mtp_weights_path` names another file of HF-named `mtp.*` tensors. Streamed
    (`resident` False), the head's experts stay in that file: the pool reads them.
    """
    path = model_dir / "mtp.safetensors"
    if not cfg.mtp.enabled:
        return None, path
    from qnpipe.model.checkpoint import load_tensors, read_header
    from qnpipe.model.mtp import load_mtp

    weights = runner.loaded.mtp_weights
    if cfg.model.mtp_weights_path:
        path = Path(cfg.model.mtp_weights_path)
        if not path.exists():  # a FIFO or a directory there is read_header's error, naming what it is
            raise ConfigError(f"model.mtp_weights_path={path}: no such file")
        weights = {k: v for k, v in load_tensors(read_header(path)).items() if k.startswith("mtp.")}
    head = load_mtp(runner.loaded.args, weights, str(path if cfg.model.mtp_weights_path else model_dir),
                    resident_experts=resident)
    if head is None:
        warnings.warn(f"mtp.enabled: {model_dir} has no MTP weights (mtp.* / mtp.safetensors); generating "
                      f"without MTP speculation", stacklevel=3)
    return head, path


def _has_mtp(cfg: Config, runner: Runner, model_dir: Path) -> bool:
    """Whether `_load_mtp` would find MTP weights (read from no file: the last rank loads them)."""
    if cfg.model.mtp_weights_path:
        if not Path(cfg.model.mtp_weights_path).exists():
            raise ConfigError(f"model.mtp_weights_path={cfg.model.mtp_weights_path}: no such file")
        return True
    if not runner.loaded.mtp_weights:
        warnings.warn(f"mtp.enabled: {model_dir} has no MTP weights (mtp.* / mtp.safetensors); generating "
                      f"without MTP speculation", stacklevel=3)
        return False
    return True


def _override_topk(runner: Runner, k: int) -> None:
    from qnpipe.model.qwen3_next import SparseMoeBlock

    warnings.warn(f"forward.moe_topk_override={k}: every router picks {k} experts instead of "
                  f"{runner.loaded.args.num_experts_per_tok}; output differs from the model's (diagnostic only)",
                  stacklevel=3)
    for layer in runner.loaded.model.layers:
        if isinstance(layer.mlp, SparseMoeBlock):
            layer.mlp.top_k = k


def compare_slots_with_disk(st: Streaming, layer: int, experts: Sequence[int], slots: Sequence[int]) -> None:
    """read.verify_hit_bytes: each slot's tensors equal its expert's record on disk, else RouteError."""
    lf = st.store.layer_file(layer)
    host = st.slots[layer].host
    for e, s in zip(experts, slots, strict=True):
        rec = st.store.read_record(layer, e)
        for t in lf.tensors:
            if host[t.name][s].tobytes() != rec[t.offset:t.offset + t.nbytes]:
                raise RouteError(f"layer {layer}: slot {s} should hold expert {e}, but its {t.name} bytes "
                                 f"differ from {st.store.root / lf.file} at offset {e * lf.stride + t.offset}")


class ThreadedBackend:
    """The forward's `Backend` over an `MlxBackend` on the MLX thread."""

    def __init__(self, thread: MLXThread, backend: MlxBackend) -> None:
        self._thread = thread
        self._b = backend
        self.early_pairs = backend.early_pairs
        self._yield_after: Callable[[Event], bool] | None = None  # None: the other tasks' turn after every call

    def defer_route_yield(self) -> bool:
        """From now on a call that returns a route gives the other tasks no turn: the forward takes the route's
        turn first (its acquire, and the reads it asks for, on their way) and then gives it
        (qnpipe.actors.forward). True: done (always, here)."""
        self._yield_after = _not_route
        return True

    @property
    def takes_hits(self) -> bool:
        """Whether `begin` can take the forward's `hits` (and `first_sync`): a backend that runs them
        (`MlxBackend`), with its calls inline in the forward's own trio loop (the engine's MLX thread),
        so they are taken in that task's turn."""
        return getattr(self._b, "takes_hits", False) and threading.current_thread() is self._thread.thread

    async def begin(self, inputs: Any, cache: Any, tail: Tail, hits: Hits | None = None,
                    first_sync: Callable[[], bool] | None = None) -> Event:
        if hits is None and first_sync is None:
            return await run_on(self._thread, self._b.begin, inputs, cache, tail, yield_after=self._yield_after)
        if not self.takes_hits:
            raise AssertionError("hits and first_sync run in the forward's turn: its loop must be the MLX thread's")
        return await run_on(self._thread, self._b.begin, inputs, cache, tail, hits, first_sync,
                            yield_after=self._yield_after)

    async def resume(self, grant: PartGrant) -> Event:
        return await run_on(self._thread, self._b.resume, grant, yield_after=self._yield_after)

    async def abort(self) -> None:
        await run_on(self._thread, self._b.abort)



def _not_route(ev: Event) -> bool:
    return not isinstance(ev, LayerRoute)


@asynccontextmanager
async def open_model_pipeline(core: LoadedModel, thread: MLXThread) -> AsyncIterator[Pipeline]:
    """`open_pipeline` for a loaded `LoadedModel`: the live device over its store and slot arrays."""
    backend = ThreadedBackend(thread, core.backend)
    st = core.streaming
    if st is None:
        async with open_pipeline(core.cfg, backend, num_experts=core.args.num_experts, capacities=None,
                                 device=None, shape=ModelShape.of(core.args), wall_start_unix_s=time.time(),
                                 run=_run_part(core.stage)) as p:
            yield p
        return
    store_device = StoreDevice(st.store, st.reader, lambda layer, slot: st.slots[layer].dest(slot),
                               verify_crc32=core.cfg.read.verify_crc32, writes=st.writes)
    device: Any = store_device
    nbytes = {layer: st.store.layer_file(layer).record_nbytes for layer in st.capacities if layer != core.args.num_hidden_layers}
    if st.mtp is not None:
        device = st.mtp.routed(store_device, lambda layer, slot: st.slots[layer].dest(slot))
        nbytes[st.mtp.layer] = st.mtp.file.record_nbytes
    autopin = Autopin.open(core.cfg, model_id(core.args), core.args.num_experts_per_tok,
                           num_experts=core.args.num_experts,
                           layers=(*core.args.moe_layers, core.args.num_hidden_layers)  # + the MTP layer
                           if core.stage is None else tuple(st.capacities))

    async def check_bytes(layer: int, experts: tuple[int, ...], slots: tuple[int, ...]) -> None:
        if st.mtp is not None and layer == st.mtp.layer:
            return  # mtp.safetensors has no per-record checksum or store record to compare with
        await trio.to_thread.run_sync(compare_slots_with_disk, st, layer, experts, slots)

    try:
        async with open_pipeline(core.cfg, backend, num_experts=core.args.num_experts, capacities=st.capacities,
                                 device=device, record_nbytes=nbytes,
                                 check_bytes=check_bytes if core.cfg.read.verify_hit_bytes else None,
                                 autopin=autopin, shape=ModelShape.of(core.args),
                                 wall_start_unix_s=time.time(), run=_run_part(core.stage)) as p:
            yield p
    finally:
        store_device.close()


def _run_part(stage: Stage | None) -> RunPart | None:
    """What a rank's log headers say of its run (`trace merge` checks it); None outside a distributed run."""
    if stage is None or not stage.run_id:
        return None
    return RunPart(id=stage.run_id, rank=stage.rank, ranks=stage.size, lo=stage.lo, hi=stage.hi)


__all__ = ["LoadedModel", "Streaming", "ThreadedBackend", "compare_slots_with_disk", "load_model", "open_model_pipeline",
           "release_model", "warm_up_model"]


# The embedded API's start-up and close, here because they are MLX calls on a LoadedModel: the API
# (qnpipe.engine) stays a trio-only facade over the live engine.
def release_model(core: LoadedModel) -> None:
    """Drop the core's model and pool memory on the MLX thread and return MLX's cached buffers."""
    import mlx.core as mx

    if core.streaming is not None:
        core.streaming.close()
        core.streaming = None
    core.runner = None  # type: ignore[assignment]
    core.backend = None  # type: ignore[assignment]
    mx.clear_cache()


def warm_up_model(core: LoadedModel) -> float:
    """Pay MLX's one-time start-up (kernels built and loaded, first allocations) on a throwaway forward.

    A prompt-shaped and a decode-shaped step on a cache of their own; nothing of the engine's
    state (caches, pool, heat, event log, stats) sees them. Experts that stream run from slot
    0 of each layer's slot arrays, whatever it holds: only the time is kept. Returns seconds.
    """
    import mlx.core as mx

    from qnpipe.model.experts import switch_glu

    if core.generic:
        from qnpipe.live.family import warm_up_generic

        return warm_up_generic(core)
    model = core.runner.loaded.model
    t0 = time.perf_counter()
    streaming = core.streaming
    if streaming is not None:
        slots = streaming.slots

        def any_slot(layer: int, x: mx.array, experts: mx.array) -> mx.array:
            return switch_glu(slots[layer].experts, x, mx.zeros_like(experts))

        model.attach_experts(any_slot)
    try:
        cache = model.make_cache()
        n = max(1, min(4, model.args.vocab_size))
        if core.stage is None or core.stage.size == 1:
            mx.eval(model(mx.arange(n, dtype=mx.uint32)[None], cache))
            mx.eval(model(mx.zeros((1, 1), dtype=mx.uint32), cache))
        else:
            mx.eval(_stage_forward(model, core.stage, mx.arange(n, dtype=mx.uint32)[None], cache))
            mx.eval(_stage_forward(model, core.stage, mx.zeros((1, 1), dtype=mx.uint32), cache))
    finally:
        if streaming is not None:
            model.attach_experts(core.runner.loaded.experts)
        mx.clear_cache()
    return time.perf_counter() - t0


def _stage_forward(model: Any, stage: Stage, tokens: Any, cache: list[Any]) -> Any:
    """A throwaway forward of `stage`'s own layers (warm-up only): rank 0 embeds `tokens`, a later
    rank starts from zeros of their shape, the last applies the final norm and the LM head."""
    import mlx.core as mx
    from mlx_lm.models.base import create_attention_mask, create_ssm_mask

    from qnpipe.model.stage import Remote

    m = model.model
    own = [(layer, c) for layer, c in zip(m.layers, cache, strict=True) if not isinstance(layer, Remote)]
    if stage.first:
        h = m.embed_tokens(tokens)
    else:
        h = mx.zeros((*tokens.shape, model.args.hidden_size), dtype=own[0][0].input_layernorm.weight.dtype)
    for layer, c in own:
        # Each layer's own mask (another rank holds the cache the model-wide masks are made from).
        mask = create_attention_mask(h, c) if not layer.is_linear else create_ssm_mask(h, c)
        h = layer(h, mask, c)
    return model.head(m.norm(h)) if stage.last else h
