"""`qnpipe convert`: an original HF or mlx-lm converted Qwen3-Next checkpoint -> a qnpipe model directory.

Output (docs/store-format.md): `config.json` (the model's, plus mlx-lm's `quantization` when
quantized, plus a `qnpipe` section), the non-expert weights in mlx-lm naming
(`model.safetensors` or shards), `mtp.safetensors` (HF naming), the tokenizer files, and
`experts/` (one record file per MoE layer + `index.json`).

Memory: tensors are read with one pread each, transformed in MLX and streamed to the output,
so the peak is about one chunk of experts (`CHUNK_BYTES` of source data), never the model.
Atomicity: everything is written into a locked temporary sibling of the output and renamed
at the end; errors, SIGINT and SIGTERM remove it, and a later convert removes what a killed
one left behind.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import msgspec
import numpy as np

from qnpipe.errors import CheckpointError, ConfigError, QnpipeError
from qnpipe.outdir import ByteProgress, Log, atomic_dir, clean_stale, fsync_dir, human_bytes, peak_rss
from qnpipe.io import store as st
from qnpipe.io.store_format import ALIGN, FORMAT, VERSION, LayerFile, Quant, StoreIndex
from qnpipe.model.args import ModelArgs, args_from_dict, read_config
from qnpipe.model.checkpoint import (
    _DTYPE_BYTES, _HF_EXPERT, _NORM_SUFFIXES, INDEX_FILE, Layout, TensorInfo, detect_layout, is_qnpipe_dir, read_tensor, scan,
)

__all__ = ["CHUNK_BYTES", "MAX_SHARD_BYTES", "ROW_BLOCK_BYTES", "MODEL_FORMAT", "MODEL_VERSION", "ConvertReport", "convert"]

MODEL_FORMAT = "qnpipe-model"
MODEL_VERSION = 1
MAX_SHARD_BYTES = 5 << 30  # like mlx-lm's save_model
CHUNK_BYTES = 256 << 20  # source bytes of experts transformed at once
ROW_BLOCK_BYTES = 64 << 20  # source bytes of a large non-expert matrix transformed at once
BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
DTYPES = ("float16", "bfloat16", "float32")
PROJS = ("gate_proj", "up_proj", "down_proj")
TOKENIZER_GLOBS = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt",
                   "chat_template*", "generation_config.json")
_ST = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "uint32": "U32"}
_FROM_ST = {v: k for k, v in _ST.items()}


class ConvertReport(msgspec.Struct, frozen=True, kw_only=True):
    """What `convert` did. Sizes in bytes, times in seconds."""

    out: str
    source_layout: str
    moe_layers: int
    num_experts: int
    quantization: dict[str, Any] | None  # of the experts; None = float
    dtype: str | None
    mtp: bool
    bytes_written: int
    expert_bytes: int
    seconds: float
    bytes_per_s: float
    peak_rss_bytes: int
    warnings: tuple[str, ...] = ()


# --------------------------------------------------------------------------- tensors in MLX


def _to_mx(a: np.ndarray, st_dtype: str) -> Any:
    import mlx.core as mx

    out = mx.array(a)
    return out.view(mx.bfloat16) if st_dtype == "BF16" else out


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


@attrs.frozen
class _Quant:
    bits: int
    group_size: int

    def shapes(self, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (*shape[:-1], shape[-1] * self.bits // 32), (*shape[:-1], shape[-1] // self.group_size)


def _transform(raw: np.ndarray, st_dtype: str, *, sanitize_name: str | None = None, cast: str | None = None,
               quant: _Quant | None = None) -> list[np.ndarray]:
    """Source tensor -> output tensor(s), in mlx-lm's order: sanitize, cast, quantize."""
    import mlx.core as mx

    if sanitize_name is None and cast is None and quant is None:
        return [raw]
    a = _to_mx(raw, st_dtype)
    if sanitize_name is not None:  # mlx-lm's sanitize (checkpoint.to_mlx_names), on one tensor
        if "conv1d.weight" in sanitize_name and a.shape[-1] != 1:
            a = a.moveaxis(2, 1)
        if any(sanitize_name.endswith(s) for s in _NORM_SUFFIXES) and a.ndim == 1:
            a = a + 1.0
    if cast is not None and _is_float(st_dtype):
        a = a.astype(_mx_dtype(cast))
    outs = list(mx.quantize(a, quant.group_size, quant.bits)) if quant is not None else [a]
    mx.eval(outs)
    return [_to_np(o) for o in outs]


# --------------------------------------------------------------------------- the plan


@attrs.frozen
class _Out:
    name: str
    st_dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _DTYPE_BYTES[self.st_dtype]


@attrs.frozen
class _Job:
    """Output tensors computed together (a quantized weight gives weight, scales, biases)."""

    outs: tuple[_Out, ...]
    run: Callable[[], Iterator[tuple[int, int, np.ndarray]]]  # yields (output index, byte offset in it, data)


@attrs.frozen
class _ExpertLayer:
    layer: int
    read: Callable[[int, int], dict[str, np.ndarray]]  # (e0, e1) -> proj -> stacked source arrays
    src_st: dict[str, str]  # proj -> source st dtype of its weight
    quant_in: dict[str, Quant | None]  # source quantization per proj
    quant_out: dict[str, _Quant | None]  # per proj: quantize a float source
    cast: str | None
    src_bytes_per_expert: int


def _out_float(st_dtype: str, cast: str | None) -> str:
    return _ST[cast] if cast is not None and _is_float(st_dtype) else st_dtype


def _tensor_job(name: str, info: TensorInfo, *, sanitize: bool, cast: str | None, quant: _Quant | None) -> _Job:
    if info.dtype not in _FROM_ST:
        raise CheckpointError(f"{info.file}: tensor {name} has dtype {info.dtype}; qnpipe converts "
                              f"{', '.join(sorted(_FROM_ST))} tensors")
    shape = info.shape
    if sanitize and "conv1d.weight" in name and shape[-1] != 1:
        shape = (shape[0], shape[2], shape[1])
    fdt = _out_float(info.dtype, cast)
    if quant is not None:
        base = name.removesuffix(".weight")
        wq, sq = quant.shapes(shape)
        outs = (_Out(f"{base}.weight", "U32", wq), _Out(f"{base}.scales", fdt, sq), _Out(f"{base}.biases", fdt, sq))
    else:
        outs = (_Out(name, fdt, shape),)

    kw: dict[str, Any] = {"sanitize_name": name if sanitize else None,
                          "cast": cast if fdt != info.dtype else None, "quant": quant}

    def run() -> Iterator[tuple[int, int, np.ndarray]]:
        if len(info.shape) != 2 or info.nbytes <= ROW_BLOCK_BYTES:
            for i, a in enumerate(_transform(read_tensor(info), info.dtype, **kw)):
                yield i, 0, a
            return
        # Rows are independent under cast and quantization (groups run along a row), so a large
        # matrix (embedding, lm_head) goes through in row blocks and never sits whole in memory.
        rows = info.shape[0]
        row_bytes = info.nbytes // rows
        per = max(1, ROW_BLOCK_BYTES // row_bytes)
        for r0 in range(0, rows, per):
            n = min(per, rows - r0)
            part = TensorInfo(info.file, info.dtype, (n, info.shape[1]), info.offset + r0 * row_bytes, n * row_bytes)
            for i, a in enumerate(_transform(read_tensor(part), info.dtype, **kw)):
                yield i, r0 * (outs[i].nbytes // rows), a

    return _Job(outs, run)


def _quantizable(name: str, shape: tuple[int, ...], group_size: int) -> bool:
    """mlx-lm's rule on qwen3_next: Linear / Embedding / SwitchLinear weights whose input dim divides."""
    return name.endswith(".weight") and (len(shape) == 2 or ".switch_mlp." in name) and shape[-1] % group_size == 0


def _mlx_lm_quant(path: str, bits: int, group_size: int) -> tuple[_Quant, dict[str, int] | None]:
    """mlx-lm's `Model.quant_predicate` for qwen3_next: router and shared-expert gate at 8 bits / 64."""
    if path.endswith("mlp.gate") or path.endswith("shared_expert_gate"):
        return _Quant(8, 64), {"group_size": 64, "bits": 8}
    return _Quant(bits, group_size), None


@attrs.define
class _Plan:
    main: list[_Job] = attrs.Factory(list)
    mtp: list[_Job] = attrs.Factory(list)
    experts: list[_ExpertLayer] = attrs.Factory(list)
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
                     quant: _Quant | None) -> list[_ExpertLayer]:
    E, H, I = args.num_experts, args.hidden_size, args.moe_intermediate_size
    dims = {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}
    layers = []
    for l in args.moe_layers:
        src_st: dict[str, str] = {}
        for proj in PROJS:
            for e in range(E):
                name = f"model.layers.{l}.mlp.experts.{e}.{proj}.weight"
                if name not in infos:
                    raise CheckpointError(f"missing tensor {name} (layer {l} has {E} experts)")
                info = infos[name]
                if info.shape != dims[proj]:
                    raise CheckpointError(f"{info.file}: tensor {name} has shape {list(info.shape)}, "
                                          f"expected {list(dims[proj])}")
                if info.dtype not in ("F32", "F16", "BF16") or src_st.setdefault(proj, info.dtype) != info.dtype:
                    raise CheckpointError(f"{info.file}: tensor {name} has dtype {info.dtype}, expected "
                                          f"{src_st.get(proj, 'a float type')} like expert 0")

        def read(e0: int, e1: int, l: int = l) -> dict[str, np.ndarray]:
            return {p: np.stack([read_tensor(infos[f"model.layers.{l}.mlp.experts.{e}.{p}.weight"])
                                 for e in range(e0, e1)]) for p in PROJS}

        nbytes = sum(infos[f"model.layers.{l}.mlp.experts.0.{p}.weight"].nbytes for p in PROJS)
        # mlx-lm leaves a SwitchLinear float when its input dim is not a multiple of the group size.
        qout = {p: quant if quant is not None and dims[p][1] % quant.group_size == 0 else None for p in PROJS}
        layers.append(_ExpertLayer(l, read, src_st, dict.fromkeys(PROJS), qout, cast, nbytes))
    return layers


def _plan_mlx_experts(args: ModelArgs, infos: dict[str, TensorInfo], qcfg: dict[str, Any] | None,
                      cast: str | None) -> list[_ExpertLayer]:
    from qnpipe.model.load import _quant_params

    E, H, I = args.num_experts, args.hidden_size, args.moe_intermediate_size
    dims = {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}
    layers = []
    for l in args.moe_layers:
        src: dict[str, TensorInfo] = {}
        quant_in: dict[str, Quant | None] = {}
        src_st: dict[str, str] = {}
        for proj in PROJS:
            path = f"model.layers.{l}.mlp.switch_mlp.{proj}"
            if f"{path}.weight" not in infos:
                raise CheckpointError(f"missing tensor {path}.weight (MoE layer {l})")
            w = infos[f"{path}.weight"]
            s = infos.get(f"{path}.scales")
            out_d, in_d = dims[proj]
            q = _quant_params(path, qcfg, None if s is None else s.shape, w.shape, in_d)
            if q is None:
                wants = {"weight": (E, out_d, in_d)}
            else:
                if q["mode"] != "affine":
                    raise CheckpointError(f"{w.file}: {path} uses quantization mode {q['mode']!r}; "
                                          f"qnpipe converts affine quantization only")
                gs, bits = q["group_size"], q["bits"]
                wants = {"weight": (E, out_d, in_d * bits // 32), "scales": (E, out_d, in_d // gs),
                         "biases": (E, out_d, in_d // gs)}
                quant_in[proj] = Quant(bits=bits, group_size=gs)
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
        layers.append(_ExpertLayer(l, read, src_st, quant_in, dict.fromkeys(PROJS), cast, nbytes))
    return layers


def _record_tensors(el: _ExpertLayer, args: ModelArgs) -> list[tuple[str, str, tuple[int, ...]]]:
    H, I = args.hidden_size, args.moe_intermediate_size
    dims = {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}
    out = []
    for proj in PROJS:
        fdt = _FROM_ST[_out_float(el.src_st[proj], el.cast)]
        qo = el.quant_out[proj]
        q = el.quant_in[proj] or (Quant(bits=qo.bits, group_size=qo.group_size) if qo else None)
        if q is None:
            out.append((f"{proj}.weight", fdt, dims[proj]))
            continue
        if el.quant_in[proj] is not None:  # already quantized: scales keep (or cast) the source dtype
            fdt = _FROM_ST[_out_float(el.src_st.get(f"{proj}.scales", el.src_st[proj]), el.cast)]
        wq, sq = _Quant(q.bits, q.group_size).shapes(dims[proj])
        out += [(f"{proj}.weight", "uint32", wq), (f"{proj}.scales", fdt, sq), (f"{proj}.biases", fdt, sq)]
    return out


def _expert_chunk(el: _ExpertLayer, e0: int, e1: int) -> dict[str, np.ndarray]:
    """Record tensor name -> stacked output `[e1 - e0, ...]` for experts e0..e1 of one layer."""
    src = el.read(e0, e1)
    out: dict[str, np.ndarray] = {}
    for proj in PROJS:
        if el.quant_in[proj] is not None:
            for part in ("weight", "scales", "biases"):
                a = src[f"{proj}.{part}"]
                st_dtype = "U32" if part == "weight" else el.src_st[f"{proj}.scales"]
                cast = el.cast if part != "weight" and _out_float(st_dtype, el.cast) != st_dtype else None
                out[f"{proj}.{part}"] = _transform(a, st_dtype, cast=cast)[0]
            continue
        key = proj if proj in src else f"{proj}.weight"
        st_dtype = el.src_st[proj]
        cast = el.cast if _out_float(st_dtype, el.cast) != st_dtype else None
        res = _transform(src[key], st_dtype, cast=cast, quant=el.quant_out[proj])
        names = ("weight", "scales", "biases") if el.quant_out[proj] else ("weight",)
        out.update({f"{proj}.{n}": r for n, r in zip(names, res, strict=True)})
    return out


def _check_main(args: ModelArgs, jobs: Sequence[_Job], src: Path) -> None:
    """The planned non-expert tensors are exactly the model's parameters (names; shapes of float ones)."""
    from mlx.utils import tree_flatten

    from qnpipe.model.qwen3_next import Model

    expected = {k: tuple(v.shape) for k, v in tree_flatten(Model(args).parameters())}
    planned = {o.name: o for j in jobs for o in j.outs}
    for name, o in planned.items():
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
                plan: _Plan) -> dict[str, TensorInfo]:
    if mtp_from is not None:
        cfg = read_config(mtp_from)
        if st.model_id(cfg) != st.model_id(args):
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


def _plan(src: Path, config: dict[str, Any], args: ModelArgs, infos: dict[str, TensorInfo], layout: Layout, *,
          bits: int | None, group_size: int, dtype: str | None, mtp_bits: int, mtp_from: Path | None) -> _Plan:
    plan = _Plan()
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
    quant = _Quant(bits, group_size) if bits is not None else None
    qcfg: dict[str, Any] | None = dict(src_q) if src_q else None
    if quant is not None:
        qcfg = {"group_size": group_size, "bits": bits, "mode": "affine"}

    main_names = [n for n in infos if not n.startswith("mtp.") and not _HF_EXPERT.match(n)
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
        plan.main.append(_tensor_job(name, info, sanitize=layout is Layout.HF, cast=cast, quant=q))
    _check_main(args, plan.main, src)
    norm = infos.get("model.norm.weight")
    plan.float_dtype = cast or (_FROM_ST.get(norm.dtype) if norm is not None else None)

    if layout is Layout.HF:
        plan.experts = _plan_hf_experts(args, infos, cast, quant)
    else:
        plan.experts = _plan_mlx_experts(args, infos, src_q, cast)

    mtp = _mtp_source(layout, infos, mtp_from, args, plan)
    if mtp:
        mq = _Quant(mtp_bits, group_size) if mtp_bits else None
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
            plan.mtp.append(_tensor_job(name, info, sanitize=False, cast=mcast, quant=q))
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


# --------------------------------------------------------------------------- writing


def _safetensors_header(outs: Sequence[_Out]) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "mlx"}}
    offset = 0
    for o in outs:
        header[o.name] = {"dtype": o.st_dtype, "shape": list(o.shape), "data_offsets": [offset, offset + o.nbytes]}
        offset += o.nbytes
    h = json.dumps(header, separators=(",", ":")).encode()
    return len(h + b" " * (-len(h) % 8)).to_bytes(8, "little") + h + b" " * (-len(h) % 8)


def _shards(jobs: Sequence[_Job], max_bytes: int) -> list[list[_Job]]:
    shards: list[list[_Job]] = [[]]
    size = 0
    for j in jobs:
        n = sum(o.nbytes for o in j.outs)
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(j)
        size += n
    return shards


def _safetensors_bytes(jobs: Sequence[_Job]) -> int:
    outs = [o for j in jobs for o in j.outs]
    return len(_safetensors_header(outs)) + sum(o.nbytes for o in outs)


def _write_safetensors(path: Path, jobs: Sequence[_Job], advance: Callable[[int], None]) -> None:
    """Stream `jobs` into one safetensors file whose header is known from the plan."""
    outs = [o for j in jobs for o in j.outs]
    header = _safetensors_header(outs)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.pwrite(fd, header, 0)
        pos = len(header)
        for j in jobs:
            written = [0] * len(j.outs)
            starts = [pos + sum(o.nbytes for o in j.outs[:i]) for i in range(len(j.outs))]
            for i, off, a in j.run():
                data = np.ascontiguousarray(a)
                if data.dtype.itemsize != _DTYPE_BYTES[j.outs[i].st_dtype] or off + data.nbytes > j.outs[i].nbytes:
                    raise QnpipeError(f"internal error: {j.outs[i].name} came out {a.dtype}{list(a.shape)}, "
                                      f"planned {j.outs[i].st_dtype}{list(j.outs[i].shape)}")
                os.pwrite(fd, data.data, starts[i] + off)
                written[i] += data.nbytes
                advance(data.nbytes)
            for o, n in zip(j.outs, written, strict=True):
                if n != o.nbytes:
                    raise QnpipeError(f"internal error: {o.name}: {n} bytes written, {o.nbytes} planned")
            pos += sum(o.nbytes for o in j.outs)
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_model_shards(out: Path, jobs: Sequence[_Job], advance: Callable[[int], None]) -> None:
    shards = _shards(jobs, MAX_SHARD_BYTES)
    if len(shards) == 1:
        _write_safetensors(out / "model.safetensors", shards[0], advance)
        return
    wmap: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _write_safetensors(out / name, shard, advance)
        for o in (o for j in shard for o in j.outs):
            wmap[o.name] = name
            total += o.nbytes
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(wmap.items()))}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=4) + "\n")


def _write_expert_layer(experts_dir: Path, el: _ExpertLayer, tensors: list[tuple[str, str, tuple[int, ...]]],
                        num_experts: int, advance: Callable[[int], None]) -> LayerFile:
    slots, record_nbytes, stride = st.record_layout(tensors)
    fname = st.layer_file_name(el.layer)
    crcs: list[int] = []
    per_chunk = max(1, min(num_experts, CHUNK_BYTES // max(1, el.src_bytes_per_expert)))
    fd = os.open(experts_dir / fname, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for e0 in range(0, num_experts, per_chunk):
            e1 = min(num_experts, e0 + per_chunk)
            arrays = _expert_chunk(el, e0, e1)
            buf = np.zeros((e1 - e0, stride), dtype=np.uint8)
            for s in slots:
                a = arrays[s.name]
                if a.shape[1:] != s.shape or a.dtype != np.dtype(st.NP_DTYPES[s.dtype]):
                    raise QnpipeError(f"internal error: layer {el.layer} {s.name} came out {a.dtype}{list(a.shape)}")
                buf[:, s.offset:s.offset + s.nbytes] = np.ascontiguousarray(a).reshape(e1 - e0, -1).view(np.uint8)
            crcs += [zlib.crc32(buf[i, :record_nbytes]) for i in range(e1 - e0)]
            os.pwrite(fd, buf.data, e0 * stride)
            advance((e1 - e0) * stride)
            del arrays, buf
        os.fsync(fd)
    finally:
        os.close(fd)
    quant = {p: _layer_quant(el, p) for p in PROJS if any(s.name == f"{p}.scales" for s in slots)} or None
    return LayerFile(layer=el.layer, file=fname, num_experts=num_experts, stride=stride, record_nbytes=record_nbytes,
                     file_nbytes=num_experts * stride, tensors=slots, quant=quant, checksums=tuple(crcs))


def _layer_quant(el: _ExpertLayer, proj: str) -> Quant:
    q = el.quant_in[proj]
    if q is not None:
        return q
    qo = el.quant_out[proj]
    assert qo is not None
    return Quant(bits=qo.bits, group_size=qo.group_size)


# --------------------------------------------------------------------------- the directory, atomically


def _check_paths(src: Path, out: Path, mtp_from: Path | None, force: bool) -> None:
    if not src.is_dir():
        raise CheckpointError(f"{src}: not a directory")
    for p, what in ((src, "SRC"), (mtp_from, "--mtp-from")):
        if p is not None and (p == out or out in p.parents):
            raise ConfigError(f"--out {out} must not be {what} {p} or contain it")
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise FileExistsError(f"{out} exists (pass --force to replace it)")


def convert(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    bits: int | None = None,
    group_size: int = 64,
    dtype: str | None = None,
    mtp_bits: int = 4,
    mtp_from: str | os.PathLike[str] | None = None,
    force: bool = False,
    progress: bool = False,
    log: Log | None = None,
) -> ConvertReport:
    """Convert checkpoint `src` (original HF or mlx-lm layout) into the qnpipe model directory `out`.

    `bits`/`group_size` quantize an unquantized source exactly as `mlx_lm.convert -q` does
    (router and shared-expert gate at 8 bits / 64); `dtype` casts float tensors (default: the
    config's torch_dtype for HF sources, as mlx-lm does; unchanged for mlx-lm sources).
    `mtp_bits` quantizes the MTP head (0 keeps it float); `mtp_from` is the original checkpoint
    to take `mtp.*` from when `src` has none. `log` receives warnings and notices.

    Raises CheckpointError (bad source), ConfigError (bad options), QnpipeError (not enough
    disk space: both numbers), FileExistsError (`out` exists and `force` is false). Nothing is
    left at `out` or beside it unless the convert succeeds.
    """
    t0 = time.perf_counter()
    log = log or (lambda msg: None)
    src_p = Path(src).resolve()
    out_p = Path(out).absolute().parent.resolve() / Path(out).name
    mtp_p = Path(mtp_from).resolve() if mtp_from is not None else None
    if bits is not None and bits not in BITS:
        raise ConfigError(f"--bits must be one of {', '.join(map(str, BITS))}, got {bits}")
    if mtp_bits and mtp_bits not in BITS:
        raise ConfigError(f"--mtp-bits must be 0 (float) or one of {', '.join(map(str, BITS))}, got {mtp_bits}")
    if group_size not in GROUP_SIZES:
        raise ConfigError(f"--group-size must be one of {', '.join(map(str, GROUP_SIZES))}, got {group_size}")
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    _check_paths(src_p, out_p, mtp_p, force)

    config = read_config(src_p)
    args = args_from_dict(config, str(src_p / "config.json"))
    if is_qnpipe_dir(src_p, config):
        raise CheckpointError(f"{src_p} is already a qnpipe model directory (nothing to convert)")
    infos = scan(src_p)
    layout = detect_layout(infos, src_p)
    if not args.moe_layers:
        raise CheckpointError(f"{src_p / 'config.json'}: the model has no MoE layers (num_experts "
                              f"{args.num_experts}); there are no experts to store")
    plan = _plan(src_p, config, args, infos, layout, bits=bits, group_size=group_size, dtype=dtype,
                 mtp_bits=mtp_bits, mtp_from=mtp_p)
    for w in plan.warnings:
        log(f"warning: {w}")
    records = [_record_tensors(el, args) for el in plan.experts]
    expert_bytes = sum(st.record_layout(r)[2] * args.num_experts for r in records)
    main_bytes = sum(_safetensors_bytes(s) for s in _shards(plan.main, MAX_SHARD_BYTES))
    mtp_bytes = _safetensors_bytes(plan.mtp) if plan.mtp else 0
    small = sum(p.stat().st_size for p in plan.extra_files) + (1 << 20) + 64 * len(records) * args.num_experts
    need = expert_bytes + main_bytes + mtp_bytes + small

    parent = out_p.parent
    existing = next(p for p in (parent, *parent.parents) if p.exists())
    if parent.exists():
        clean_stale(parent, out_p.name, log)
    free = shutil.disk_usage(existing).free
    if free < need:
        raise QnpipeError(f"not enough free disk space in {existing}: the conversion needs {need} bytes "
                          f"({human_bytes(need)}), {free} bytes ({human_bytes(free)}) are available")
    parent.mkdir(parents=True, exist_ok=True)

    bar = ByteProgress(progress, expert_bytes + main_bytes + mtp_bytes, "non-expert weights")
    try:
        with atomic_dir(out_p) as build:
            index = _write_all(build, plan, records, args, bar)
            cfg = dict(plan.config)
            cfg["qnpipe"] = _qnpipe_section(layout, plan, index, mtp_p)
            (build / "config.json").write_text(json.dumps(cfg, indent=4) + "\n")
            bar.stop()
    finally:
        bar.stop()
    seconds = time.perf_counter() - t0
    written = expert_bytes + main_bytes + mtp_bytes
    q0 = index.layers[0].quant
    return ConvertReport(
        out=str(out_p), source_layout=str(layout), moe_layers=len(index.layers), num_experts=args.num_experts,
        quantization=msgspec.to_builtins(q0["gate_proj"]) if q0 else None, dtype=plan.float_dtype,
        mtp=bool(plan.mtp), bytes_written=written, expert_bytes=expert_bytes, seconds=seconds,
        bytes_per_s=written / seconds if seconds > 0 else 0.0, peak_rss_bytes=peak_rss(),
        warnings=tuple(plan.warnings),
    )


def _write_all(build: Path, plan: _Plan, records: list[list[tuple[str, str, tuple[int, ...]]]], args: ModelArgs,
               bar: ByteProgress) -> StoreIndex:
    """Every file of the model directory except config.json, into `build`; returns the store index."""
    (build / st.EXPERTS_DIR).mkdir()
    _write_model_shards(build, plan.main, bar.advance)
    if plan.mtp:
        bar.describe("MTP weights")
        _write_safetensors(build / "mtp.safetensors", plan.mtp, bar.advance)
    layer_files = []
    for el, rec in zip(plan.experts, records, strict=True):
        bar.describe(f"experts, layer {el.layer}")
        layer_files.append(_write_expert_layer(build / st.EXPERTS_DIR, el, rec, args.num_experts, bar.advance))
        _clear_mlx_cache()
    index = StoreIndex(model_id=st.model_id(args), layers=tuple(layer_files))
    st.write_index(build / st.EXPERTS_DIR, index)
    fsync_dir(build / st.EXPERTS_DIR)
    for f in plan.extra_files:
        shutil.copyfile(f, build / f.name)
    return index


def _clear_mlx_cache() -> None:
    import mlx.core as mx

    mx.clear_cache()


def _qnpipe_section(layout: Layout, plan: _Plan, index: StoreIndex, mtp_from: Path | None) -> dict[str, Any]:
    lf = index.layers[0]
    q = lf.quant
    return {
        "format": MODEL_FORMAT,
        "version": MODEL_VERSION,
        "source_layout": str(layout),
        "dtype": plan.float_dtype,
        "quantization": msgspec.to_builtins(q) if q else None,
        "experts": {
            "dir": st.EXPERTS_DIR,
            "index": f"{st.EXPERTS_DIR}/index.json",
            "store_format": FORMAT,
            "store_version": VERSION,
            "model_id": index.model_id,
            "align": ALIGN,
            "layers": [x.layer for x in index.layers],
            "num_experts": lf.num_experts,
            "stride": lf.stride,
            "record_nbytes": lf.record_nbytes,
            "record": [msgspec.to_builtins(t) for t in lf.tensors],
        },
        "mtp": None if not plan.mtp else {
            "file": "mtp.safetensors",
            "naming": "hf",
            "norms": "zero-centred (as in the HF checkpoint; the model adds 1)",
            "experts": "per-expert tensors mtp.layers.0.mlp.experts.E.*",
            "quantization": plan.mtp_qcfg,
            "from": "source" if mtp_from is None else "mtp-from",
        },
    }
