"""Load a Qwen3-Next model directory (either layout, any affine quantization) into MLX."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn

from qnpipe.config.validate import check_topk_override
from qnpipe.errors import CheckpointError
from qnpipe.io.store import ExpertStore, as_mx
from qnpipe.io.store_format import Quant
from qnpipe.model.args import ModelArgs, args_from_dict, model_id, read_config, store_sha256
from qnpipe.model.checkpoint import (
    Layout,
    TensorInfo,
    detect_layout,
    is_qnpipe_dir,
    load_strict,
    load_tensors,
    read_header,
    scan,
    to_mlx_names,
)
from qnpipe.model.experts import PROJS, LayerExperts, ProjWeights, ResidentExperts
from qnpipe.model.qwen3_next import Model
from qnpipe.model.stage import Stage, prune


@attrs.define
class LoadedModel:
    """A model ready to run, the pool serving its experts, and what else the directory held."""

    model: Model
    args: ModelArgs
    experts: ResidentExperts
    mtp_weights: dict[str, mx.array]
    config: dict[str, Any]
    layout: Layout
    path: Path


def quant_params(path: str, qcfg: dict[str, Any] | None, scales_shape: tuple[int, ...] | None,
                  weight_shape: tuple[int, ...], in_dims: int) -> dict[str, Any] | None:
    """Group size / bits / mode of module `path`: the config's per-module entry, else inferred (mlx-lm's rule)."""
    if qcfg is not None and isinstance(qcfg.get(path), dict):
        p = qcfg[path]
        return {"group_size": p["group_size"], "bits": p["bits"], "mode": p.get("mode", "affine")}
    if scales_shape is None:
        return None
    mode = qcfg.get("mode", "affine") if qcfg else "affine"
    return {
        "group_size": in_dims // scales_shape[-1],
        "bits": weight_shape[-1] * 32 // in_dims,
        "mode": mode,
    }


def _expert_weights(args: ModelArgs, w: dict[str, mx.array], qcfg: dict[str, Any] | None,
                    where: dict[str, TensorInfo]) -> ResidentExperts:
    E = args.num_experts
    dims = args.expert_dims
    layers: dict[int, LayerExperts] = {}
    for layer in args.moe_layers:
        projs = {}
        for proj in PROJS:
            path = f"model.layers.{layer}.mlp.switch_mlp.{proj}"
            name = f"{path}.weight"
            if name not in w:
                raise CheckpointError(f"missing tensor {name} (MoE layer {layer})")
            weight = w.pop(name)
            scales = w.pop(f"{path}.scales", None)
            biases = w.pop(f"{path}.biases", None)
            out_d, in_d = dims[proj]
            file = where[name].file if name in where else "(converted)"
            q = quant_params(path, qcfg, None if scales is None else tuple(scales.shape), tuple(weight.shape), in_d)
            if q is None:
                want = (E, out_d, in_d)
                if tuple(weight.shape) != want:
                    raise CheckpointError(f"{file}: tensor {name} has shape {list(weight.shape)}, expected {list(want)}")
                projs[proj] = ProjWeights(weight)
                continue
            if scales is None:
                raise CheckpointError(f"{file}: missing tensor {path}.scales (config says {path} is quantized)")
            gs, bits = q["group_size"], q["bits"]
            want_w, want_s = Quant(bits=bits, group_size=gs).shapes((E, out_d, in_d))
            for n, arr, want in ((name, weight, want_w), (f"{path}.scales", scales, want_s),
                                 (f"{path}.biases", biases, want_s)):
                if arr is None:
                    if q["mode"] == "affine":
                        raise CheckpointError(f"{file}: missing tensor {n}")
                    continue
                if tuple(arr.shape) != want:
                    raise CheckpointError(
                        f"{file}: tensor {n} has shape {list(arr.shape)}, expected {list(want)} "
                        f"({bits}-bit, group size {gs})"
                    )
            projs[proj] = ProjWeights(weight, scales, biases, gs, bits, q["mode"])
        layers[layer] = LayerExperts(**projs)
    return ResidentExperts(layers)


def open_store(args: ModelArgs, store_dir: Path, qcfg: dict[str, Any] | None,
               index_sha256: str | None = None) -> ExpertStore:
    """The expert store of a model (a model dir or its experts dir), checked against its config.

    Raises StoreError for a store of another model (another shape, or with `index_sha256`,
    config.json's `qnpipe.experts.index_sha256`, another store) or one whose index disagrees
    with it (`store_check.check_against_model`, the check verify-store makes too).
    """
    from qnpipe.io.store_check import check_against_model, check_store_sha256

    store = ExpertStore.open(store_dir, expected_model_id=model_id(args))
    try:
        check_against_model(store.index, store.root / "index.json", args, qcfg)
        check_store_sha256(store.root / "index.json", store.sha256, index_sha256)
    except BaseException:
        store.close()
        raise
    return store


def _store_experts(args: ModelArgs, store_dir: Path, qcfg: dict[str, Any] | None, *, index_sha256: str | None,
                   verify: bool = False, stage: Stage | None = None) -> ResidentExperts:
    """Every expert of a store (a model dir or its experts dir), stacked `[E, ...]` per projection (slot == expert id).

    The index must agree with the model (`store_check.check_against_model`, the check
    verify-store makes too). With `verify`, every record's crc32 is checked as its layer is
    read: StoreError names the layer, expert, file and offset of the first bad record.
    """
    with open_store(args, store_dir, qcfg, index_sha256) as store:
        layers: dict[int, LayerExperts] = {}
        for layer in args.moe_layers:
            if stage is not None and not stage.holds(layer):
                continue
            lf = store.layer_file(layer)
            arrays = store.read_layer(layer, verify=verify)
            dtypes = {t.name: t.dtype for t in lf.tensors}
            projs = {}
            for proj in PROJS:
                w = as_mx(arrays[f"{proj}.weight"], dtypes[f"{proj}.weight"])
                q = (lf.quant or {}).get(proj)
                if q is None:
                    projs[proj] = ProjWeights(w)
                    continue
                scales, biases = (as_mx(arrays[f"{proj}.{n}"], dtypes[f"{proj}.{n}"]) for n in ("scales", "biases"))
                projs[proj] = ProjWeights(w, scales, biases, q.group_size, q.bits, q.mode)
            layers[layer] = LayerExperts(**projs)
            del arrays
    return ResidentExperts(layers)


def _quantize_skeleton(model: Model, qcfg: dict[str, Any], w: dict[str, mx.array]) -> None:
    def predicate(path: str, module: nn.Module) -> bool | dict[str, Any]:
        if path in qcfg:
            return qcfg[path]
        if not hasattr(module, "to_quantized") or f"{path}.scales" not in w:
            return False
        in_dims = module["weight"].shape[-1]
        q = quant_params(path, None, tuple(w[f"{path}.scales"].shape), tuple(w[f"{path}.weight"].shape), in_dims)
        assert q is not None
        return q

    nn.quantize(model, group_size=qcfg["group_size"], bits=qcfg["bits"],
                mode=qcfg.get("mode", "affine"), class_predicate=predicate)


def _on_cpu() -> bool:
    return mx.default_device().type == mx.DeviceType.cpu


def _half_expert_dtype(model_dir: Path, infos: dict[str, TensorInfo], qnpipe_dir: bool,
                       expert_dir: str | Path | None) -> tuple[str, str] | None:
    """(dtype, where) of the first unquantized bfloat16/float16 routed-expert weight, else None."""
    if qnpipe_dir:
        from qnpipe.io.store import read_index

        root, index = read_index(Path(expert_dir) if expert_dir else model_dir)
        for lf in index.layers:
            for t in lf.tensors:
                proj = t.name.split(".")[0]
                if t.name.endswith(".weight") and not (lf.quant or {}).get(proj) and t.dtype in ("bfloat16", "float16"):
                    return t.dtype, f"{root / lf.file} ({t.name})"
        return None
    for name, info in infos.items():
        if not name.endswith(".weight") or (".mlp.experts." not in name and ".mlp.switch_mlp." not in name):
            continue
        if info.dtype in ("BF16", "F16") and name[: -len("weight")] + "scales" not in infos:
            return {"BF16": "bfloat16", "F16": "float16"}[info.dtype], f"{info.file} ({name})"
    return None


def check_cpu_dtype(model_dir: Path, infos: dict[str, TensorInfo], qnpipe_dir: bool,
                    expert_dir: str | Path | None = None) -> None:
    """Refuse unquantized bfloat16/float16 experts on the CPU backend (MLX's GatherMM there is float32 only)."""
    if not _on_cpu():
        return
    found = _half_expert_dtype(model_dir, infos, qnpipe_dir, expert_dir)
    if found is None:
        return
    dtype, where = found
    raise CheckpointError(
        f"{model_dir}: the experts are unquantized {dtype} ({where}); MLX on the CPU backend computes "
        f"unquantized experts only in float32. Convert the model first, e.g. "
        f"`qnpipe convert {model_dir} --out DIR --dtype float32` or `qnpipe convert {model_dir} --out DIR --bits 4`"
    )


NATIVE_TYPES = ("qwen3_next",)


def load_model(model_dir: str | Path, *, expert_dir: str | Path | None = None, verify: bool = False,
               topk_override: int | None = None, resident_experts: bool = True,
               stage: Stage | None = None, tier: str = "native") -> Any:
    """Load `model_dir` (original HF, mlx-lm, or qnpipe layout) with every expert resident.

    `resident_experts` False (qnpipe layout only) loads everything but the routed experts,
    which then stream from the store through the pool; `LoadedModel.experts` is empty.

    `expert_dir` is where a qnpipe directory's expert store lives when not in
    `model_dir/experts` (config `model.expert_dir`, the `EXPERT_DIR` name); the store's
    model id must match `model_dir`'s config. `verify` (config `read.verify_crc32`) checks
    every expert record's crc32 as a qnpipe store is read; off, the disk is trusted.
    `topk_override` (config `forward.moe_topk_override`) is only range-checked here.
    `stage` (pipeline parallel) loads only that rank's layers, embedding and head
    (qnpipe.model.stage): the other tensors are never read.

    `tier` (config `model.tier`): a qwen3_next directory loads on qnpipe's own model (this
    function's LoadedModel) unless it is "generic"; any other model type mlx-lm builds a
    switch for loads on the generic tier (qnpipe.model.family.load.FamilyLoaded: mlx-lm's own
    model, its switches pooled); anything else is a CheckpointError naming the type.

    Raises CheckpointError naming the file and tensor for a wrong model_type, missing or
    unexpected tensors, shape mismatches and truncated or corrupt safetensors files;
    StoreError for a qnpipe directory whose expert store is missing, truncated or from
    another model, disagrees with config.json, or (with `verify`) has a corrupt record.
    """
    model_dir = Path(model_dir)
    config = read_config(model_dir)
    if "model_type" in config and (config["model_type"] not in NATIVE_TYPES or tier == "generic"):
        return _load_generic(model_dir, config, expert_dir=expert_dir, verify=verify, resident_experts=resident_experts)
    args = args_from_dict(config, str(model_dir / "config.json"))
    qcfg = config.get("quantization") or config.get("quantization_config")
    if qcfg is not None and "bits" not in qcfg:
        raise CheckpointError(f"{model_dir / 'config.json'}: quantization section has no default 'bits'")
    check_topk_override(topk_override, args.num_experts)
    infos = scan(model_dir)
    qnpipe_dir = is_qnpipe_dir(model_dir, config)
    check_cpu_dtype(model_dir, infos, qnpipe_dir, expert_dir)
    if qnpipe_dir:
        layout = Layout.QNPIPE
        weights = load_tensors(infos)
        stray = [k for k in weights if k.startswith("mtp.") or ".mlp.switch_mlp." in k or ".mlp.experts." in k]
        if stray:
            raise CheckpointError(f"{infos[stray[0]].file}: unexpected tensor {stray[0]} in a qnpipe directory "
                                  f"(experts belong in experts/, MTP in mtp.safetensors)")
        if args.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        mtp_file = model_dir / "mtp.safetensors"
        # lexists: an mtp.safetensors that is a FIFO or a directory is refused by read_header, not skipped.
        mtp = load_tensors(read_header(mtp_file)) if os.path.lexists(mtp_file) else {}
        store_dir = Path(expert_dir) if expert_dir else model_dir
        index_sha256 = store_sha256(config, model_dir / "config.json")
        if resident_experts:
            experts = _store_experts(args, store_dir, qcfg, index_sha256=index_sha256, verify=verify, stage=stage)
        else:
            open_store(args, store_dir, qcfg, index_sha256).close()
            experts = ResidentExperts({})
    else:
        layout = detect_layout(infos, model_dir)
        weights = load_tensors(infos)
        if layout is Layout.HF:
            weights, mtp = to_mlx_names(weights, args.num_experts, args.moe_layers, args.tie_word_embeddings, infos)
        else:
            mtp = {k: weights.pop(k) for k in list(weights) if k.startswith("mtp.")}
            if args.tie_word_embeddings:
                weights.pop("lm_head.weight", None)
        experts = _expert_weights(args, weights, qcfg, infos)
        if stage is not None:
            experts = ResidentExperts({k: v for k, v in experts.layers.items() if stage.holds(k)})
    model = Model(args)
    if stage is not None:
        # mx.load is lazy: the tensors dropped here are never read from disk.
        weights = {k: v for k, v in weights.items() if stage.keeps(k, args.tie_word_embeddings)}
        prune(model, stage)
    if qcfg is not None:
        _quantize_skeleton(model, qcfg, weights)
    load_strict(model, weights, infos, model_dir)
    model.eval()
    model.attach_experts(experts)
    mx.eval(model.parameters(), [a for le in experts.layers.values() for p in (le.gate_proj, le.up_proj, le.down_proj)
                                 for a in (p.weight, p.scales, p.biases) if a is not None])
    return LoadedModel(model, args, experts, mtp, config, layout, model_dir)


def _load_generic(model_dir: Path, config: dict[str, Any], **kw: Any) -> Any:
    from qnpipe.model.family.load import load_family
    from qnpipe.model.family.skeleton import model_classes

    model_classes(config, str(model_dir / "config.json"))  # an unknown model type: its CheckpointError first
    return load_family(model_dir, config, **kw)
