"""`qnpipe convert` of an mlx-lm model directory of any MoE family (every model type but qwen3_next).

mlx-lm saves its models after `sanitize`, with each switch's expert tensors stacked
`<switch path>.<linear>.<param>` `[E, ...]` and contiguous, so expert e of a tensor is one byte
range: a record is a few preads and no transform, bit-exact by construction. Which tensors are
experts is decided by module type on mlx-lm's own model class (`model.family.switches`), never
by name: a tensor under a switch's path that no expert linear owns stays non-expert.

Everything is checked from config.json and the safetensors headers before a weight is read:
the model type (one mlx-lm knows, and no `model_file` code), that the model has switches, whether
sanitize leaves the tensors as they are (an original Hugging Face checkpoint, which it changes, goes
through mlx-lm's own conversion first: `qnpipe.convert.family_hf`), and that every tensor is exactly
one of the skeleton's with its shape. Output: docs/store-format.md ("Index version 2").
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
import msgspec
import numpy as np

from qnpipe.convert.family_hf import as_hf_report, through_mlx_lm
from qnpipe.convert.plan import TOKENIZER_GLOBS
from qnpipe.convert.records import write_expert_layer
from qnpipe.convert.report import MODEL_FORMAT, MODEL_VERSION, ConvertReport, experts_section
from qnpipe.convert.safetensors_out import (
    OutTensor,
    WriteJob,
    plan_shards,
    safetensors_nbytes,
    write_model_shards,
)
from qnpipe.errors import CheckpointError, ConfigError, QnpipeError
from qnpipe.io import store as st
from qnpipe.io.dtypes import NAME_OF_ST
from qnpipe.io.outdir import ByteProgress, Log, atomic_dir, fsync_dir, human_bytes, peak_rss
from qnpipe.io.store_format import VERSION, Family, LayerFile, Quant, StoreIndex, quant_dict
from qnpipe.model.args import read_config
from qnpipe.model.checkpoint import TensorInfo, read_tensor, scan, weight_files
from qnpipe.model.family.skeleton import build_skeleton, family_info, text_config
from qnpipe.model.family.store_spec import family_block, headers_as_specs, linear_quant
from qnpipe.model.family.switches import expert_linears, expert_params, find_switches

__all__ = ["FamilyLayerPlan", "FamilyPlan", "convert_family", "plan_family"]

SOURCE_LAYOUT = "mlx"


@attrs.frozen
class FamilyLayerPlan:
    """One switch's records: tensors in record order, each read as slices of its source stack."""

    layer: int
    path: str  # the switch's module path
    tensors: tuple[tuple[str, str, tuple[int, ...]], ...]  # (record name, index dtype, per-expert shape)
    sources: dict[str, TensorInfo]  # record name -> the stacked source tensor
    quant: dict[str, Quant] | None
    num_experts: int

    @property
    def src_bytes_per_expert(self) -> int:
        return sum(i.nbytes for i in self.sources.values()) // self.num_experts

    def read(self, e0: int, e1: int) -> dict[str, np.ndarray]:
        """Experts e0..e1 of each record tensor: one pread of each stack's byte range."""
        out = {}
        for name, info in self.sources.items():
            per = info.nbytes // self.num_experts
            part = TensorInfo(info.file, info.dtype, (e1 - e0, *info.shape[1:]), info.offset + e0 * per,
                              (e1 - e0) * per)
            out[name] = read_tensor(part)
        return out


@attrs.define
class FamilyPlan:
    config: dict[str, Any]
    family: Family
    model_id: str
    num_experts: int
    layers: list[FamilyLayerPlan]
    main: list[WriteJob]
    float_dtype: str | None
    extra_files: list[Path] = attrs.Factory(list)
    warnings: list[str] = attrs.Factory(list)


def _copy_job(name: str, info: TensorInfo, row_block_bytes: int) -> WriteJob:
    """A non-expert tensor copied as it is (row blocks for a large one)."""
    out = OutTensor(name, info.dtype, info.shape)

    def run() -> Iterator[tuple[int, int, np.ndarray]]:
        if len(info.shape) < 2 or info.nbytes <= row_block_bytes:
            yield 0, 0, read_tensor(info)
            return
        rows = info.shape[0]
        row_bytes = info.nbytes // rows
        per = max(1, row_block_bytes // row_bytes)
        for r0 in range(0, rows, per):
            n = min(per, rows - r0)
            yield 0, r0 * row_bytes, read_tensor(TensorInfo(info.file, info.dtype, (n, *info.shape[1:]),
                                                            info.offset + r0 * row_bytes, n * row_bytes))

    return WriteJob((out,), run)


def sanitize_changes(src: Path, model: Any) -> list[str]:
    """The tensors mlx-lm's `sanitize` (re-run at every load) would change, add or drop: none for an
    mlx-lm directory, which is already sanitized. Lazily loaded: nothing is read."""
    if not hasattr(model, "sanitize"):
        return []
    weights: dict[str, mx.array] = {}
    for f in weight_files(src):
        weights.update(mx.load(str(f)))  # type: ignore[arg-type]  # lazy: the data is never evaluated here
    before = dict(weights)
    after = model.sanitize(dict(weights))
    return sorted(n for n in set(before) | set(after) if before.get(n) is not after.get(n))


def _check_sanitized(src: Path, model: Any, expert_names: set[str], have: dict[str, TensorInfo]) -> None:
    """An mlx-lm directory is already sanitized (convert_family sends an original checkpoint through mlx-lm)."""
    if changed := sanitize_changes(src, model):
        experts = [n for n in changed if n in expert_names or n not in have]
        what = "its expert tensors" if experts else "tensors"
        raise CheckpointError(
            f"{src}: not an mlx-lm model directory: mlx-lm's sanitize would change {what} "
            f"({_some(experts or changed)})")


def _some(names: list[str]) -> str:
    return f"{', '.join(names[:4])}{', ...' if len(names) > 4 else ''}"


def hf_reason(src: Path, config: dict[str, Any], infos: dict[str, TensorInfo]) -> str | None:
    """What makes `src` an original Hugging Face checkpoint, which goes through mlx-lm's conversion
    first; None for an mlx-lm directory. From config.json and the headers only: a source neither
    path converts (model code, a model type mlx-lm does not know, a dense model) is refused here."""
    where = str(src / "config.json")
    quantized = isinstance(config.get("quantization"), dict) or isinstance(
        text_config(config).get("quantization"), dict)
    if not quantized and (config.get("quantization_config") or text_config(config).get("quantization_config")):
        # Only mlx-lm's loader reads a Hugging Face `quantization_config`: the skeleton is built without it.
        bare = {k: v for k, v in config.items() if k != "quantization_config"}
        if isinstance(bare.get("text_config"), dict):
            bare["text_config"] = {k: v for k, v in bare["text_config"].items() if k != "quantization_config"}
        family_info(config, build_skeleton(bare, {}, where), where)
        method = (config.get("quantization_config") or text_config(config).get("quantization_config") or {})
        return f"quantization_config {method.get('quant_method', '?') if isinstance(method, dict) else method!r}"
    model = build_skeleton(config, headers_as_specs(infos), where)
    family_info(config, model, where)  # a dense model is refused here
    if changed := sanitize_changes(src, model):
        return f"mlx-lm's sanitize changes {_some(changed)}"
    return None


def plan_family(src: Path, config: dict[str, Any], infos: dict[str, TensorInfo], *,
                row_block_bytes: int = 64 << 20) -> FamilyPlan:
    """What converting mlx-lm directory `src` writes. Reads config.json and headers only.

    Raises CheckpointError naming what is wrong: model code in the config, a model type mlx-lm
    does not know, a dense model, an unsanitized (HF) checkpoint, a missing, unexpected or
    misshapen tensor (file, tensor and both shapes)."""
    where = str(src / "config.json")
    model = build_skeleton(config, headers_as_specs(infos), where)
    info = family_info(config, model, where)  # a dense model is refused here
    fam = family_block(info.model_type, model)
    sites = find_switches(model)
    expert_names = {f"{s.path}.{n}" for s in sites for n in expert_params(s.module)}
    _check_sanitized(src, model, expert_names, infos)
    layers: list[FamilyLayerPlan] = []
    for site in sites:
        params = expert_params(site.module)
        sources: dict[str, TensorInfo] = {}
        record = []
        for name, a in params.items():
            full = f"{site.path}.{name}"
            ti = infos.get(full)
            if ti is None:
                raise CheckpointError(f"{src}: missing expert tensor {full} (the {info.model_type} model's "
                                      f"{type(site.module).__name__} in layer {site.layer} has {list(params)})")
            if tuple(ti.shape) != tuple(a.shape):
                raise CheckpointError(f"{ti.file}: expert tensor {full} has shape {list(ti.shape)}, config.json "
                                      f"makes it {list(a.shape)}")
            want_int = not mx.issubdtype(a.dtype, mx.floating)
            if ti.dtype not in NAME_OF_ST or (want_int and NAME_OF_ST[ti.dtype] != str(a.dtype).split(".")[-1]) \
                    or (not want_int and ti.dtype not in ("F32", "F16", "BF16")):
                raise CheckpointError(f"{ti.file}: expert tensor {full} has dtype {ti.dtype}, the model needs "
                                      f"{str(a.dtype).split('.')[-1] if want_int else 'a float type'}")
            sources[name] = ti
            record.append((name, NAME_OF_ST[ti.dtype], tuple(ti.shape[1:])))
        quant = {n: q for n, lin in expert_linears(site.module).items() if (q := linear_quant(lin)) is not None}
        layers.append(FamilyLayerPlan(site.layer, site.path, tuple(record), sources, quant or None, info.num_experts))
    main = _check_main(src, model, infos, expert_names)
    plan = FamilyPlan(config={k: v for k, v in config.items() if k != "_name_or_path"}, family=fam,
                      model_id=info.model_id, num_experts=info.num_experts, layers=layers,
                      main=[_copy_job(n, infos[n], row_block_bytes) for n in main],
                      float_dtype=_float_dtype(infos, main))
    for pattern in TOKENIZER_GLOBS:
        plan.extra_files += [p for p in sorted(src.glob(pattern)) if p.is_file() and p not in plan.extra_files]
    if not any(p.name.startswith("tokenizer") for p in plan.extra_files):
        plan.warnings.append(f"{src} has no tokenizer files; the converted model needs token ids")
    return plan


def _check_main(src: Path, model: Any, infos: dict[str, TensorInfo], expert_names: set[str]) -> list[str]:
    """The non-expert tensors: exactly the skeleton's other parameters, each with its shape."""
    from mlx.utils import tree_flatten

    want = {n: tuple(a.shape) for n, a in tree_flatten(model.parameters())
            if isinstance(a, mx.array) and n not in expert_names}
    have = [n for n in infos if n not in expert_names]
    extra = sorted(set(have) - set(want))
    missing = sorted(set(want) - set(have))
    if extra or missing:
        raise CheckpointError(f"{src}: the tensors are not those of the config's {model.model_type} model "
                              f"(missing {missing[:6]}, unexpected {extra[:6]})")
    for n in have:
        if tuple(infos[n].shape) != want[n]:
            raise CheckpointError(f"{infos[n].file}: tensor {n} has shape {list(infos[n].shape)}, config.json "
                                  f"makes it {list(want[n])}")
    return have


def _float_dtype(infos: dict[str, TensorInfo], names: list[str]) -> str | None:
    for n in names:
        if infos[n].dtype in ("BF16", "F16", "F32"):
            return NAME_OF_ST[infos[n].dtype]
    return None


def convert_family(src: Path, out: Path, config: dict[str, Any], infos: dict[str, TensorInfo], *, existing: Path,
                   progress: bool, log: Log, chunk_bytes: int, row_block_bytes: int, max_shard_bytes: int,
                   t0: float, options: dict[str, Any], hf: bool = True) -> ConvertReport:
    """Convert `src` into `out` atomically (called by `qnpipe.convert.build.convert`, which has checked
    the paths); returns its ConvertReport. An original Hugging Face checkpoint (`hf`) goes through
    mlx-lm's conversion first (`qnpipe.convert.family_hf`), which takes convert's transform `options`
    (--bits, --group-size, --mode, --dtype); an mlx-lm directory is stored as it is, so they are refused."""
    model_type = config.get("model_type")
    why = hf_reason(src, config, infos) if hf else None
    if why is not None:
        with through_mlx_lm(src, out, config, infos, why=why, progress=progress, log=log,
                            options=options) as (mlx_dir, warnings):
            report = convert_family(mlx_dir, out, read_config(mlx_dir), scan(mlx_dir), existing=existing,
                                    progress=progress, log=log, chunk_bytes=chunk_bytes,
                                    row_block_bytes=row_block_bytes, max_shard_bytes=max_shard_bytes, t0=t0,
                                    options={}, hf=False)
        return as_hf_report(report, src, mlx_dir, warnings)
    for flag, value in options.items():
        if value is not None:
            raise ConfigError(f"{flag} applies to qwen3_next sources and original Hugging Face checkpoints only; "
                              f"{src} is a {model_type} model's mlx-lm directory, stored as it is (quantize or cast "
                              f"with mlx_lm.convert from the original checkpoint)")
    plan = plan_family(src, config, infos, row_block_bytes=row_block_bytes)
    for w in plan.warnings:
        log(f"warning: {w}")
    expert_bytes = sum(st.record_layout(el.tensors)[2] * el.num_experts for el in plan.layers)
    main_bytes = sum(safetensors_nbytes(s) for s in plan_shards(plan.main, max_shard_bytes))
    small = sum(p.stat().st_size for p in plan.extra_files) + (1 << 20) + 64 * len(plan.layers) * plan.num_experts
    need = expert_bytes + main_bytes + small
    free = shutil.disk_usage(existing).free
    if free < need:
        raise QnpipeError(f"not enough free disk space in {existing}: the conversion needs {need} bytes "
                          f"({human_bytes(need)}), {free} bytes ({human_bytes(free)}) are available")
    out.parent.mkdir(parents=True, exist_ok=True)
    bar = ByteProgress(progress, expert_bytes + main_bytes, "non-expert weights")
    try:
        with atomic_dir(out, marker="qnpipe convert") as build:
            index, sha = write_family(build, plan, bar.advance, bar.describe, chunk_bytes=chunk_bytes,
                                      max_shard_bytes=max_shard_bytes)
            cfg = dict(plan.config)
            cfg["qnpipe"] = qnpipe_section(plan, index, sha)
            (build / "config.json").write_text(json.dumps(cfg, indent=4) + "\n")
            bar.stop()
    finally:
        bar.stop()
    seconds = time.perf_counter() - t0
    written = expert_bytes + main_bytes
    q0 = index.layers[0].quant
    return ConvertReport(
        out=str(out), source_layout=SOURCE_LAYOUT, moe_layers=len(index.layers), num_experts=plan.num_experts,
        quantization=quant_dict(next(iter(q0.values()))) if q0 else None, dtype=plan.float_dtype,
        mtp=False, bytes_written=written, expert_bytes=expert_bytes, seconds=seconds,
        bytes_per_s=written / seconds if seconds > 0 else 0.0, peak_rss_bytes=peak_rss(),
        warnings=tuple(plan.warnings))


def write_family(build: Path, plan: FamilyPlan, advance: Callable[[int], None], describe: Callable[[str], None], *,
                 chunk_bytes: int, max_shard_bytes: int) -> tuple[StoreIndex, str]:
    """Every file but config.json into `build`; returns the index (version 2) and its sha256."""
    (build / st.EXPERTS_DIR).mkdir()
    write_model_shards(build, plan.main, max_shard_bytes, advance)
    files: list[LayerFile] = []
    for el in plan.layers:
        describe(f"experts, layer {el.layer}")
        files.append(write_expert_layer(build / st.EXPERTS_DIR, el.layer, el.read, el.tensors, el.quant,
                                        el.num_experts, el.src_bytes_per_expert, advance, chunk_bytes))
    index = StoreIndex(version=VERSION, model_id=plan.model_id, layers=tuple(files), family=plan.family)
    sha = hashlib.sha256(st.write_index(build / st.EXPERTS_DIR, index).read_bytes()).hexdigest()
    fsync_dir(build / st.EXPERTS_DIR)
    for f in plan.extra_files:
        shutil.copyfile(f, build / f.name)
    return index, sha


def qnpipe_section(plan: FamilyPlan, index: StoreIndex, index_sha256: str) -> dict[str, Any]:
    """config.json's `qnpipe` section of a converted family model (docs/store-format.md)."""
    lf = index.layers[0]
    return {
        "format": MODEL_FORMAT,
        "version": MODEL_VERSION,
        "source_layout": SOURCE_LAYOUT,
        "dtype": plan.float_dtype,
        "quantization": {k: quant_dict(v) for k, v in lf.quant.items()} if lf.quant else None,
        "family": msgspec.to_builtins(plan.family, str_keys=True),
        "experts": experts_section(index, index_sha256),
        "mtp": None,
    }

