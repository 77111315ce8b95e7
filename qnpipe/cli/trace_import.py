"""`qnpipe trace import FORMAT SRC... -o LOG`: another tool's routing log as a qnpipe routing log."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def _size(src: Path) -> int:
    if src.is_dir():
        return sum(p.stat().st_size for p in src.rglob("*") if p.is_file())
    return src.stat().st_size if src.exists() else 0


def cmd_import(args: argparse.Namespace) -> int:
    import msgspec

    from qnpipe.io.clobber import check_outputs
    from qnpipe.io.outdir import ByteProgress
    from qnpipe.trace.importers import ShapeOverride, describe, import_log, sources

    given = (args.shape, args.num_experts, args.top_k, args.num_layers)
    shape = None
    if any(v is not None for v in given):
        shape = ShapeOverride(name=args.shape, num_experts=args.num_experts, top_k=args.top_k,
                              num_layers=args.num_layers)
    paths = sources(args.format, args.src)
    check_outputs([("-o", args.out)], [("SRC", p) for p in [*map(Path, args.src), *paths]])
    total = sum(_size(p) for p in paths)
    name = paths[0].name if len(paths) == 1 else f"{len(paths)} files"
    bar = ByteProgress(sys.stderr.isatty() and not args.quiet and total > 8 << 20, total, f"importing {name}")
    try:
        summary = import_log(args.format, args.src if len(args.src) > 1 else args.src[0], args.out,
                             progress=bar.advance, max_steps=args.max_steps, max_bytes=args.max_bytes,
                             experts=args.experts, batched=args.batched, shape=shape)
    finally:
        bar.stop()
    print(msgspec.json.encode(summary).decode() if args.json else describe(summary))
    return 0


def register(tsub: Any, fmt: Any) -> None:
    from qnpipe.trace.importers import FORMATS, MAX_BYTES

    p = tsub.add_parser("import", help="convert another tool's routing log into a qnpipe routing log",
                        formatter_class=fmt,
                        description="Convert a routing log written by another tool into a qnpipe routing log\n"
                        "(docs/trace-format.md, \"Imported logs\"), ready for `qnpipe replay` and `qnpipe trace stats`.\n"
                        "Formats:\n"
                        "  mixtral-jsonl  Mario928/speculative-moe JSON lines of Mixtral-8x7B (token_idx or token_pos)\n"
                        "  vllm-jsonl     vLLM MoE-logger JSON lines (meta line, then route rows per forward batch)\n"
                        "  flame-pt       FLAME-MoE .pt captures (a file or a folder of them), read without torch\n"
                        "  csv            any tool: a header line `step,layer,expert[,score]`, then one row per\n"
                        "                 chosen expert; the rows of one (step, layer) are one token's top-k (k the\n"
                        "                 same everywhere); the experts counted from the ids unless --experts N\n"
                        "Several SRC (files, a folder of the format's files, a quoted glob) are the per-layer files of\n"
                        "one run (the vLLM logger writes one file per layer): merged into one log, each step holding\n"
                        "every file's layer. They must have the same requests and steps, the same tokens per step,\n"
                        "and different layers; a mismatch is an error naming the file.\n"
                        "Several requests in one source become consecutive requests of the log, each opened by a\n"
                        "trace.request record. What cannot be attributed (profiling passes, batched prefill rows,\n"
                        "tokens the source's logger dropped) is left out and counted in the summary line.\n"
                        "--batched keeps a batch together instead: each forward pass of the source is one step of\n"
                        "all the tokens it routed (vllm-jsonl: every pass but profiling; flame-pt: the sequences\n"
                        "in lockstep), as the engine ran them, and replay serves it as multi-token steps.\n"
                        "The routing shape is the source's model's (Mixtral-8x7B, Qwen1.5-MoE-A2.7B and its quantized\n"
                        "or renamed variants such as Qwen1.5-MoE-A2.7B-Chat-GPTQ-Int4, FLAME-MoE-290M); --shape NAME\n"
                        "names another known model, --num-experts N --top-k K [--num-layers L] give it outright\n"
                        "(any format; a model no importer knows needs them).\n"
                        "Sources ending in .gz are read gunzipped. A progress bar shows on big files.\n"
                        "At most --max-bytes of source are read (decompressed, all files together; the import\n"
                        "holds a few times that in memory); a JSON line is at most 1 MiB.",
                        epilog="examples:\n"
                        "  qnpipe trace import mixtral-jsonl routing_raw.jsonl -o mixtral.qtrace\n"
                        "  qnpipe trace import vllm-jsonl moe_layer0.jsonl -o qwen-l0.qtrace --max-steps 500\n"
                        "  qnpipe trace import vllm-jsonl Logs/ -o qwen-5layers.qtrace       # moe_layer{0,8,..}.jsonl\n"
                        "  qnpipe trace import vllm-jsonl 'Logs/moe_layer*.jsonl' -o qwen-5layers.qtrace\n"
                        "  qnpipe trace import vllm-jsonl moe_layer0.jsonl -o qwen-batch.qtrace --batched\n"
                        "  qnpipe trace import flame-pt Sample_routing_traces/Encoder_Batch_0-32 -o flame.qtrace\n"
                        "  qnpipe trace import csv routes.csv -o mine.qtrace --experts 64\n"
                        "  qnpipe trace import vllm-jsonl moe_layer0.jsonl -o ds.qtrace --num-experts 64 --top-k 6 --num-layers 28\n"
                        "      routes.csv:  step,layer,expert,score\n"
                        "                   1,0,5,0.61\n"
                        "                   1,0,2,0.39     (step 1, layer 0: a top-2 of experts 5 and 2)\n"
                        "  qnpipe replay mixtral.qtrace --set pool.expert_slots=4 --set replay.record_nbytes=1048576")
    p.add_argument("format", metavar="FORMAT", choices=sorted(FORMATS), help=f"one of: {', '.join(FORMATS)}")
    p.add_argument("src", metavar="SRC", nargs="+",
                   help="the source file, or several (files, folders, a quoted glob: per-layer files of one run; "
                   "for flame-pt, a folder of .pt files)")
    p.add_argument("-o", "--out", metavar="LOG", required=True, help="the routing log to write")
    p.add_argument("--max-steps", type=int, metavar="N", help="keep the first N steps only (requests in order)")
    p.add_argument("--max-bytes", type=int, default=MAX_BYTES, metavar="N",
                   help="read at most N bytes of source, decompressed (default %(default)s: 1 GiB)")
    p.add_argument("--experts", type=int, metavar="N",
                   help="csv: the model's experts per layer (default: the largest expert id + 1)")
    p.add_argument("--shape", metavar="NAME",
                   help="the routing shape of this known model instead of the source's "
                   "(e.g. Qwen/Qwen1.5-MoE-A2.7B-Chat, mistralai/Mixtral-8x7B-v0.1, flame-moe-290m)")
    p.add_argument("--num-experts", type=int, metavar="N", help="the model's experts per MoE layer (over --shape)")
    p.add_argument("--top-k", type=int, metavar="K", help="experts per token (over --shape)")
    p.add_argument("--num-layers", type=int, metavar="L",
                   help="layers 0..L-1, every one a MoE layer (over --shape; a source of an unknown model that "
                   "does not list its layers needs it)")
    p.add_argument("--batched", action="store_true",
                   help="one step per forward pass of all its tokens, the batch not split into requests "
                   "(vllm-jsonl, flame-pt)")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_import)
