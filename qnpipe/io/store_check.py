"""The one validation of an expert store shared by the loader and `qnpipe verify-store`.

`open_layer_file` opens a layer file without ever blocking (a FIFO or a directory where the
file should be is refused) and checks its size; `check_against_model` checks that an index
describes exactly the expert tensors a model asks for (layers, expert count, tensor names,
dtypes, shapes, bits and group size), so a store either side accepts, the other does too.
The model is qnpipe's Qwen3-Next (its `ModelArgs`) or, for any family, an `ExpertSpec`: what
the mlx-lm skeleton's switches hold (`qnpipe.model.family.store_spec.expert_spec`).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import msgspec

from qnpipe.errors import StoreError
from qnpipe.io.store_format import LayerFile, Quant, StoreIndex, index_family

__all__ = ["FLOAT", "ExpertSpec", "check_against_model", "check_store_sha256", "open_layer_file"]

FLOAT = "float"  # an ExpertSpec dtype that any float type of the store satisfies

_FLOATS = ("float32", "float16", "bfloat16")
_PROJS = ("gate_proj", "up_proj", "down_proj")


class ModelExperts(Protocol):
    """What the store is checked against: qnpipe.model.args.ModelArgs (above this layer) has these."""

    @property
    def num_experts(self) -> int: ...
    @property
    def moe_layers(self) -> tuple[int, ...]: ...
    @property
    def expert_dims(self) -> Mapping[str, tuple[int, int]]: ...


class ExpertSpec(msgspec.Struct, frozen=True, kw_only=True):
    """The routed experts of a model of any family, as its skeleton's switches hold them.

    `tensors[layer]` maps each record tensor (`<linear>.<param>`, record order) to its per-expert
    shape (the stack's without the leading E) and dtype (`FLOAT` for any float type, else exact);
    `quant[layer]` maps each quantized expert linear to its quantization.
    """

    model_type: str
    num_experts: int
    switch_paths: dict[int, str]
    tensors: dict[int, dict[str, tuple[tuple[int, ...], str]]]
    quant: dict[int, dict[str, Quant]]


def open_layer_file(root: Path, lf: LayerFile, *, check_size: bool = True) -> int:
    """A read-only fd of layer file `root / lf.file`, which must be a regular file.

    Opened with O_NONBLOCK so a FIFO never blocks; with `check_size`, the size must be the
    index's `file_nbytes`. Raises StoreError naming the file and the layer.
    """
    path = root / lf.file
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise StoreError(f"{path}: missing expert file of layer {lf.layer}") from None
    except OSError as e:
        raise StoreError(f"{path}: cannot open expert file of layer {lf.layer} ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = ("a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode)
                    else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)
                    else "a socket" if stat.S_ISSOCK(st.st_mode) else "not a regular file")
            raise StoreError(f"{path}: expert file of layer {lf.layer} is {kind}, not a regular file")
        os.set_blocking(fd, True)
        if check_size and st.st_size != lf.file_nbytes:
            what = "truncated" if st.st_size < lf.file_nbytes else "larger than the index says"
            raise StoreError(
                f"{path}: {what}: {st.st_size} bytes, the index expects {lf.file_nbytes} "
                f"(layer {lf.layer}: {lf.num_experts} records, {lf.stride} bytes apart)"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def _config_quant(qcfg: Mapping[str, Any] | None, path: str) -> tuple[int, int] | None:
    """(bits, group size) the config names for module `path` by its own entry, else None."""
    if qcfg is None or not isinstance(qcfg.get(path), Mapping):
        return None
    p = qcfg[path]
    return p.get("bits"), p.get("group_size")


def _check_layers(index: StoreIndex, index_path: Path, want: list[int]) -> None:
    have = sorted(lf.layer for lf in index.layers)
    if have != want:
        missing = sorted(set(want) - set(have))
        extra = sorted(set(have) - set(want))
        what = "; ".join(p for p in (f"missing layer(s) {missing}" if missing else "",
                                     f"unexpected layer(s) {extra}" if extra else "") if p)
        raise StoreError(f"{index_path}: store holds layers {have}, the model's MoE layers are {want} ({what})")


def check_against_model(index: StoreIndex, index_path: Path, args: ModelExperts | ExpertSpec,
                        qcfg: Mapping[str, Any] | None = None) -> None:
    """Check that `index` holds exactly the routed experts of the model `args` describes.

    For an `ExpertSpec` (any family): `_check_spec`. For Qwen3-Next's ModelArgs: layers must be
    the model's MoE layers; each with `num_experts` records whose tensors are gate/up/down
    `weight` (plus `scales` and `biases` when the projection is quantized) with the shapes the
    sizes, bits and group size give. Raises StoreError naming the index file, the layer, the
    tensor and both values.
    """
    if isinstance(args, ExpertSpec):
        _check_spec(index, index_path, args)
        return
    fam = index_family(index)
    if fam.model_type != "qwen3_next":
        raise StoreError(f"{index_path}: a store of a {fam.model_type} model, not of this qwen3_next model")
    _check_layers(index, index_path, list(args.moe_layers))
    dims = args.expert_dims
    for lf in sorted(index.layers, key=lambda lf: lf.layer):
        where = f"{index_path}: layer {lf.layer} ({lf.file})"
        if lf.num_experts != args.num_experts:
            raise StoreError(f"{where}: {lf.num_experts} experts, config.json says {args.num_experts}")
        tensors = {t.name: t for t in lf.tensors}
        quant = lf.quant or {}
        unknown = sorted(set(quant) - set(_PROJS))
        if unknown:
            raise StoreError(f"{where}: quantization for unknown projection(s) {unknown}")
        expected: dict[str, tuple[tuple[int, ...], tuple[str, ...]]] = {}
        for proj in _PROJS:
            out_d, in_d = dims[proj]
            q = quant.get(proj)
            if q is None:
                expected[f"{proj}.weight"] = ((out_d, in_d), _FLOATS)
                continue
            if q.mode != "affine":
                raise StoreError(f"{where}: {proj} has quantization mode {q.mode!r}; only 'affine' is supported")
            if q.bits not in (2, 3, 4, 5, 6, 8) or q.group_size not in (32, 64, 128):
                raise StoreError(f"{where}: {proj} is {q.bits}-bit/group {q.group_size}; bits must be one of "
                                 f"2, 3, 4, 5, 6, 8 and group size one of 32, 64, 128")
            if in_d % q.group_size or (in_d * q.bits) % 32:
                raise StoreError(f"{where}: {proj} input size {in_d} does not fit {q.bits}-bit/group {q.group_size}")
            cq = _config_quant(qcfg, f"model.layers.{lf.layer}.mlp.switch_mlp.{proj}")
            if cq is not None and cq != (q.bits, q.group_size):
                raise StoreError(f"{where}: {proj} is {q.bits}-bit/group {q.group_size}, "
                                 f"config.json says {cq[0]}-bit/group {cq[1]}")
            expected[f"{proj}.weight"] = ((out_d, in_d * q.bits // 32), ("uint32",))
            for part in ("scales", "biases"):
                expected[f"{proj}.{part}"] = ((out_d, in_d // q.group_size), _FLOATS)
        for name, (shape, dtypes) in expected.items():
            t = tensors.get(name)
            if t is None:
                raise StoreError(f"{where}: records have no tensor {name}")
            if tuple(t.shape) != shape:
                raise StoreError(f"{where}: tensor {name} has shape {list(t.shape)}, the model needs {list(shape)}")
            if t.dtype not in dtypes:
                raise StoreError(f"{where}: tensor {name} has dtype {t.dtype}, the model needs "
                                 f"{' or '.join(dtypes)}")
        extra_t = sorted(set(tensors) - set(expected))
        if extra_t:
            raise StoreError(f"{where}: unexpected tensor(s) {extra_t} in the records")


def _check_spec(index: StoreIndex, index_path: Path, spec: ExpertSpec) -> None:
    """The index against a skeleton's switches: family, layers and switch paths, expert count, and
    per layer the record tensors (names, per-expert shapes, dtypes) and each linear's quantization."""
    fam = index_family(index)
    if fam.model_type != spec.model_type:
        raise StoreError(f"{index_path}: a store of a {fam.model_type} model; this model is {spec.model_type}")
    _check_layers(index, index_path, sorted(spec.switch_paths))
    for lf in sorted(index.layers, key=lambda lf: lf.layer):
        where = f"{index_path}: layer {lf.layer} ({lf.file})"
        path, want_path = fam.switch_paths[lf.layer], spec.switch_paths[lf.layer]
        if path != want_path:
            raise StoreError(f"{where}: the store's switch is {path}, the model's is {want_path}")
        if lf.num_experts != spec.num_experts:
            raise StoreError(f"{where}: {lf.num_experts} experts, the model ({want_path}) has {spec.num_experts}")
        have = {t.name: t for t in lf.tensors}
        want = spec.tensors[lf.layer]
        if list(have) != list(want):
            missing = [n for n in want if n not in have]
            extra = [n for n in have if n not in want]
            raise StoreError(f"{where}: records hold tensors {list(have)}, the model's {want_path} has "
                             f"{list(want)} (missing {missing}, unexpected {extra}; in this order)")
        for name, (shape, dtype) in want.items():
            t = have[name]
            if tuple(t.shape) != tuple(shape):
                raise StoreError(f"{where}: tensor {name} has shape {list(t.shape)} per expert, the model's "
                                 f"{want_path}.{name} needs {list(shape)}")
            if not (t.dtype == dtype or (dtype == FLOAT and t.dtype in _FLOATS)):
                raise StoreError(f"{where}: tensor {name} has dtype {t.dtype}, the model's {want_path}.{name} "
                                 f"needs {'a float type' if dtype == FLOAT else dtype}")
        hq, wq = lf.quant or {}, spec.quant.get(lf.layer, {})
        for lin in sorted(set(hq) | set(wq)):
            a, b = hq.get(lin), wq.get(lin)
            if a != b:
                raise StoreError(f"{where}: {lin} is {_describe_quant(a)} in the store, {_describe_quant(b)} "
                                 f"in the model")


def _describe_quant(q: Quant | None) -> str:
    if q is None:
        return "float"
    gs = ", global scale" if q.global_scale else ""
    return f"{q.mode} {q.bits}-bit/group {q.group_size}{gs}"


def check_store_sha256(index_path: Path, sha256: str, expected: str | None) -> None:
    """StoreError when the store's `index.json` (bytes hashing to `sha256`) is not the one its model
    was converted with (`expected`: config.json's `qnpipe.experts.index_sha256`; None for a model
    converted before it was recorded, which is matched by its model id only).

    Made after every other check, so a store that is wrong in itself says what is wrong first.
    The model id names a shape: another model of that shape (its store given as model.expert_dir
    or EXPERT_DIR) would otherwise load and give other tokens."""
    if expected is not None and sha256 != expected:
        raise StoreError(f"{index_path}: not this model's expert store: the model's config.json "
                         f"(qnpipe.experts.index_sha256) names the store whose index.json has sha256 "
                         f"{expected[:16]}..., this one has {sha256[:16]}... (another model's store, or one "
                         f"changed since `qnpipe convert` wrote it)")
