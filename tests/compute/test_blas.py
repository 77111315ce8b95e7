"""compute.cpu_blas: which library MLX's cblas_sgemm calls bind to, seen by the dynamic linker itself.

The choice is per process and must precede `import mlx`, so each setting runs in a fresh
interpreter that takes it from the environment (through qnpipe's config, as `qnpipe.Engine`
does) and multiplies once; LD_DEBUG=bindings makes ld.so print which file each of libmlx's
symbol lookups bound to. No timing is involved.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from qnpipe.compute import blas
from qnpipe.errors import ConfigError

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="compute.cpu_blas applies on Linux")

# `qnpipe.Engine` is the library entry point that applies compute.cpu_blas before MLX loads.
SCRIPT = """
import json, qnpipe
qnpipe.Engine
import mlx.core as mx
from qnpipe.compute import blas
mx.eval(mx.ones((3, 5)) @ mx.ones((5, 2)))
print(json.dumps({"info": blas.in_use().kind, "via": blas.in_use().via, "resolver": blas.resolver_of()}))
"""


def _run(setting: str) -> tuple[dict[str, str], str]:
    env = {**os.environ, "QNPIPE_COMPUTE__CPU_BLAS": setting, "LD_DEBUG": "bindings"}
    p = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    binds = re.findall(r"binding file (\S*libmlx\.so) \[\d+\] to (\S+) \[\d+\]: normal symbol `cblas_sgemm'", p.stderr)
    assert len(binds) == 1, f"expected one binding of libmlx's cblas_sgemm, got {binds}"
    return json.loads(p.stdout.strip().splitlines()[-1]), binds[0][1]


def test_auto_puts_openblas_in_front_of_mlx_bundled_blas() -> None:
    out, bound_to = _run("auto")
    assert out["info"] == "openblas"
    assert Path(bound_to).name.startswith("_cblas_shim"), bound_to
    assert os.path.realpath(bound_to) == out["resolver"] == os.path.realpath(out["via"])


def test_bundled_leaves_mlx_on_its_own_blas() -> None:
    out, bound_to = _run("bundled")
    assert out["info"] == "bundled"
    assert re.match(r"libblas\b.*\.so", Path(bound_to).name), bound_to
    assert out["resolver"] == ""


def test_a_path_that_is_not_a_blas_is_refused_naming_it(tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("not a library")
    with pytest.raises(ConfigError, match=re.escape(repr(str(text))) + ".*cannot load it as a shared library"):
        blas.select(str(text))
    # A real shared library without the CBLAS routines (libc).
    libc = blas.resolver_of("printf")
    with pytest.raises(ConfigError, match=re.escape(repr(libc)) + ": not a BLAS library"):
        blas.select(libc)
    missing = tmp_path / "libopenblas.so"
    with pytest.raises(ConfigError, match=re.escape(repr(str(missing))) + ": no such file"):
        blas.select(str(missing))


def test_the_stats_line_names_the_blas() -> None:
    fast = blas.BlasInfo(setting="auto", kind="openblas", library="/x/libscipy_openblas.so", via="/q/_cblas_shim.so",
                         version="OpenBLAS 0.3.34", threads=2)
    assert fast.describe() == "cpu blas: OpenBLAS 0.3.34, 2 threads, via _cblas_shim.so, batch-invariant kernel"
    variant = msgspec.structs.replace(fast, batch_invariant=False)
    assert variant.describe() == "cpu blas: OpenBLAS 0.3.34, 2 threads, via _cblas_shim.so, not batch-invariant"
    slow = blas.BlasInfo(setting="auto", kind="bundled", note="no optimized BLAS found (pip install scipy-openblas32)")
    assert slow.describe() == "cpu blas: MLX's bundled BLAS (no optimized BLAS found (pip install scipy-openblas32))"


def _row_bits_vary(m: int = 40) -> list[str]:
    """The (rows, cols) of calls whose first rows differ from the same rows computed in a bigger call."""
    import mlx.core as mx
    import numpy as np

    rng = np.random.default_rng(0)
    out = []
    for k, n, trans in ((64, 128, True), (256, 37, True), (32, 300, False), (8, 33, False)):
        a = mx.array(rng.standard_normal((m, k), dtype=np.float32))
        w = rng.standard_normal((n, k) if trans else (k, n), dtype=np.float32)
        b = mx.array(w).T if trans else mx.array(w)  # trans: x @ W.T, as a linear layer
        full = np.array(a @ b)
        for rows in range(1, m):
            if not np.array_equal(np.array(a[:rows] @ b), full[:rows]):
                out.append(f"{rows} of {m} rows, k={k} n={n}")
                break
        for cols in range(1, n):
            if not np.array_equal(np.array(a[:3] @ b[:, :cols]), full[:3, :cols]):
                out.append(f"{cols} of {n} columns, k={k}")
                break
    return out


def test_batch_invariant_mode_gives_a_row_the_same_bits_in_every_call() -> None:
    from qnpipe import config
    from qnpipe.config import ComputeCfg

    if blas.in_use().kind == blas.BUNDLED:
        pytest.skip("the bundled reference BLAS is batch-invariant by itself: nothing to switch")
    setting = blas.in_use().setting
    try:
        assert blas.apply(ComputeCfg(cpu_blas=setting, batch_invariant=False)).batch_invariant is False
        assert _row_bits_vary(), "OpenBLAS was expected to vary with the row count (else this test proves nothing)"
        assert blas.apply(ComputeCfg(cpu_blas=setting, batch_invariant=True)).batch_invariant is True
        assert _row_bits_vary() == []
        # And it still multiplies: the fixed-order kernel against float64 numpy.
        import mlx.core as mx
        import numpy as np

        rng = np.random.default_rng(1)
        a, w = rng.standard_normal((9, 300), dtype=np.float32), rng.standard_normal((300, 70), dtype=np.float32)
        want = a.astype(np.float64) @ w.astype(np.float64)
        for b in (mx.array(w), mx.array(np.ascontiguousarray(w.T)).T):
            assert np.allclose(np.array(mx.array(a) @ b), want, rtol=1e-4, atol=1e-4)
    finally:
        blas.apply(config.load().compute)


def test_auto_without_the_wheel_or_the_shim_says_why_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    # What an install without scipy-openblas32, or without a C compiler, reports instead of loading.
    monkeypatch.setattr(blas, "_shim_path", lambda: None)
    info = blas._choose("auto")
    assert info.kind == blas.BUNDLED
    assert info.describe() == ("cpu blas: MLX's bundled BLAS (qnpipe's C shim qnpipe.compute._cblas_shim was not built "
                               "(no C compiler at install))")
    monkeypatch.setattr(blas, "_wheel_openblas", lambda: None)
    assert "pip install scipy-openblas32" in blas._choose("auto").describe()
    assert blas._choose("bundled").describe() == "cpu blas: MLX's bundled BLAS"


def test_mlx_imported_first_leaves_the_bundled_blas_and_says_so_once() -> None:
    script = ("import warnings, mlx.core, qnpipe\n"
              "warnings.simplefilter('always')\n"
              "qnpipe.Engine\n"
              "from qnpipe.compute import blas\n"
              "print(blas.in_use().kind)\n")
    env = {**os.environ, "QNPIPE_COMPUTE__CPU_BLAS": "auto"}
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["bundled"]
    assert p.stderr.count("BlasWarning: compute.cpu_blas='auto': MLX was imported before qnpipe") == 1, p.stderr
    assert "import qnpipe's engine before mlx" in p.stderr
