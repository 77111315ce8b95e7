"""`qnpipe convert` of an original Hugging Face checkpoint of any MoE family but Qwen3-Next.

mlx-lm's own conversion runs first, in this process, into a private temporary directory beside
the output (same file system; removed on success, on an error and on Ctrl-C or SIGTERM, and by
the next convert's `clean_stale` after a SIGKILL): `mlx_lm.utils.load_model` (the family's
`sanitize`: per-expert tensors stacked, fused ones split, formats unpacked), the cast to
`--dtype` or the config's `torch_dtype`, `quantize_model` with `--bits`/`--group-size`/`--mode`,
`save_model` and `save_config`, which is what `mlx_lm.convert` does. The tokenizer is not loaded
(mlx-lm's conversion would load and re-save it through transformers): its files are copied as
they are. That directory is then re-laid out as any mlx-lm directory (`qnpipe.convert.family`),
so the result is bit for bit that of `mlx_lm.convert` followed by `qnpipe convert`.

Memory: mlx-lm's conversion holds the model in memory (sanitize's `mx.stack` materialises each
stack whole, and the shards are written whole); the mlx-lm directory path streams records with
preads. docs/store-format.md says so.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import shutil
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

from qnpipe.convert.plan import TOKENIZER_GLOBS
from qnpipe.convert.report import ConvertReport
from qnpipe.errors import CheckpointError, ConfigError
from qnpipe.io.outdir import TMP_TAG, Log, signals_blocked, signals_raise
from qnpipe.model.checkpoint import TensorInfo
from qnpipe.model.family.skeleton import text_config

__all__ = ["MODES", "as_hf_report", "mlx_lm_convert", "mtp_tensors", "through_mlx_lm"]

# Quantization modes and the (group size, bits) each fixes, or None (affine: --bits, --group-size).
MODES: dict[str, tuple[int, int] | None] = {"affine": None, "mxfp4": (32, 4), "nvfp4": (16, 4), "mxfp8": (32, 8)}
SOURCE_LAYOUT = "hf"


def check_quant_options(bits: int | None, group_size: int | None, mode: str | None) -> None:
    """--mode's own bits and group size (mlx-lm's defaults for it) may not be contradicted."""
    if mode is None or mode not in MODES:
        if mode is not None:
            raise ConfigError(f"--mode must be one of {', '.join(MODES)}, got {mode!r}")
        return
    fixed = MODES[mode]
    if fixed is not None and ((bits is not None and bits != fixed[1]) or
                              (group_size is not None and group_size != fixed[0])):
        raise ConfigError(f"--mode {mode} is {fixed[1]}-bit with group size {fixed[0]} "
                          f"(got --bits {bits}, --group-size {group_size})")


def mtp_tensors(config: dict[str, Any], infos: dict[str, TensorInfo]) -> list[str]:
    """The source's MTP tensors: `mtp.*`, or layers past `num_hidden_layers` (DeepSeek/GLM style)."""
    n = text_config(config).get("num_hidden_layers")
    extra = (f"model.layers.{n}.", f"language_model.model.layers.{n}.") if isinstance(n, int) else ()
    return [k for k in infos if k.startswith("mtp.") or ".mtp." in k or (extra and k.startswith(extra))]


@contextlib.contextmanager
def private_dir(out: Path) -> Iterator[Path]:
    """A fresh directory beside `out`, named and locked as `atomic_dir`'s are (so a later convert's
    `clean_stale` removes one a SIGKILL left), removed when the block ends however it ends."""
    tmp = out.parent / f".{out.name}{TMP_TAG}{os.getpid()}-{uuid.uuid4().hex[:8]}-mlx-lm"
    lock_fd = -1
    with signals_raise():
        try:
            tmp.mkdir()
            lock_fd = os.open(tmp / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            yield tmp
        finally:
            with signals_blocked():  # a second Ctrl-C must not interrupt the cleanup
                if lock_fd >= 0:
                    os.close(lock_fd)
                shutil.rmtree(tmp, ignore_errors=True)


def mlx_lm_convert(src: Path, dst: Path, *, bits: int | None = None, group_size: int | None = None,
                   mode: str | None = None, dtype: str | None = None, stdout: Any = None) -> None:
    """What `mlx_lm.convert --hf-path src --mlx-path dst [-q ...] [--dtype ...]` writes, the tokenizer
    files copied rather than re-saved. mlx-lm's prints go to `stdout` (default: nowhere).

    Raises CheckpointError when mlx-lm cannot load the checkpoint (its reason quoted: tensors that
    do not match the config, a quantization it does not know, ...)."""
    import mlx.core as mx
    from mlx.utils import tree_map_with_path
    from mlx_lm.utils import load_model, quantize_model, save_config, save_model

    check_quant_options(bits, group_size, mode)
    with contextlib.redirect_stdout(stdout if stdout is not None else io.StringIO()):
        try:
            model, config = load_model(src, lazy=True)
        except (ValueError, KeyError, TypeError, FileNotFoundError) as e:
            raise CheckpointError(f"{src}: mlx-lm cannot load it as a Hugging Face checkpoint "
                                  f"({type(e).__name__}: {e})") from None
        # mlx_lm.convert's cast: --dtype, else the config's torch_dtype (or text_config.dtype).
        want = dtype or config.get("torch_dtype") or (config.get("text_config") or {}).get("dtype")
        if want in ("float16", "bfloat16", "float32"):
            to = getattr(mx, want)
            keep = getattr(model, "cast_predicate", lambda _: True)
            model.update(tree_map_with_path(
                lambda k, v: v.astype(to) if keep(k) and mx.issubdtype(v.dtype, mx.floating) else v,
                model.parameters()))
        if bits is not None or (mode is not None and mode != "affine"):
            model, config = quantize_model(model, config, group_size, bits, mode=mode or "affine")
        save_model(dst, model, donate_model=True)
        save_config(config, config_path=dst / "config.json")
    for pattern in TOKENIZER_GLOBS:  # generation_config.json included, as mlx_lm.save copies it
        for f in sorted(src.glob(pattern)):
            if f.is_file():
                shutil.copyfile(f, dst / f.name)


@contextlib.contextmanager
def through_mlx_lm(src: Path, out: Path, config: dict[str, Any], infos: dict[str, TensorInfo], *, why: str,
                   progress: bool, log: Log, options: dict[str, Any]) -> Iterator[tuple[Path, list[str]]]:
    """HF checkpoint `src` converted by mlx-lm into a private directory beside `out`: yields (that
    mlx-lm directory, warnings) for the re-layout (`qnpipe.convert.family.convert_family`), and removes
    it after. `why` says what makes `src` an HF checkpoint; `options` are convert's (--bits,
    --group-size, --mode, --dtype, --mtp-from)."""
    from mlx_lm import __version__ as mlx_lm_version

    model_type = config.get("model_type")
    if options.get("--mtp-from") is not None:
        raise ConfigError(f"--mtp-from applies to qwen3_next sources only; {src} is a {model_type} model "
                          "(MTP runs on Qwen3-Next only)")
    check_quant_options(options.get("--bits"), options.get("--group-size"), options.get("--mode"))
    warnings = []
    if mtp := mtp_tensors(config, infos):
        warnings.append(f"{src} holds {len(mtp)} MTP tensors ({mtp[0]}, ...): mlx-lm's conversion drops them "
                        f"and they are not kept (MTP runs on Qwen3-Next only)")
    for w in warnings:
        log(f"warning: {w}")
    out.parent.mkdir(parents=True, exist_ok=True)
    with private_dir(out) as tmp:
        log(f"qnpipe convert: {src} is a Hugging Face checkpoint of a {model_type} model ({why}): converting it "
            f"with mlx-lm {mlx_lm_version} first, into {tmp} (the whole model passes through memory)")
        mlx_dir = tmp / "mlx"
        mlx_lm_convert(src, mlx_dir, bits=options.get("--bits"), group_size=options.get("--group-size"),
                       mode=options.get("--mode"), dtype=options.get("--dtype"),
                       stdout=sys.stderr if progress else None)
        yield mlx_dir, warnings


def as_hf_report(report: ConvertReport, src: Path, mlx_dir: Path, warnings: list[str]) -> ConvertReport:
    """The re-layout's report, told of the HF source (its warnings name `src`, not the private copy)."""
    own = tuple(w.replace(str(mlx_dir), str(src)) for w in report.warnings)
    return msgspec.structs.replace(report, source_layout=SOURCE_LAYOUT, warnings=(*warnings, *own))
