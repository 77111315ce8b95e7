"""compute.cpu_blas given a path: only a regular file that is a working BLAS is taken (issue 34, items 7 and 9).

A library that exports the CBLAS names but computes nothing (writes zeros, or leaves C as it
was) is built here with the C compiler, as a plain CBLAS and as a ``scipy_``-prefixed one (the
shim's route); each must be refused at load, naming the path, the product and its difference
from the reference, through the CLI (``--set compute.cpu_blas=...``) and the Python API
(``qnpipe.Engine(..., cpu_blas=...)``, and the environment as a fresh process takes it). A FIFO
must never block, and a FIFO, a directory and a text file are named with what they are.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from qnpipe.compute import blas
from qnpipe.errors import ConfigError
from tests.cli_harness import Case, check_table, clean_env

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="compute.cpu_blas applies on Linux")

MODEL = str(Path(blas.__file__).resolve().parent.parent / "data" / "tiny_trained")
HANG_GUARD = 30.0

# The three routines libmlx calls, with the CBLAS signatures; BODY is what sgemm and dgemm do to C.
WRONG_BLAS = """
#include <string.h>
#define GEMM(name, T) \\
    void name(int order, int ta, int tb, int m, int n, int k, T alpha, const T *a, int lda, const T *b, int ldb, \\
              T beta, T *c, int ldc) { \\
        (void)order; (void)ta; (void)tb; (void)k; (void)alpha; (void)a; (void)lda; (void)b; (void)ldb; (void)beta; \\
        for (int i = 0; i < m; i++) BODY; }
GEMM(PREFIX##cblas_sgemm, float)
GEMM(PREFIX##cblas_dgemm, double)
void PREFIX##cblas_cgemm(int order, int ta, int tb, int m, int n, int k, const void *alpha, const void *a, int lda,
                         const void *b, int ldb, const void *beta, void *c, int ldc) {}
"""
ZEROS = "memset(c + (long)i * ldc, 0, (size_t)n * sizeof *c)"
NOTHING = "(void)c"


def _compiler() -> str | None:
    return shutil.which("cc") or shutil.which("gcc")


def _build(out: Path, body: str, prefix: str = "") -> Path:
    cc = _compiler()
    if cc is None:
        pytest.skip("no C compiler (cc or gcc) to build the wrong BLAS with")
    src = out.with_suffix(".c")
    # ## needs a macro argument: spell the prefix out instead.
    src.write_text(WRONG_BLAS.replace("PREFIX##", prefix).replace("BODY", body))
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(out), str(src)], check=True, timeout=60,
                   capture_output=True)
    return out


class Inputs(NamedTuple):
    zeros: Path
    nothing: Path
    zeros_prefixed: Path
    fifo: Path
    text: Path
    directory: Path
    missing: Path


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Inputs]:
    d = tmp_path_factory.mktemp("blas")
    fifo = d / "libfifo.so"
    os.mkfifo(fifo)
    text = d / "libtext.so"
    text.write_text("INPUT(-lopenblas)\n" * 20)  # a linker script, as /usr/lib's libc.so is
    (d / "libdir.so").mkdir()
    yield Inputs(zeros=_build(d / "libzero.so", ZEROS), nothing=_build(d / "libnothing.so", NOTHING),
                 zeros_prefixed=_build(d / "libscipy_zero.so", ZEROS, prefix="scipy_"),
                 fifo=fifo, text=text, directory=d / "libdir.so", missing=d / "libmissing.so")


# (row, which input, what the message must say besides the path)
ROWS: list[tuple[str, Callable[[Inputs], Path], tuple[str, ...]]] = [
    ("zeros", lambda i: i.zeros, ("cblas_sgemm", "8x8", "differs from the reference by", "returns zeros")),
    ("writes nothing", lambda i: i.nothing, ("cblas_sgemm", "differs from the reference by", "writes nothing")),
    ("zeros, scipy_-prefixed (the shim's route)", lambda i: i.zeros_prefixed,
     ("scipy_cblas_sgemm", "differs from the reference by", "returns zeros")),
    ("fifo", lambda i: i.fifo, ("not a regular file",)),
    ("text file", lambda i: i.text, ("cannot load it as a shared library",)),
    ("directory", lambda i: i.directory, ("is a directory",)),
    ("missing", lambda i: i.missing, ("no such file",)),
]


def test_cli_refuses_a_path_that_is_not_a_working_blas(inputs: Inputs) -> None:
    # In process: the check runs before a model loads, whichever BLAS this process took first.
    cases = [Case(name, ["generate", MODEL, "-p", "hi", "-n", "1", "--set", f"compute.cpu_blas={pick(inputs)}"],
                  2, (str(pick(inputs)), *needles), in_process=True, timeout=HANG_GUARD)
             for name, pick, needles in ROWS]
    # A fresh process, as a user runs it: the wrong BLAS would be the first and only one loaded.
    cases.append(Case("zeros, fresh process", ["generate", MODEL, "-p", "hi", "-n", "1", "--set",
                                               f"compute.cpu_blas={inputs.zeros}"],
                      2, (str(inputs.zeros), "returns zeros"), timeout=HANG_GUARD))
    check_table(cases)


class _Guard:
    """A hang guard for an in-process call: SIGALRM after HANG_GUARD seconds."""

    def __enter__(self) -> None:
        def fire(signum: int, frame: Any) -> None:
            raise TimeoutError(f"no answer in {HANG_GUARD}s")

        self.old = signal.signal(signal.SIGALRM, fire)
        signal.setitimer(signal.ITIMER_REAL, HANG_GUARD)

    def __exit__(self, *exc: object) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, self.old)


def test_python_api_refuses_a_path_that_is_not_a_working_blas(inputs: Inputs) -> None:
    import qnpipe

    failures = []
    for name, pick, needles in ROWS:
        path = str(pick(inputs))
        try:
            with _Guard():
                qnpipe.Engine(MODEL, cpu_blas=path).close()
        except ConfigError as e:
            missing = [n for n in (repr(path), *needles) if n not in str(e)]
            if missing:
                failures.append(f"{name}: message lacks {missing}: {e}")
        except BaseException as e:  # noqa: BLE001 - every other outcome is the row's failure
            failures.append(f"{name}: {type(e).__name__}: {e}")
        else:
            failures.append(f"{name}: accepted")
    assert not failures, "\n".join(failures)


API_SCRIPT = "import qnpipe\nqnpipe.Engine\n"


@pytest.mark.parametrize(("pick", "needle"), [(lambda i: i.zeros, "returns zeros"),
                                              (lambda i: i.fifo, "not a regular file")], ids=["zeros", "fifo"])
def test_python_api_in_a_fresh_process_takes_the_environment_and_refuses(inputs: Inputs, pick: Callable[[Inputs], Path],
                                                                         needle: str) -> None:
    path = str(pick(inputs))
    p = subprocess.run([sys.executable, "-c", API_SCRIPT], capture_output=True, text=True, timeout=HANG_GUARD,
                       env=clean_env() | {"QNPIPE_COMPUTE__CPU_BLAS": path})
    assert p.returncode == 1
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("qnpipe.errors.ConfigError: ") and repr(path) in last and needle in last, \
        p.stderr[-2000:]


def test_a_working_blas_passes_the_check() -> None:
    # The wheel's OpenBLAS (scipy_-prefixed) and MLX's bundled reference BLAS (plain CBLAS).
    found = [p for p in (blas._wheel_openblas(), _bundled_libblas()) if p]
    assert found
    for path in found:
        blas.check_library(path)


def _bundled_libblas() -> str | None:
    import importlib.util

    spec = importlib.util.find_spec("mlx")
    if spec is None or not spec.submodule_search_locations:
        return None
    libs = sorted(Path(next(iter(spec.submodule_search_locations))).parent.glob("mlx*.libs/libblas*.so*"))
    return str(libs[0]) if libs else None
