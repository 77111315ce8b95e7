"""Issue 34 items 7 and 8: `trace merge` takes only the logs of one run; a compressed CSV is capped as it streams.

`trace merge` accepted the same log twice (exit 0, and the merged log then replayed at a hit rate
of 0.56 against 0.12), the logs of two runs, and an incomplete set of ranks. A rank's log now
holds its run (`Header.run`: the run's id, shared by its ranks at start-up, the rank, the rank
count and the rank's layers); merge refuses, naming the file and what differs, logs of two runs,
a rank twice, a missing rank, layers in two logs or in none. A log without a run id (written
before it existed) is merged only when its ranks and layers pass those checks.

A 4 MB `.csv.gz` of one repeated row took 505 s and 5.6 GB before the 1 GiB import limit stopped
it: a compressed source may now expand only so far as it streams, and each row's memory is taken
from the import's byte budget as it is read.

The logs are built as tests/trace/test_trace_merge.py builds them: routes written straight with
TraceWriter, no model. The headers are written as plain maps, so that the same rows run against
code that does not know `run` (it ignores the field and merged them all, exit 0). Every row fails
before a model loads: in process.
"""

from __future__ import annotations

import gzip
import os
import shutil
import struct
from pathlib import Path
from typing import Any

import msgspec
import pytest

from qnpipe.trace.format import MAGIC, Footer, Route
from tests.cli_harness import Case, check_table

LAYERS = 4
EXPERTS = 8
MODEL = {"num_layers": LAYERS, "moe_layers": list(range(LAYERS)), "num_experts": EXPERTS, "top_k": 2,
         "hidden_size": 0}


def _log(path: Path, layers: range, run: dict[str, Any] | None = None, *, steps: int = 5) -> Path:
    """A routing log holding `layers`' routes for `steps` steps; `run` is the header's `run` (absent if None)."""
    header: dict[str, Any] = {"schema_version": 1, "fingerprint": path.name, "model": MODEL, "clock_start_t": 0.0,
                              "wall_start_unix_s": 0.0, "contents": "routes"}
    if run is not None:
        header["run"] = run
    enc = msgspec.msgpack.Encoder()
    frames = [enc.encode(header)]
    n = 0
    for step in range(1, steps + 1):
        for layer in layers:
            n += 1
            frames.append(enc.encode(Route(t=step + layer / 10, seq=n, step=step, layer=layer, top_k=2,
                                           experts=((step + layer) % EXPERTS, (step + layer + 1) % EXPERTS))))
    frames.append(enc.encode(Footer(records=n, dropped=0, clock_end_t=100.0)))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(MAGIC + b"".join(struct.pack("<I", len(f)) + f for f in frames))
    return path


def _run(run_id: str, rank: int, ranks: int, lo: int, hi: int) -> dict[str, Any]:
    return {"id": run_id, "rank": rank, "ranks": ranks, "lo": lo, "hi": hi}


def _merge(out: Path, *logs: Path) -> list[Any]:
    return ["trace", "merge", *logs, "-o", out]


def _merge_cases(d: Path) -> list[Case]:
    out = d / "out" / "merged.qtrace"
    out.parent.mkdir()
    # A run of three ranks with ids (layers 0, 1-2, 3), and another run of the same model.
    a = [_log(d / "a" / f"run.rank{r}.qtrace", range(lo, hi), _run("aaaa1111", r, 3, lo, hi))
         for r, (lo, hi) in enumerate([(0, 1), (1, 3), (3, 4)])]
    b1 = _log(d / "b" / "run.rank1.qtrace", range(1, 3), _run("bbbb2222", 1, 3, 1, 3))
    a0_again = _log(d / "a2" / "run.rank0.qtrace", range(0, 1), _run("aaaa1111", 0, 3, 0, 1))
    a_overlap = _log(d / "a3" / "run.rank2.qtrace", range(2, 4), _run("aaaa1111", 2, 3, 2, 4))
    a_short = _log(d / "a4" / "run.rank2.qtrace", range(3, 4), _run("aaaa1111", 2, 3, 3, 3))
    # Logs written before runs had ids: ranks from the names (or the order given), layers from the records.
    old = [_log(d / "old" / f"run.rank{r}.qtrace", range(lo, hi)) for r, (lo, hi) in enumerate([(0, 2), (2, 4)])]
    plain = _log(d / "plain.qtrace", range(0, LAYERS))
    copy = d / "copy" / "run.rank1.qtrace"
    copy.parent.mkdir()
    shutil.copy(old[0], copy)
    link = d / "link.qtrace"
    os.link(plain, link)
    third = [_log(d / "old3" / f"run.rank{r}.qtrace", range(lo, hi)) for r, (lo, hi) in enumerate([(0, 1), (1, 3)])]
    clean = (out.parent,)

    def row(name: str, logs: list[Path], rc: int, needles: tuple[str, ...]) -> Case:
        return Case(name, _merge(out, *logs), rc, needles, clean, in_process=True)

    return [
        row("the same log twice", [plain, plain], 2, (str(plain), "twice")),
        row("a log and a hard link to it", [plain, link], 2, (str(link), str(plain), "same file")),
        row("a copy of a rank's log as another rank", [old[0], copy], 2, (str(copy), "layer 0", str(old[0]))),
        row("old logs: a rank missing", third, 2, ("layer 3", "none of the logs")),
        row("two runs", [a[0], b1, a[2]], 2, (str(b1), "bbbb2222", "aaaa1111")),
        row("a rank twice", [a[0], a0_again, a[1], a[2]], 2, (str(a0_again), "rank 0", str(a[0]))),
        row("a rank missing", a[:2], 2, ("aaaa1111", "3 ranks", "rank 2")),
        row("a log with a run id and one without", [a[0], old[1]], 2, (str(old[1]), "no run id", "aaaa1111")),
        row("ranks' layers overlap", [a[0], a[1], a_overlap], 2, (str(a_overlap), "layer 2", str(a[1]))),
        row("a layer in no rank", [a[0], a[1], a_short], 2, ("layer 3", "none of the logs")),
        row("one run, every rank", list(reversed(a)), 0, ("ranks 2, 1, 0",)),
        row("old logs, every rank", old, 0, ("ranks 0, 1",)),
    ]


def test_merge_takes_the_logs_of_one_run(tmp_path: Path) -> None:
    check_table(_merge_cases(tmp_path))


ROW = b"1,0,5\n"


def _import(src: Path, out: Path, *more: str) -> list[Any]:
    return ["trace", "import", "csv", src, "-o", out, *more]


@pytest.mark.slow
def test_compressed_csv_is_capped_as_it_streams(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    # 4 MB of gzip of one repeated valid row (~4 GB of rows): gzip members of 1 MiB each, made in a second
    member = gzip.compress(ROW * ((1 << 20) // len(ROW)), compresslevel=9)
    bomb = tmp_path / "bomb.csv.gz"
    with open(bomb, "wb") as f:
        f.write(gzip.compress(b"step,layer,expert\n"))
        for _ in range((4 << 20) // len(member)):
            f.write(member)
    zeros = tmp_path / "zeros.csv.gz"
    zeros.write_bytes(gzip.compress(b"step,layer,expert\n") + gzip.compress(bytes(64 << 20), compresslevel=1))
    # 30000 rows of 6 bytes (180 kB): their parsed columns take ~30x that, over a 1 MB budget
    many = tmp_path / "many.csv"
    many.write_bytes(b"step,layer,expert\n" + b"".join(f"{s},0,{e}\n".encode() for s in range(3000)
                                                        for e in range(10)))
    t = 30.0  # a hang guard only: each answer is immediate
    check_table([
        Case("4 MB gz bomb of one row", _import(bomb, out / "b.qtrace"), 2, (str(bomb), "compressed"), (out,),
             timeout=t, in_process=True),
        Case("64 MB of zeros, gzipped", _import(zeros, out / "z.qtrace"), 2, (str(zeros), "1048576 bytes"), (out,),
             timeout=t, in_process=True),
        Case("rows over --max-bytes", _import(many, out / "m.qtrace", "--max-bytes", "1000000"), 2,
             (str(many), "1000000 bytes"), (out,), timeout=t, in_process=True),
    ])
    assert not list(out.iterdir())
