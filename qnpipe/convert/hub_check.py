"""What `qnpipe convert OWNER/NAME` checks before it downloads a checkpoint: from its config.json and the Hub's file list.

A 61 GB download refused afterwards for its family, or for the disk it fills, costs an hour; the
Hub gives both answers for the price of one small file. `qnpipe.convert.hub.fetch` fetches the
repository's config.json and file list (sizes included) and calls `check_remote` with them before
anything else is downloaded:

- the family: a `model_type` qnpipe runs (`qnpipe.model.family.registry`, or the native
  qwen3_next, whose config must parse and have MoE layers); an unsupported one names its reason,
  a dense or unknown one the families that run; a config naming model code of its own, or one
  mlx-lm's class cannot be built from or builds without routed experts, is refused as loading
  would refuse it (the model's layer and expert shapes come from that class);
- the weights: safetensors files in the list (convert reads no other format);
- the disk: the files still to download (into the hub cache), the output (its weights at the
  output's bits per weight), and, for another family's original HF checkpoint, mlx-lm's own
  conversion, which is written beside the output before the re-layout and lives as long as it.
  Where the hub cache and the output share a file system the sums are added.

The estimate is the source's bytes scaled by bits per weight (a quantized source is re-laid out
at its size); the exact figure is checked again after the download, from the tensor headers,
before any weight is read (`qnpipe.convert.build`, `qnpipe.convert.family`).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from qnpipe.errors import CheckpointError, QnpipeError

__all__ = ["RemoteCheckpoint", "check_remote", "disk_needs"]

_FLOAT_BITS = {"float32": 32, "float16": 16, "bfloat16": 16}
_MODE_BITS = {"mxfp4": (4, 32), "nvfp4": (4, 16), "mxfp8": (8, 32)}  # (bits, group size) each mode fixes


@attrs.frozen
class RemoteCheckpoint:
    """A Hub repository as convert would fetch it, known before the download."""

    where: str  # "SRC owner/name": how errors name it
    config: Mapping[str, Any]  # its config.json
    files: Mapping[str, int]  # what convert fetches: name -> bytes
    cached: frozenset[str]  # those of `files` already in the hub cache
    cache_dir: Path  # the hub cache the download goes to


def check_remote(remote: RemoteCheckpoint, *, out: Path, bits: int | None = None, group_size: int | None = None,
                 mode: str | None = None, dtype: str | None = None) -> None:
    """Refuse `remote` before its download: a family qnpipe does not run, or not enough free disk.

    Raises CheckpointError (the family) or QnpipeError (the disk: every figure named)."""
    check_family(remote.config, remote.where)
    if not any(f.endswith(".safetensors") for f in remote.files):
        raise CheckpointError(f"{remote.where}: the repository has no *.safetensors weights (convert reads "
                              "safetensors only; a PyTorch .bin checkpoint needs converting to safetensors first)")
    _check_disk(remote, out, disk_needs(remote, bits=bits, group_size=group_size, mode=mode, dtype=dtype))


def check_family(config: Mapping[str, Any], where: str) -> None:
    from qnpipe.model.family.registry import TESTED, UNSUPPORTED

    model_type = config.get("model_type")
    inner = config.get("text_config")
    inner_type = inner.get("model_type") if isinstance(inner, Mapping) else None
    if not isinstance(model_type, str) or not model_type:
        raise CheckpointError(f"{where}: its config.json has no model_type: not a checkpoint qnpipe converts")
    if config.get("model_file") is not None:
        raise CheckpointError(f"{where}: its config.json asks to import model code ({config['model_file']!r}); "
                              "qnpipe runs mlx-lm's own model classes only")
    if model_type == "qwen3_next":
        from qnpipe.model.args import args_from_dict

        args = args_from_dict(dict(config), f"{where} config.json")
        if not args.moe_layers:
            raise CheckpointError(f"{where}: its config.json has no MoE layers (num_experts {args.num_experts}): "
                                  "there are no experts to stream")
        return
    for t in (model_type, inner_type):
        if t in UNSUPPORTED:
            raise CheckpointError(f"{where}: a {t} model, which qnpipe does not run: {UNSUPPORTED[t]} "
                                  "(docs/model.md, \"Supported families\")")
    if model_type not in TESTED and inner_type not in TESTED:
        raise CheckpointError(f"{where}: model_type {model_type!r} is not a mixture-of-experts family qnpipe runs "
                              f"(a dense model, or one mlx-lm does not know); the families: {', '.join(TESTED)} "
                              "(docs/model.md, \"Supported families\")")
    # mlx-lm's own class built from the config, its weights never materialised (under a second for a
    # 235B config): a config it cannot build, or one with no routed experts, is refused as loading would.
    from qnpipe.model.family.skeleton import build_skeleton, family_info

    plain = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
    family_info(plain, build_skeleton(plain, {}, where), where)


@attrs.frozen
class DiskNeeds:
    download: int  # bytes still to fetch into the hub cache
    output: int  # the qnpipe model directory, about
    mlx_lm: int  # mlx-lm's conversion beside it first (0 unless another family's original HF checkpoint)
    bits_would_shrink: bool = False  # a float source converted without --bits


def disk_needs(remote: RemoteCheckpoint, *, bits: int | None = None, group_size: int | None = None,
               mode: str | None = None, dtype: str | None = None) -> DiskNeeds:
    config = remote.config
    inner = config.get("text_config")
    tc = inner if isinstance(inner, Mapping) else config
    weights = sum(n for f, n in remote.files.items() if f.endswith(".safetensors"))
    download = sum(n for f, n in remote.files.items() if f not in remote.cached)
    mlx_quantized = isinstance(config.get("quantization") or tc.get("quantization"), Mapping)
    quantized = mlx_quantized or bool(config.get("quantization_config"))
    if quantized:
        output = weights  # already quantized: re-laid out at its size
    else:
        src_bits = _FLOAT_BITS.get(str(config.get("torch_dtype") or tc.get("dtype") or tc.get("torch_dtype")), 16)
        if mode in _MODE_BITS:
            b, g = _MODE_BITS[mode]
            out_bits = b + 8 / g  # one 8-bit scale per group
        elif bits is not None:
            out_bits = bits + 32 / (group_size or 64)  # a 16-bit scale and bias per group
        else:
            out_bits = _FLOAT_BITS.get(dtype or "", src_bits)
        output = int(weights * out_bits / src_bits)
    hf_other = config.get("model_type") != "qwen3_next" and not mlx_quantized
    return DiskNeeds(download=download, output=output, mlx_lm=output if hf_other else 0,
                     bits_would_shrink=not quantized and bits is None and mode in (None, "affine"))


def _existing(p: Path) -> Path:
    p = Path(os.path.abspath(p))
    return next(q for q in (p, *p.parents) if q.exists())


def _check_disk(remote: RemoteCheckpoint, out: Path, needs: DiskNeeds) -> None:
    from qnpipe.io.outdir import human_bytes

    cache_at, out_at = _existing(remote.cache_dir), _existing(Path(out).parent)
    beside_out = needs.output + needs.mlx_lm
    wants = [(cache_at, needs.download)]
    if os.stat(cache_at).st_dev == os.stat(out_at).st_dev:
        wants = [(out_at, needs.download + beside_out)]
    else:
        wants.append((out_at, beside_out))
    for at, need in wants:
        free = shutil.disk_usage(at).free
        if need > free:
            mlx = f", {human_bytes(needs.mlx_lm)} of it mlx-lm's conversion first" if needs.mlx_lm else ""
            raise QnpipeError(
                f"{remote.where}: not enough free disk space for it: the download takes {human_bytes(needs.download)} "
                f"in the hub cache {remote.cache_dir} and the conversion about {human_bytes(beside_out)} beside --out "
                f"{out}{mlx}: {human_bytes(need)} in all on the file system of {at}, which has {human_bytes(free)} "
                "free. Nothing but its config.json was downloaded; free some space or set HF_HUB_CACHE to another "
                f"disk{', or quantize with --bits 4' if needs.bits_would_shrink else ''}")
