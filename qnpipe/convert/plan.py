"""The plan of a `qnpipe convert`: every output tensor, how it is computed, and the expert layers.

`make_plan` decides, from the source layout and options, what `convert` writes: the non-expert
jobs (`WriteJob`s for the safetensors writer, `qnpipe.convert.safetensors_out`), the MTP jobs, one
`ExpertLayerPlan` per MoE layer, the output config and the files copied as they are. Transforms
follow mlx-lm exactly (sanitize, cast, quantize, in that order; its quantization predicate),
so the result is bit-identical to `mlx_lm.convert`. Planning reads configs and tensor headers
only; a job reads and transforms its tensor when the writer runs it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from qnpipe.convert.safetensors_out import OutTensor, WriteJob
from qnpipe.errors import CheckpointError, ConfigError
from qnpipe.io.dtypes import NAME_OF_ST, ST_OF_NAME
from qnpipe.io.store import as_mx
from qnpipe.io.store_format import Quant
from qnpipe.model.args import ModelArgs, model_id, read_config
from qnpipe.model.checkpoint import HF_EXPERT, Layout, TensorInfo, read_tensor, sanitize_tensor, scan

BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
DTYPES = ("float16", "bfloat16", "float32")
PROJS = ("gate_proj", "up_proj", "down_proj")
TOKENIZER_GLOBS = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt",
                   "chat_template*", "generation_config.json")
# The safetensors dtypes convert reads (floats, and uint32 for packed quantized weights).
_CONVERTIBLE = ("BF16", "F16", "F32", "U32")


# --------------------------------------------------------------------------- tensors in MLX


def _to_np(a: Any) -> np.ndarray:
    import mlx.core as mx

    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.array(a, copy=False)


def _mx_dtype(name: str) -> Any:
    import mlx.core as mx

    return getattr(mx, name)


def _is_float(st_dtype: str) -> bool:
    return st_dtype in ("F32", "F16", "BF16", "F64")


def transform(raw: np.ndarray, st_dtype: str, *, sanitize_name: str | None = None, cast: str | None = None,
               quant: Quant | None = None) -> list[np.ndarray]:
    """Source tensor -> output tensor(s), in mlx-lm's order: sanitize, cast, quantize."""
    import mlx.core as mx

    if sanitize_name is None and cast is None and quant is None:
        return [raw]
    a = as_mx(raw, NAME_OF_ST[st_dtype])
    if sanitize_name is not None:
        a = sanitize_tensor(sanitize_name, a)
    if cast is not None and _is_float(st_dtype):
        a = a.astype(_mx_dtype(cast))
    outs = list(mx.quantize(a, quant.group_size, quant.bits)) if quant is not None else [a]
    mx.eval(outs)
    return [_to_np(o) for o in outs]


# --------------------------------------------------------------------------- the plan


@attrs.frozen
class ExpertLayerPlan:
    layer: int
    read: Callable[[int, int], dict[str, np.ndarray]]  # (e0, e1) -> proj -> stacked source arrays
    src_st: dict[str, str]  # proj -> source st dtype of its weight
    quant_in: dict[str, Quant | None]  # source quantization per proj
    quant_out: dict[str, Quant | None]  # per proj: quantize a float source
    cast: str | None
    src_bytes_per_expert: int


def out_float_dtype(st_dtype: str, cast: str | None) -> str:
    return ST_OF_NAME[cast] if cast is not None and _is_float(st_dtype) else st_dtype


def _tensor_job(name: str, info: TensorInfo, *, sanitize: bool, cast: str | None, quant: Quant | None,
                row_block_bytes: int) -> WriteJob:
    if info.dtype not in _CONVERTIBLE:
        raise CheckpointError(f"{info.file}: tensor {name} has dtype {info.dtype}; qnpipe converts "
                              f"{', '.join(_CONVERTIBLE)} tensors")
    shape = info.shape
    if sanitize and "conv1d.weight" in name and shape[-1] != 1:
        shape = (shape[0], shape[2], shape[1])
    fdt = out_float_dtype(info.dtype, cast)
    if quant is not None:
        base = name.removesuffix(".weight")
        wq, sq = quant.shapes(shape)
        outs = (OutTensor(f"{base}.weight", "U32", wq), OutTensor(f"{base}.scales", fdt, sq), OutTensor(f"{base}.biases", fdt, sq))
    else:
        outs = (OutTensor(name, fdt, shape),)

    kw: dict[str, Any] = {"sanitize_name": name if sanitize else None,
                          "cast": cast if fdt != info.dtype else None, "quant": quant}

    def run() -> Iterator[tuple[int, int, np.ndarray]]:
        if len(info.shape) != 2 or info.nbytes <= row_block_bytes:
            for i, a in enumerate(transform(read_tensor(info), info.dtype, **kw)):
                yield i, 0, a
            return
        # Rows are independent under cast and quantization (groups run along a row), so a large
        # matrix (embedding, lm_head) goes through in row blocks and never sits whole in memory.
        rows = info.shape[0]
        row_bytes = info.nbytes // rows
        per = max(1, row_block_bytes // row_bytes)
        for r0 in range(0, rows, per):
            n = min(per, rows - r0)
            part = TensorInfo(info.file, info.dtype, (n, info.shape[1]), info.offset + r0 * row_bytes, n * row_bytes)
            for i, a in enumerate(transform(read_tensor(part), info.dtype, **kw)):
                yield i, r0 * (outs[i].nbytes // rows), a

    return WriteJob(outs, run)


def _quantizable(name: str, shape: tuple[int, ...], group_size: int) -> bool:
    """mlx-lm's rule on qwen3_next: Linear / Embedding / SwitchLinear weights whose input dim divides."""
    return name.endswith(".weight") and (len(shape) == 2 or ".switch_mlp." in name) and shape[-1] % group_size == 0


def _mlx_lm_quant(path: str, bits: int, group_size: int) -> tuple[Quant, dict[str, int] | None]:
    """mlx-lm's `Model.quant_predicate` for qwen3_next: router and shared-expert gate at 8 bits / 64."""
    if path.endswith("mlp.gate") or path.endswith("shared_expert_gate"):
        return Quant(bits=8, group_size=64), {"group_size": 64, "bits": 8}
    return Quant(bits=bits, group_size=group_size), None


@attrs.define
class ConvertPlan:
    main: list[WriteJob] = attrs.Factory(list)
    mtp: list[WriteJob] = attrs.Factory(list)
    experts: list[ExpertLayerPlan] = attrs.Factory(list)
    config: dict[str, Any] = attrs.Factory(dict)
    qcfg: dict[str, Any] | None = None
    mtp_qcfg: dict[str, Any] | None = None
    float_dtype: str | None = None
    extra_files: list[Path] = attrs.Factory(list)
    warnings: list[str] = attrs.Factory(list)


def _source_quant(config: dict[str, Any]) -> dict[str, Any] | None:
    q = config.get("quantization") or config.get("quantization_config")
    return q if isinstance(q, dict) and "bits" in q else None


def _plan_hf_experts(args: ModelArgs, infos: dict[str, TensorInfo], cast: str | None,
                     quant: Quant | None) -> list[ExpertLayerPlan]:
    E = args.num_experts
    dims = args.expert_dims
    layers = []
    for layer in args.moe_layers:
        src_st: dict[str, str] = {}
        for proj in PROJS:
            for e in range(E):
                name = f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"
                if name not in infos:
                    raise CheckpointError(f"missing tensor {name} (layer {layer} has {E} experts)")
                info = infos[name]
                if info.shape != dims[proj]:
                    raise CheckpointError(f"{info.file}: tensor {name} has shape {list(info.shape)}, "
                                          f"expected {list(dims[proj])}")
                if info.dtype not in ("F32", "F16", "BF16") or src_st.setdefault(proj, info.dtype) != info.dtype:
                    raise CheckpointError(f"{info.file}: tensor {name} has dtype {info.dtype}, expected "
                                          f"{src_st.get(proj, 'a float type')} like expert 0")

        def read(e0: int, e1: int, layer: int = layer) -> dict[str, np.ndarray]:
            return {p: np.stack([read_tensor(infos[f"model.layers.{layer}.mlp.experts.{e}.{p}.weight"])
                                 for e in range(e0, e1)]) for p in PROJS}

        nbytes = sum(infos[f"model.layers.{layer}.mlp.experts.0.{p}.weight"].nbytes for p in PROJS)
        # mlx-lm leaves a SwitchLinear float when its input dim is not a multiple of the group size.
        qout = {p: quant if quant is not None and dims[p][1] % quant.group_size == 0 else None for p in PROJS}
        layers.append(ExpertLayerPlan(layer, read, src_st, dict.fromkeys(PROJS), qout, cast, nbytes))
    return layers


def _plan_mlx_experts(args: ModelArgs, infos: dict[str, TensorInfo], qcfg: dict[str, Any] | None,
                      cast: str | None) -> list[ExpertLayerPlan]:
    from qnpipe.model.load import quant_params

    E = args.num_experts
    dims = args.expert_dims
    layers = []
    for layer in args.moe_layers:
        src: dict[str, TensorInfo] = {}
        quant_in: dict[str, Quant | None] = {}
        src_st: dict[str, str] = {}
        for proj in PROJS:
            path = f"model.layers.{layer}.mlp.switch_mlp.{proj}"
            if f"{path}.weight" not in infos:
                raise CheckpointError(f"missing tensor {path}.weight (MoE layer {layer})")
            w = infos[f"{path}.weight"]
            s = infos.get(f"{path}.scales")
            out_d, in_d = dims[proj]
            q = quant_params(path, qcfg, None if s is None else s.shape, w.shape, in_d)
            if q is None:
                wants = {"weight": (E, out_d, in_d)}
            else:
                if q["mode"] != "affine":
                    raise CheckpointError(f"{w.file}: {path} uses quantization mode {q['mode']!r}; "
                                          f"qnpipe converts affine quantization only")
                gs, bits = q["group_size"], q["bits"]
                quant_in[proj] = qin = Quant(bits=bits, group_size=gs)
                wq, sq = qin.shapes((E, out_d, in_d))
                wants = {"weight": wq, "scales": sq, "biases": sq}
            quant_in.setdefault(proj, None)
            for part, want in wants.items():
                name = f"{path}.{part}"
                if name not in infos:
                    raise CheckpointError(f"{w.file}: missing tensor {name}")
                if infos[name].shape != want:
                    raise CheckpointError(f"{infos[name].file}: tensor {name} has shape {list(infos[name].shape)}, "
                                          f"expected {list(want)}")
                src[f"{proj}.{part}"] = infos[name]
            src_st[proj] = w.dtype
            if "scales" in wants:
                src_st[f"{proj}.scales"] = infos[f"{path}.scales"].dtype

        def read(e0: int, e1: int, src: dict[str, TensorInfo] = src) -> dict[str, np.ndarray]:
            out = {}
            for key, info in src.items():
                per = info.nbytes // E
                part = TensorInfo(info.file, info.dtype, (e1 - e0, *info.shape[1:]), info.offset + e0 * per,
                                  (e1 - e0) * per)
                out[key] = read_tensor(part)
            return out

        nbytes = sum(i.nbytes for i in src.values()) // E
        layers.append(ExpertLayerPlan(layer, read, src_st, quant_in, dict.fromkeys(PROJS), cast, nbytes))
    return layers


def record_tensors(el: ExpertLayerPlan, args: ModelArgs) -> list[tuple[str, str, tuple[int, ...]]]:
    dims = args.expert_dims
    out = []
    for proj in PROJS:
        fdt = NAME_OF_ST[out_float_dtype(el.src_st[proj], el.cast)]
        qo = el.quant_out[proj]
        q = el.quant_in[proj] or qo
        if q is None:
            out.append((f"{proj}.weight", fdt, dims[proj]))
            continue
        if el.quant_in[proj] is not None:  # already quantized: scales keep (or cast) the source dtype
            fdt = NAME_OF_ST[out_float_dtype(el.src_st.get(f"{proj}.scales", el.src_st[proj]), el.cast)]
        wq, sq = q.shapes(dims[proj])
        out += [(f"{proj}.weight", "uint32", wq), (f"{proj}.scales", fdt, sq), (f"{proj}.biases", fdt, sq)]
    return out


def _check_main(args: ModelArgs, jobs: Sequence[WriteJob], src: Path) -> None:
    """The planned non-expert tensors are exactly the model's parameters (names; shapes of float ones)."""
    from mlx.utils import tree_flatten

    from qnpipe.model.qwen3_next import Model

    flat = tree_flatten(Model(args).parameters())
    assert isinstance(flat, list)  # without a destination dict, tree_flatten returns a list
    expected = {k: tuple(v.shape) for k, v in flat}
    planned = {o.name: o for j in jobs for o in j.outs}
    for name in planned:
        base = name.rsplit(".", 1)[0]
        if name not in expected and not (name.endswith((".scales", ".biases")) and f"{base}.weight" in expected):
            raise CheckpointError(f"{src}: unexpected tensor {name} (not part of this model's config)")
    for name, shape in expected.items():
        if name not in planned:
            raise CheckpointError(f"{src}: missing tensor {name}")
        quantized = f"{name.rsplit('.', 1)[0]}.scales" in planned
        if not quantized and planned[name].shape != shape:
            raise CheckpointError(f"{src}: tensor {name} has shape {list(planned[name].shape)}, expected {list(shape)}")


def _mtp_source(src_layout: Layout, infos: dict[str, TensorInfo], mtp_from: Path | None, args: ModelArgs,
                plan: ConvertPlan) -> dict[str, TensorInfo]:
    if mtp_from is not None:
        cfg = read_config(mtp_from)
        if model_id(cfg) != model_id(args):
            raise CheckpointError(f"{mtp_from / 'config.json'}: --mtp-from is a checkpoint of another model "
                                  f"(its shape keys differ from the source's)")
        mtp = {k: v for k, v in scan(mtp_from).items() if k.startswith("mtp.")}
        if not mtp:
            raise CheckpointError(f"{mtp_from}: --mtp-from has no mtp.* tensors")
        return mtp
    mtp = {k: v for k, v in infos.items() if k.startswith("mtp.")}
    if src_layout is Layout.MLX and mtp:
        plan.warnings.append("the mlx-lm source has mtp.* tensors; they are ignored (give the original "
                             "checkpoint with --mtp-from)")
        mtp = {}
    if not mtp:
        hint = " (pass --mtp-from HF_DIR, the original checkpoint)" if src_layout is Layout.MLX else ""
        plan.warnings.append(f"no MTP weights: the converted model cannot use MTP speculation{hint}")
    return mtp


def make_plan(src: Path, config: dict[str, Any], args: ModelArgs, infos: dict[str, TensorInfo], layout: Layout, *,
          bits: int | None, group_size: int, dtype: str | None, mtp_bits: int, mtp_from: Path | None,
          row_block_bytes: int) -> ConvertPlan:
    plan = ConvertPlan()
    src_q = _source_quant(config) if layout is Layout.MLX else None
    if layout is Layout.MLX and src_q is None and any(k.endswith(".scales") for k in infos):
        src_q = {}  # quantized without a config section: parameters are inferred per tensor
    if bits is not None and src_q is not None:
        raise ConfigError(f"{src} is already quantized ({src_q.get('bits', '?')}-bit); --bits applies to "
                          f"unquantized sources only (convert the original checkpoint instead)")
    cast = dtype
    if cast is None and layout is Layout.HF:
        td = config.get("torch_dtype") or config.get("dtype")
        cast = td if td in DTYPES else None  # what mlx_lm.convert does without --dtype
    quant = Quant(bits=bits, group_size=group_size) if bits is not None else None
    qcfg: dict[str, Any] | None = dict(src_q) if src_q else None
    if quant is not None:
        qcfg = {"group_size": group_size, "bits": bits, "mode": "affine"}

    main_names = [n for n in infos if not n.startswith("mtp.") and not HF_EXPERT.match(n)
                  and ".mlp.switch_mlp." not in n]
    if args.tie_word_embeddings and "lm_head.weight" in main_names:
        main_names.remove("lm_head.weight")
    for name in main_names:
        info = infos[name]
        q = None
        if quant is not None and _is_float(info.dtype) and _quantizable(name, info.shape, group_size):
            q, override = _mlx_lm_quant(name.removesuffix(".weight"), bits, group_size)  # type: ignore[arg-type]
            if override is not None:
                assert qcfg is not None
                qcfg[name.removesuffix(".weight")] = override
        plan.main.append(_tensor_job(name, info, sanitize=layout is Layout.HF, cast=cast, quant=q,
                                     row_block_bytes=row_block_bytes))
    _check_main(args, plan.main, src)
    norm = infos.get("model.norm.weight")
    plan.float_dtype = cast or (NAME_OF_ST.get(norm.dtype) if norm is not None else None)

    if layout is Layout.HF:
        plan.experts = _plan_hf_experts(args, infos, cast, quant)
    else:
        plan.experts = _plan_mlx_experts(args, infos, src_q, cast)

    mtp = _mtp_source(layout, infos, mtp_from, args, plan)
    if mtp:
        mq = Quant(bits=mtp_bits, group_size=group_size) if mtp_bits else None
        mqcfg: dict[str, Any] | None = {"group_size": group_size, "bits": mtp_bits, "mode": "affine"} if mq else None
        mcast = plan.float_dtype
        for name in sorted(mtp):
            info = mtp[name]
            q = None
            if mq is not None and _is_float(info.dtype) and _quantizable(name, info.shape, group_size):
                q, override = _mlx_lm_quant(name.removesuffix(".weight"), mtp_bits, group_size)
                if override is not None:
                    assert mqcfg is not None
                    mqcfg[name.removesuffix(".weight")] = override
            plan.mtp.append(_tensor_job(name, info, sanitize=False, cast=mcast, quant=q,
                                        row_block_bytes=row_block_bytes))
        plan.mtp_qcfg = mqcfg
    plan.qcfg = qcfg
    plan.config = dict(config)
    plan.config.pop("_name_or_path", None)
    if quant is not None:
        plan.config["quantization"] = qcfg
        plan.config["quantization_config"] = qcfg
    for pattern in TOKENIZER_GLOBS:
        plan.extra_files += [p for p in sorted(src.glob(pattern)) if p.is_file() and p not in plan.extra_files]
    if not any(p.name.startswith("tokenizer") for p in plan.extra_files):
        plan.warnings.append(f"{src} has no tokenizer files; the converted model needs token ids")
    return plan
