"""Foreign inputs through the CLI: importer sources, `trace stats` logs, `trace synth` arguments (issue 22, 2, 5, 6).

Each row runs `python -m qnpipe ...` under a memory limit and a timeout (tests/cli_harness.py):
a crafted `.pt` file (offsets, strides, element counts, zip bombs, pickle memo bombs), a FIFO,
a device or a directory where a file belongs, a 100 MB line, arguments asking for 10^12 of
something: each is exit 2 with a message naming the file and the value, no traceback, no
MemoryError, no crash, nothing left behind.
"""

from __future__ import annotations

import gzip
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest
from cli_harness import Case, check_table
from pt_craft import META, Tensor, capture, capture_tensors, patch_sizes, pickled, write_pt

from qnpipe.trace import SCHEMA_VERSION, Header, ModelShape, Route, TraceWriter

MARIO_LINES = b"".join(b'{"dataset": "humaneval", "problem_id": 0, "layer": 0, "experts": [1, 2], '
                       b'"gating_probs": [0.6, 0.4], "token_idx": %d}\n' % i for i in range(2000))  # 236 KB
VLLM_META = b'{"type": "meta", "model_id": "Qwen/Qwen1.5-MoE-A2.7B-Chat", "top_k": 4, "layers_logged": [0]}\n'


def _import(fmt: str, src: Path, out: Path, *more: str) -> list[object]:
    return ["trace", "import", fmt, src, "-o", out / f"{src.name}.qtrace", *more]


def _pt_cases(d: Path, out: Path) -> list[Case]:
    def row(name: str, path: Path, *needles: str, more: tuple[str, ...] = ()) -> Case:
        return Case(name, _import("flame-pt", path, out, *more), 2, (path.name, *needles), (out,))

    ts = capture_tensors(16)
    memo_bomb = pickled(META, ts).replace(b"\x80\x02}(", b"\x80\x02}r\xff\xff\xff\x3f(", 1)  # LONG_BINPUT 2**30 - 1
    floats = dict(ts, indices=Tensor("2", ts["indices"].data.astype(np.float32) + 0.7, 0, (16, 6), (6, 1), 96))
    bomb = dict(ts, indices=ts["indices"]._replace(key="9"))
    with zipfile.ZipFile(d / "bomb.pt", "w", compression=zipfile.ZIP_DEFLATED, compresslevel=1) as z:
        z.writestr("archive/data.pkl", pickled(META, bomb))
        for t in ts.values():
            z.writestr(f"archive/data/{t.key}", t.data.tobytes())
        z.writestr("archive/data/9", ts["indices"].data.tobytes() + bytes(64 << 20))  # 64 MB in 64 KB
    return [
        # today: as_strided reads 46 elements past the storage's end (heap bytes as expert ids)
        row("pt offset negative", capture(d / "neg_offset.pt", offset=-50), "storage offset -50"),
        # today: a segfault (reads 8 GB before the buffer)
        row("pt stride negative", capture(d / "neg_stride.pt", stride=(-10**9, 1)), "stride (-1000000000, 1)"),
        row("pt stride past the end", capture(d / "far_stride.pt", stride=(7, 1)), "element 110", "96 elements"),
        row("pt offset past the end", capture(d / "far_offset.pt", offset=2**70), f"offset {2**70}"),
        # today: 18 GB allocated (a MemoryError under the limit)
        row("pt zero stride huge", capture(d / "zero_stride.pt", size=(400_000_000, 6), stride=(0, 1)),
            "2400000000 elements", "96"),
        row("pt size overflow", capture(d / "overflow.pt", size=(2**40, 2**40), stride=(1, 1)), "elements"),
        row("pt numel negative", capture(d / "neg_numel.pt", numel=-5), "-5 elements"),
        row("pt numel beyond data", capture(d / "big_numel.pt", numel=10**15), f"{10**15}"),
        row("pt declared 4 GB member", patch_sizes(write_pt(d / "declared.pt", META, ts), "archive/data/2",
                                                   0xF000_0000), "archive/data/2", "4026531840"),
        row("pt zip bomb", d / "bomb.pt", "archive/data/9", "16000000", more=("--max-bytes", "16000000")),
        # today: a 10-byte pickle opcode asks for an 8 GB memo (MemoryError)
        row("pt pickle memo bomb", _zip(d / "memo.pt", memo_bomb, ts), "memo index 1073741823"),
        # today: silently truncated to whole ids
        row("pt float expert ids", write_pt(d / "float_ids.pt", META, floats), "indices", "float32"),
        row("pt negative layout", write_pt(d / "neg_layout.pt", {**META, "token_position": None, "num_sequences": -2,
                                                                 "sequence_length": -8}, ts), "num_sequences -2"),
    ]


def _zip(path: Path, pkl: bytes, tensors: dict[str, Tensor]) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", pkl)
        for t in tensors.values():
            z.writestr(f"archive/data/{t.key}", t.data.tobytes())
    return path


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _special_cases(d: Path, out: Path) -> list[Case]:
    fifo_dir = d / "pts"
    fifo_dir.mkdir()
    capture(fifo_dir / "a.pt")
    _fifo(fifo_dir / "b.pt")
    (d / "srcdir").mkdir()
    fifo = _fifo(d / "routes.jsonl")
    t = 20.0  # a FIFO blocks forever today: the timeout is the failure
    return [
        Case("mixtral-jsonl FIFO", _import("mixtral-jsonl", fifo, out), 2, ("routes.jsonl", "FIFO"), (out,), timeout=t),
        Case("vllm-jsonl FIFO", _import("vllm-jsonl", fifo, out), 2, ("routes.jsonl", "FIFO"), (out,), timeout=t),
        Case("flame-pt FIFO", _import("flame-pt", _fifo(d / "c.pt"), out), 2, ("c.pt", "FIFO"), (out,), timeout=t),
        Case("flame-pt FIFO in a folder", _import("flame-pt", fifo_dir, out), 2, ("b.pt", "FIFO"), (out,), timeout=t),
        Case("mixtral-jsonl /dev/zero", _import("mixtral-jsonl", Path("/dev/zero"), out), 2, ("/dev/zero", "device"),
             (out,), timeout=t),
        Case("flame-pt /dev/zero", _import("flame-pt", Path("/dev/zero"), out), 2, ("/dev/zero", "device"), (out,),
             timeout=t),
        Case("vllm-jsonl directory", _import("vllm-jsonl", d / "srcdir", out), 2, ("srcdir", "directory"), (out,)),
        Case("stats FIFO", ["trace", "stats", _fifo(d / "log.qtrace")], 2, ("log.qtrace", "FIFO"), timeout=t),
        Case("stats /dev/zero", ["trace", "stats", "/dev/zero"], 2, ("/dev/zero", "device"), timeout=t),
        Case("stats directory", ["trace", "stats", d / "srcdir"], 2, ("srcdir", "directory")),
        Case("synth popularity FIFO", ["trace", "synth", "-o", out / "s.qtrace", "--popularity",
                                       _fifo(d / "pop.csv")], 2, ("pop.csv", "FIFO"), (out,), timeout=t),
    ]


def _log(path: Path, shape: ModelShape, experts: tuple[int, ...]) -> Path:
    header = Header(schema_version=SCHEMA_VERSION, fingerprint="test", model=shape, clock_start_t=0.0,
                    wall_start_unix_s=0.0, contents="routes")
    w = TraceWriter(path, header)
    w.write(Route(t=0.0, seq=1, step=1, layer=0, top_k=shape.top_k, experts=experts))
    w.close(0, 0.0)
    return path


def _bounded_cases(d: Path, out: Path) -> list[Case]:
    line = d / "long_line.jsonl"
    with open(line, "wb") as f:
        f.truncate(100 << 20)  # a 100 MB line of NULs, sparse: no disk, no time
    gz = d / "long_line.jsonl.gz"
    gz.write_bytes(gzip.compress(VLLM_META) + gzip.compress(b"{" + b" " * (100 << 20), compresslevel=1))
    many = d / "many.jsonl"
    many.write_bytes(MARIO_LINES)
    many_gz = d / "many.jsonl.gz"
    many_gz.write_bytes(gzip.compress(MARIO_LINES))
    shape = ModelShape(num_layers=1, moe_layers=(0,), num_experts=10**9, top_k=2, hidden_size=0)
    k0 = ModelShape(num_layers=1, moe_layers=(0,), num_experts=8, top_k=0, hidden_size=0)
    synth = ["trace", "synth", "-o", out / "synth.qtrace"]
    t = 15.0  # each answer is immediate; 15 s allows for a loaded machine's start-up
    return [
        Case("mixtral-jsonl 100 MB line", _import("mixtral-jsonl", line, out), 2, ("long_line.jsonl", "line 1",
                                                                                   "1048576 bytes"), (out,)),
        Case("vllm-jsonl 100 MB gz line", _import("vllm-jsonl", gz, out), 2, ("long_line.jsonl.gz", "line 2",
                                                                            "1048576 bytes"), (out,)),
        Case("mixtral-jsonl over --max-bytes", _import("mixtral-jsonl", many, out, "--max-bytes", "100000"), 2,
             ("many.jsonl", "100000 bytes"), (out,)),
        Case("mixtral-jsonl gz over --max-bytes", _import("mixtral-jsonl", many_gz, out, "--max-bytes", "100000"), 2,
             ("many.jsonl.gz", "100000 bytes"), (out,)),
        Case("import --max-bytes 0", _import("mixtral-jsonl", many, out, "--max-bytes", "0"), 2, ("max_bytes=0",),
             (out,)),
        Case("stats 10^9 experts", ["trace", "stats", _log(d / "wide.qtrace", shape, (1, 2))], 2,
             ("wide.qtrace", "1000000000"), timeout=t),
        Case("stats top_k 0", ["trace", "stats", _log(d / "k0.qtrace", k0, (1, 2))], 2, ("k0.qtrace", "top_k"),
             timeout=t),
        Case("synth experts 10^12", [*synth, "--experts", str(10**12)], 2, ("experts=1000000000000",), (out,),
             timeout=t),
        Case("synth tokens 10^12", [*synth, "--tokens", str(10**12)], 2, ("tokens=1000000000000",), (out,),
             timeout=t),
        Case("synth layers 10^9", [*synth, "--layers", str(10**9)], 2, ("layers=1000000000",), (out,), timeout=t),
        Case("synth top-k 10^5", [*synth, "--experts", "65536", "--top-k", "100000"], 2, ("top_k=100000",), (out,),
             timeout=t),
        Case("synth seed 10^30", [*synth, "--seed", str(10**30), "--tokens", "1"], 2, ("seed=" + str(10**30),),
             (out,), timeout=t),
        Case("synth draws product", [*synth, "--tokens", "1000000"], 2, ("tokens x layers x top_k",
                                                                         "480000000"), (out,), timeout=t),
        Case("synth table product", [*synth, "--layers", "4096", "--experts", "65536", "--tokens", "1", "--top-k",
                                     "1"], 2, ("layers x experts", "268435456"), (out,), timeout=t),
    ]


@pytest.fixture
def out(tmp_path: Path) -> Path:
    o = tmp_path / "out"
    o.mkdir()
    return o


@pytest.mark.slow
def test_crafted_pt_files_are_refused_before_any_view_or_allocation(tmp_path: Path, out: Path) -> None:
    check_table(_pt_cases(tmp_path, out))


@pytest.mark.slow
def test_fifos_devices_and_directories_are_refused_never_read(tmp_path: Path, out: Path) -> None:
    check_table(_special_cases(tmp_path, out))


@pytest.mark.slow
def test_counts_and_sizes_are_bounded_before_anything_is_allocated(tmp_path: Path, out: Path) -> None:
    check_table(_bounded_cases(tmp_path, out))
