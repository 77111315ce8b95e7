"""`qnpipe convert`: an original HF or mlx-lm converted Qwen3-Next checkpoint, or an mlx-lm directory of any
other MoE family (`qnpipe.convert.family`) -> a qnpipe model directory.

Output (docs/store-format.md): `config.json` (the model's, plus mlx-lm's `quantization` when
quantized, plus a `qnpipe` section), the non-expert weights in mlx-lm naming
(`model.safetensors` or shards), `mtp.safetensors` (HF naming), the tokenizer files, and
`experts/` (one record file per MoE layer + `index.json`).

Memory: tensors are read with one pread each, transformed in MLX and streamed to the output,
so the peak is about one chunk of experts (`CHUNK_BYTES` of source data), never the model.
Atomicity: everything is written into a locked temporary sibling of the output and put in
its place at the end (qnpipe.io.outdir.atomic_dir); errors, SIGINT and SIGTERM remove it, and a
later convert removes what a killed one left behind (restoring an output it had moved aside).

Here: the entry point, the report and the expert-layer writer. The plan (what is written and
how each tensor is transformed) is `qnpipe.convert.plan`; the streaming safetensors writer is
`qnpipe.convert.safetensors_out`; the atomic output directory and progress bar are `qnpipe.io.outdir`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from qnpipe.convert import hub
from qnpipe.convert.hub_check import check_remote
from qnpipe.convert.plan import (
    BITS,
    DTYPES,
    GROUP_SIZES,
    PROJS,
    ConvertPlan,
    ExpertLayerPlan,
    make_plan,
    out_float_dtype,
    record_tensors,
    transform,
)
from qnpipe.convert.records import write_expert_layer
from qnpipe.convert.report import MODEL_FORMAT, MODEL_VERSION, ConvertReport, experts_section
from qnpipe.convert.safetensors_out import plan_shards, safetensors_nbytes, write_model_shards, write_safetensors
from qnpipe.errors import CheckpointError, ConfigError, QnpipeError
from qnpipe.io import store as st
from qnpipe.io.outdir import (
    ByteProgress,
    Log,
    atomic_dir,
    check_output_location,
    check_replaceable,
    clean_stale,
    fsync_dir,
    human_bytes,
    output_path,
    peak_rss,
)
from qnpipe.io.store_format import LayerFile, Quant, StoreIndex, quant_dict
from qnpipe.model.args import ModelArgs, args_from_dict, model_id, read_config
from qnpipe.model.checkpoint import Layout, detect_layout, is_qnpipe_dir, scan

__all__ = ["CHUNK_BYTES", "MAX_SHARD_BYTES", "ROW_BLOCK_BYTES", "MODEL_FORMAT", "MODEL_VERSION", "ConvertReport", "convert"]

MODES = ("affine", "mxfp4", "nvfp4", "mxfp8")  # mlx-lm's quantization modes (qnpipe.convert.family_hf)
MAX_SHARD_BYTES = 5 << 30  # like mlx-lm's save_model
CHUNK_BYTES = 256 << 20  # source bytes of experts transformed at once
ROW_BLOCK_BYTES = 64 << 20  # source bytes of a large non-expert matrix transformed at once
# The sizes above are `convert`'s defaults; its keyword arguments of the same names override them.


# --------------------------------------------------------------------------- the expert layers


def _expert_chunk(el: ExpertLayerPlan, e0: int, e1: int) -> dict[str, np.ndarray]:
    """Record tensor name -> stacked output `[e1 - e0, ...]` for experts e0..e1 of one layer."""
    src = el.read(e0, e1)
    out: dict[str, np.ndarray] = {}
    for proj in PROJS:
        if el.quant_in[proj] is not None:
            for part in ("weight", "scales", "biases"):
                a = src[f"{proj}.{part}"]
                st_dtype = "U32" if part == "weight" else el.src_st[f"{proj}.scales"]
                cast = el.cast if part != "weight" and out_float_dtype(st_dtype, el.cast) != st_dtype else None
                out[f"{proj}.{part}"] = transform(a, st_dtype, cast=cast)[0]
            continue
        key = proj if proj in src else f"{proj}.weight"
        st_dtype = el.src_st[proj]
        cast = el.cast if out_float_dtype(st_dtype, el.cast) != st_dtype else None
        res = transform(src[key], st_dtype, cast=cast, quant=el.quant_out[proj])
        names = ("weight", "scales", "biases") if el.quant_out[proj] else ("weight",)
        out.update({f"{proj}.{n}": r for n, r in zip(names, res, strict=True)})
    return out


def _write_expert_layer(experts_dir: Path, el: ExpertLayerPlan, tensors: list[tuple[str, str, tuple[int, ...]]],
                        num_experts: int, advance: Callable[[int], None], chunk_bytes: int) -> LayerFile:
    names = {t[0] for t in tensors}
    quant = {p: _layer_quant(el, p) for p in PROJS if f"{p}.scales" in names} or None
    return write_expert_layer(experts_dir, el.layer, lambda e0, e1: _expert_chunk(el, e0, e1), tensors, quant,
                              num_experts, el.src_bytes_per_expert, advance, chunk_bytes)


def _layer_quant(el: ExpertLayerPlan, proj: str) -> Quant:
    q = el.quant_in[proj]
    if q is not None:
        return q
    qo = el.quant_out[proj]
    assert qo is not None
    return qo


# --------------------------------------------------------------------------- the directory, atomically


def _check_paths(src: Path, out: Path, mtp_from: Path | None, force: bool) -> None:
    if not src.is_dir():
        raise CheckpointError(f"{src}: not a directory")
    for p, what in ((src, "SRC"), (mtp_from, "--mtp-from")):
        if p is not None and (p == out or out in p.parents):
            raise ConfigError(f"--out {out} must not be {what} {p} or contain it")
    from qnpipe.io.clobber import check_outputs

    check_outputs([("--out", out)], models=[("SRC", src), ("--mtp-from", mtp_from)])
    check_replaceable(out, force, "--out")


def convert(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    bits: int | None = None,
    group_size: int | None = None,
    mode: str | None = None,
    dtype: str | None = None,
    mtp_bits: int = 4,
    mtp_from: str | os.PathLike[str] | None = None,
    force: bool = False,
    progress: bool = False,
    log: Log | None = None,
    hub_timeout_s: float = hub.HUB_TIMEOUT_S,
    chunk_bytes: int = CHUNK_BYTES,
    row_block_bytes: int = ROW_BLOCK_BYTES,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> ConvertReport:
    """Convert checkpoint `src` (original HF or mlx-lm layout) into the qnpipe model directory `out`.

    `src` (and `mtp_from`) is a directory or a Hugging Face repository id (`owner/name[@revision]`),
    fetched into the hub cache first (qnpipe.convert.hub), every connect and read waiting at most
    `hub_timeout_s`; a family qnpipe does not run, or a download and output larger than the free disk,
    is refused from its config.json and file list before the download (qnpipe.convert.hub_check).

    `bits`/`group_size` (default 64) quantize an unquantized source exactly as `mlx_lm.convert -q`
    does (router and shared-expert gate at 8 bits / 64); `mode` (affine, mxfp4, nvfp4, mxfp8) applies to
    an original HF checkpoint of another family, which goes through mlx-lm's own conversion first
    (`qnpipe.convert.family_hf`: `bits`, `group_size`, `mode` and `dtype` are its options); `dtype`
    casts float tensors (default: the
    config's torch_dtype for HF sources, as mlx-lm does; unchanged for mlx-lm sources).
    `mtp_bits` quantizes the MTP head (0 keeps it float); `mtp_from` is the original checkpoint
    to take `mtp.*` from when `src` has none. `log` receives warnings and notices. `chunk_bytes`
    (source bytes of experts transformed at once), `row_block_bytes` (of a large non-expert
    matrix) and `max_shard_bytes` (per output shard) bound memory and file sizes.

    Raises CheckpointError (bad source), ConfigError (bad options), QnpipeError (not enough
    disk space: both numbers), FileExistsError (`out` exists and `force` is false), OutputError
    (`out` cannot be written, or is not something `force` may replace: outdir.check_replaceable).
    Nothing is left at `out` or beside it unless the convert succeeds.
    """
    t0 = time.perf_counter()
    log = log or (lambda msg: None)
    out_p = output_path(out)
    if bits is not None and bits not in BITS:
        raise ConfigError(f"--bits must be one of {', '.join(map(str, BITS))}, got {bits}")
    if mtp_bits and mtp_bits not in BITS:
        raise ConfigError(f"--mtp-bits must be 0 (float) or one of {', '.join(map(str, BITS))}, got {mtp_bits}")
    if group_size is not None and group_size not in GROUP_SIZES:
        raise ConfigError(f"--group-size must be one of {', '.join(map(str, GROUP_SIZES))}, got {group_size}")
    if mode is not None and mode not in MODES:
        raise ConfigError(f"--mode must be one of {', '.join(MODES)}, got {mode!r}")
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if out_p.name and out_p.parent.is_dir():  # first: a replace cut short may have left the only copy of `out` aside
        clean_stale(out_p.parent, out_p.name, log)
    if any(p is not None and hub.hub_id(p) is not None for p in (src, mtp_from)):
        check_replaceable(out_p, force, "--out")  # before a download from the Hub, not after
    before = functools.partial(check_remote, out=out_p, bits=bits, group_size=group_size, mode=mode, dtype=dtype)
    src_p = hub.fetch(src, progress=progress, timeout_s=hub_timeout_s, log=log, check=before).resolve()
    mtp_p = (hub.fetch(mtp_from, what="--mtp-from", progress=progress, timeout_s=hub_timeout_s, log=log).resolve()
             if mtp_from is not None else None)
    _check_paths(src_p, out_p, mtp_p, force)
    existing = check_output_location(out_p, "--out")

    config = read_config(src_p)
    if is_qnpipe_dir(src_p, config):  # never sanitized or converted twice
        raise CheckpointError(f"{src_p} is already a qnpipe model directory (nothing to convert)")
    mt = config.get("model_type")
    if isinstance(mt, str) and mt != "qwen3_next":  # any other family: its mlx-lm directory, re-laid out
        from qnpipe.convert.family import convert_family

        opts = {"--bits": bits, "--group-size": group_size, "--mode": mode, "--dtype": dtype, "--mtp-from": mtp_from}
        return convert_family(src_p, out_p, config, scan(src_p), existing=existing, progress=progress, log=log,
                              chunk_bytes=chunk_bytes, row_block_bytes=row_block_bytes,
                              max_shard_bytes=max_shard_bytes, t0=t0, options=opts)
    if mode not in (None, "affine"):
        raise ConfigError(f"--mode {mode} applies to other families' Hugging Face checkpoints (mlx-lm's conversion); "
                          f"{src_p} is a qwen3_next model, quantized affine by qnpipe's own convert")
    group_size = 64 if group_size is None else group_size
    args = args_from_dict(config, str(src_p / "config.json"))
    infos = scan(src_p)
    layout = detect_layout(infos, src_p)
    if not args.moe_layers:
        raise CheckpointError(f"{src_p / 'config.json'}: the model has no MoE layers (num_experts "
                              f"{args.num_experts}); there are no experts to store")
    plan = make_plan(src_p, config, args, infos, layout, bits=bits, group_size=group_size, dtype=dtype,
                 mtp_bits=mtp_bits, mtp_from=mtp_p, row_block_bytes=row_block_bytes)
    for w in plan.warnings:
        log(f"warning: {w}")
    records = [record_tensors(el, args) for el in plan.experts]
    expert_bytes = sum(st.record_layout(r)[2] * args.num_experts for r in records)
    main_bytes = sum(safetensors_nbytes(s) for s in plan_shards(plan.main, max_shard_bytes))
    mtp_bytes = safetensors_nbytes(plan.mtp) if plan.mtp else 0
    small = sum(p.stat().st_size for p in plan.extra_files) + (1 << 20) + 64 * len(records) * args.num_experts
    need = expert_bytes + main_bytes + mtp_bytes + small

    parent = out_p.parent
    free = shutil.disk_usage(existing).free
    if free < need:
        raise QnpipeError(f"not enough free disk space in {existing}: the conversion needs {need} bytes "
                          f"({human_bytes(need)}), {free} bytes ({human_bytes(free)}) are available")
    parent.mkdir(parents=True, exist_ok=True)

    bar = ByteProgress(progress, expert_bytes + main_bytes + mtp_bytes, "non-expert weights")
    try:
        with atomic_dir(out_p, marker="qnpipe convert") as build:
            index, index_sha256 = _write_all(build, plan, records, args, bar, chunk_bytes=chunk_bytes,
                                             max_shard_bytes=max_shard_bytes)
            cfg = dict(plan.config)
            cfg["qnpipe"] = _qnpipe_section(layout, plan, index, index_sha256, mtp_p)
            (build / "config.json").write_text(json.dumps(cfg, indent=4) + "\n")
            bar.stop()
    finally:
        bar.stop()
    seconds = time.perf_counter() - t0
    written = expert_bytes + main_bytes + mtp_bytes
    q0 = index.layers[0].quant
    return ConvertReport(
        out=str(out_p), source_layout=str(layout), moe_layers=len(index.layers), num_experts=args.num_experts,
        quantization=quant_dict(q0["gate_proj"]) if q0 else None, dtype=plan.float_dtype,
        mtp=bool(plan.mtp), bytes_written=written, expert_bytes=expert_bytes, seconds=seconds,
        bytes_per_s=written / seconds if seconds > 0 else 0.0, peak_rss_bytes=peak_rss(),
        warnings=tuple(plan.warnings),
    )


def _write_all(build: Path, plan: ConvertPlan, records: list[list[tuple[str, str, tuple[int, ...]]]], args: ModelArgs,
               bar: ByteProgress, *, chunk_bytes: int, max_shard_bytes: int) -> tuple[StoreIndex, str]:
    """Every file of the model directory except config.json, into `build`; returns the store index and the
    sha256 of its `index.json` (config.json names the store by it)."""
    (build / st.EXPERTS_DIR).mkdir()
    write_model_shards(build, plan.main, max_shard_bytes, bar.advance)
    if plan.mtp:
        bar.describe("MTP weights")
        write_safetensors(build / "mtp.safetensors", plan.mtp, bar.advance)
    layer_files = []
    for el, rec in zip(plan.experts, records, strict=True):
        bar.describe(f"experts, layer {el.layer}")
        layer_files.append(_write_expert_layer(build / st.EXPERTS_DIR, el, rec, args.num_experts, bar.advance,
                                               chunk_bytes))
        _clear_mlx_cache()
    index = StoreIndex(model_id=model_id(args), layers=tuple(layer_files))
    index_sha256 = hashlib.sha256(st.write_index(build / st.EXPERTS_DIR, index).read_bytes()).hexdigest()
    fsync_dir(build / st.EXPERTS_DIR)
    for f in plan.extra_files:
        shutil.copyfile(f, build / f.name)
    return index, index_sha256


def _clear_mlx_cache() -> None:
    import mlx.core as mx

    mx.clear_cache()


def _qnpipe_section(layout: Layout, plan: ConvertPlan, index: StoreIndex, index_sha256: str,
                    mtp_from: Path | None) -> dict[str, Any]:
    lf = index.layers[0]
    q = lf.quant
    return {
        "format": MODEL_FORMAT,
        "version": MODEL_VERSION,
        "source_layout": str(layout),
        "dtype": plan.float_dtype,
        "quantization": {k: quant_dict(v) for k, v in q.items()} if q else None,
        "experts": experts_section(index, index_sha256),
        "mtp": None if not plan.mtp else {
            "file": "mtp.safetensors",
            "naming": "hf",
            "norms": "zero-centred (as in the HF checkpoint; the model adds 1)",
            "experts": "per-expert tensors mtp.layers.0.mlp.experts.E.*",
            "quantization": plan.mtp_qcfg,
            "from": "source" if mtp_from is None else "mtp-from",
        },
    }
