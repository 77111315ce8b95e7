"""`qnpipe make-tiny`, `convert` and `verify-store`: the commands that write or check model directories."""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path
from typing import Any

import msgspec

from qnpipe.cli.common import add_config_flags, load_config
from qnpipe.cli.flags import positional_or_flag
from qnpipe.errors import QnpipeError


def cmd_make_tiny(args: argparse.Namespace) -> int:
    from qnpipe.io.outdir import output_path

    log = lambda msg: print(msg, file=sys.stderr)  # noqa: E731
    if args.family is None and args.mode != "affine":
        raise QnpipeError("--mode needs --family (the Qwen3-Next tiny model is affine-quantized only)")
    if args.family is not None and args.layout == "hf":
        raise QnpipeError(f"--family {args.family} writes mlx-lm's layout only (drop --layout hf)")
    if args.layout == "hf" and args.bits is not None:
        raise QnpipeError("--bits needs --layout mlx (the original HF layout is never quantized)")
    try:
        if args.family is not None:
            from qnpipe.convert.tiny_family import make_tiny_family

            out = make_tiny_family(Path(args.out), args.family, bits=args.bits, group_size=args.group_size,
                                   mode=args.mode, seed=args.seed, force=args.force, log=log)
        else:
            from qnpipe.convert.tiny import make_tiny

            out = make_tiny(Path(args.out), layout=args.layout or "hf", bits=args.bits,
                            group_size=args.group_size or 64, seed=args.seed, force=args.force, log=log)
    except FileExistsError:
        raise QnpipeError(f"{output_path(args.out)} exists and is not empty (pass --force to replace it)") from None
    print(out)
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    cfg = load_config(args)  # first: it puts the configured CPU BLAS in front of MLX, which qnpipe.convert imports
    from qnpipe.convert import convert

    mtp_bits = cfg.mtp.bits if args.mtp_bits is None else args.mtp_bits
    report = convert(args.src, args.out, bits=args.bits, group_size=args.group_size, mode=args.mode, dtype=args.dtype,
                     mtp_bits=mtp_bits, mtp_from=args.mtp_from, force=args.force, hub_timeout_s=cfg.net.hub_timeout_s,
                     progress=not (args.json or args.quiet),
                     log=lambda msg: print(msg, file=sys.stderr))
    if args.json:
        print(msgspec.json.encode(report).decode())
    elif not args.quiet:
        print(f"{report.out}: {report.moe_layers} MoE layers x {report.num_experts} experts, "
              f"{report.bytes_written / 2**20:.1f} MiB written in {report.seconds:.1f}s "
              f"({report.bytes_per_s / 2**20:.1f} MiB/s), peak RSS {report.peak_rss_bytes / 2**20:.0f} MiB",
              file=sys.stderr)
        print(report.out)
    return 0


def cmd_verify_store(args: argparse.Namespace) -> int:
    from qnpipe.convert.verify import describe, verify_store

    report = verify_store(args.dir, progress=not args.json)
    if args.json:
        print(msgspec.json.encode({**msgspec.to_builtins(report), "ok": report.ok}).decode())
    else:
        print(describe(report))
    return 0 if report.ok else 1


def register(sub: Any, fmt: Any) -> None:
    from qnpipe.model.family.registry import TESTED

    families = ", ".join(TESTED)
    t = sub.add_parser("make-tiny", help="write a deterministic random tiny Qwen3-Next model (for tests)",
                       formatter_class=fmt,
                       description="Write a tiny Qwen3-Next (hidden 128, 8 layers, 64 experts, top-4, vocab 1024)\n"
                       "with random weights, MTP tensors, a small real tokenizer and a Qwen chat template.\n"
                       "--family FAMILY writes a tiny random model of another MoE family instead (mlx-lm's own\n"
                       "model class, saved in mlx-lm's layout with the same tokenizer; docs/tiny-model.md).\n"
                       f"Families: {textwrap.fill(families, 100, subsequent_indent='  ')}",
                       epilog="examples:\n  qnpipe make-tiny ./tiny --layout mlx --bits 4\n"
                       "  qnpipe make-tiny ./tiny-qwen3-moe --family qwen3_moe --bits 4\n"
                       "  qnpipe make-tiny ./tiny-gpt-oss --family gpt_oss --mode mxfp4")
    t.add_argument("out", metavar="OUT", help="directory to create")
    t.add_argument("--family", choices=TESTED, metavar="FAMILY",
                   help="an mlx-lm model_type (list above): a tiny random model of that family in mlx-lm's layout "
                   "(default: the Qwen3-Next tiny model)")
    t.add_argument("--layout", choices=["hf", "mlx"],
                   help="hf = original Hugging Face layout (default); mlx = mlx-lm converted (the only one with "
                   "--family)")
    t.add_argument("--bits", type=int, choices=[2, 3, 4, 5, 6, 8], help="quantize (mlx layout only)")
    t.add_argument("--group-size", type=int, choices=[32, 64, 128],
                   help="quantization group size (default 64; 32 with --family, whose experts are 32 wide)")
    t.add_argument("--mode", choices=["affine", "mxfp4", "nvfp4", "mxfp8"], default="affine",
                   help="quantization mode, with --family (mxfp4/nvfp4/mxfp8 fix bits and group size)")
    t.add_argument("--seed", type=int, default=0, help="random seed (same seed, same bytes)")
    t.add_argument("--force", action="store_true",
                   help="replace OUT if it exists and qnpipe wrote it (never another directory)")
    t.set_defaults(func=cmd_make_tiny)

    v = sub.add_parser("convert", help="convert a checkpoint into a qnpipe model directory (expert store)",
                       formatter_class=fmt,
                       description="Convert an original Hugging Face Qwen3-Next checkpoint, or an mlx-lm converted one,\n"
                       "into a qnpipe model directory: non-expert weights in safetensors, the MTP head in\n"
                       "mtp.safetensors, and experts/ with one file per MoE layer (one read per expert).\n"
                       "An mlx-lm directory of any other MoE family mlx-lm runs (qwen3_moe, gpt_oss, glm4_moe,\n"
                       "deepseek_v3, ...) is re-laid out as it is; an original HF checkpoint of those goes\n"
                       "through mlx-lm's own conversion first (in memory, into a temporary directory beside DIR).\n"
                       "Memory stays near one chunk of experts; the output appears only when complete.\n"
                       "Layout: docs/store-format.md.",
                       epilog="examples:\n"
                       "  qnpipe convert Qwen/Qwen3-Next-80B-A3B-Instruct --out ./qn80b-4bit --bits 4\n"
                       "  qnpipe convert ./Qwen3-Next-80B-A3B-Instruct --out ./qn80b-4bit --bits 4\n"
                       "  qnpipe convert ./Qwen3-Next-80B-A3B-Instruct-4bit --out ./qn80b-4bit \\\n"
                       "      --mtp-from ./Qwen3-Next-80B-A3B-Instruct\n"
                       "  qnpipe convert ./Qwen3-30B-A3B-4bit --out ./qwen3-30b-qn\n"
                       "  qnpipe convert ./tiny --out ./tiny-qn --json")
    positional_or_flag(v, "src", "SRC", "--hf-path",
                       "checkpoint directory (original HF or mlx-lm layout), or a Hugging Face repository id "
                       "OWNER/NAME[@REVISION]: only the files convert reads are fetched into the hub cache (resumed "
                       "if cut short; HF_HUB_OFFLINE=1 uses the cache alone)")
    v.add_argument("--out", "--mlx-path", required=True, metavar="DIR", help="model directory to create")
    v.add_argument("--bits", type=int, choices=[2, 3, 4, 5, 6, 8],
                   help="quantize an unquantized source as `mlx_lm.convert -q` does (router and "
                   "shared-expert gate at 8 bits)")
    v.add_argument("--group-size", type=int, choices=[32, 64, 128],
                   help="quantization group size (default 64)")
    v.add_argument("--mode", choices=["affine", "mxfp4", "nvfp4", "mxfp8"],
                   help="quantization mode of an HF checkpoint of another family, as `mlx_lm.convert --q-mode` "
                   "(mxfp4/nvfp4/mxfp8 fix bits and group size; default affine)")
    v.add_argument("--dtype", choices=["float16", "bfloat16", "float32"],
                   help="float type of the output (default: torch_dtype of an HF source, as mlx-lm; "
                   "unchanged for an mlx-lm source)")
    v.add_argument("--mtp-bits", type=int, choices=[0, 2, 3, 4, 5, 6, 8], metavar="N",
                   help="quantize the MTP head to N bits, 0 = keep float (default: mtp.bits, MTP_BITS, 4)")
    v.add_argument("--mtp-from", metavar="HF_DIR",
                   help="take mtp.* from this original checkpoint, a directory or a repository id (an mlx-lm "
                   "source has no MTP)")
    v.add_argument("--force", action="store_true",
                   help="replace DIR if it exists and qnpipe wrote it (never another directory)")
    v.add_argument("-q", "--quiet", action="store_true", help="no progress bar or summary")
    v.add_argument("--json", action="store_true", help="print one JSON object with the figures (no progress bar)")
    add_config_flags(v, prefill=False, example="mtp.bits=8")
    v.set_defaults(func=cmd_convert)

    s = sub.add_parser("verify-store", help="check every expert record against its checksum", formatter_class=fmt,
                       description="Read every expert record of a qnpipe model directory and compare its crc32 with\n"
                       "experts/index.json. Bad records are listed by layer, expert, file and offset;\n"
                       "exit status 1 if any is bad (2 if the index itself is missing or invalid, or does\n"
                       "not match the model's config.json: the checks the loader makes).",
                       epilog="examples:\n  qnpipe verify-store ./qn80b-4bit\n"
                       "  qnpipe verify-store ./qn80b-4bit/experts --json")
    s.add_argument("dir", metavar="DIR", help="qnpipe model directory, or its experts/ directory")
    s.add_argument("--json", action="store_true", help="print one JSON object (counts, throughput, bad records)")
    s.set_defaults(func=cmd_verify_store)
