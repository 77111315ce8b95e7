"""Which BLAS MLX's CPU matmuls run on: ``compute.cpu_blas`` = auto | bundled | a library path.

On Linux, ``mlx[cpu]`` links the reference BLAS its wheel bundles; a 256x1024 @ 1024x1024
fp32 matmul takes ~200 ms on it and ~5 ms on OpenBLAS (docs/measurements.md). libmlx
calls three CBLAS routines (``cblas_sgemm``, ``cblas_dgemm``, ``cblas_cgemm``) and is
loaded RTLD_LOCAL by Python, so the dynamic linker looks them up in the global scope
first: a library loaded RTLD_GLOBAL before MLX is imported wins over the bundled one.

``auto`` takes the OpenBLAS of the ``scipy-openblas32`` wheel (a dependency on Linux). Its
symbols carry a ``scipy_`` prefix, so qnpipe's C shim (``qnpipe.compute._cblas_shim``, from
cextensions/cblas_shim.c) exports the unprefixed names and forwards to it. A library path
may be a plain CBLAS (``libopenblas.so.0``: loaded RTLD_GLOBAL as it is) or a
``scipy_``-prefixed one (through the shim). The choice is made once per process, before
MLX is imported; ``select`` is called by the CLI when it loads the config, by
``qnpipe.open_engine`` / ``qnpipe.Engine`` before they import MLX, and by the test suite.
macOS is untouched (MLX uses Accelerate and the GPU there).

This module imports neither MLX nor trio; the environment reaches it only through the config.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.machinery
import importlib.util
import os
import stat
import sys
import threading
import warnings
from pathlib import Path

import msgspec

from qnpipe.config.tree import ComputeCfg
from qnpipe.errors import ConfigError

AUTO = "auto"
BUNDLED = "bundled"
_ROUTINES = ("cblas_sgemm", "cblas_dgemm", "cblas_cgemm")  # what libmlx.so imports (nm -D --undefined-only)
_PREFIX = "scipy_"
# Measured on the 2-core shared development machine (tools/bench_blas.py, docs/measurements.md
# "CPU BLAS"): with its cores busy, 2 OpenBLAS threads were 1.7x to 7x slower than 1.
_MAX_THREADS = 1


class BlasInfo(msgspec.Struct, frozen=True, kw_only=True):
    """The BLAS this process's MLX matmuls use, as reported in engine stats and ``generate --json``."""

    setting: str  # compute.cpu_blas as given
    kind: str  # "openblas" (an optimized BLAS in front of MLX's) or "bundled" (MLX's own)
    library: str = ""  # the file that does the work ("" = MLX's bundled libblas)
    via: str = ""  # the library libmlx's cblas_sgemm resolves to (the shim, or `library` itself)
    version: str = ""  # e.g. OpenBLAS's config string
    threads: int = 0  # BLAS threads (0 = not set by qnpipe)
    note: str = ""  # why the bundled BLAS is in use, when that was not asked for
    # Whether a row's result is independent of the matmul's row count: the reference BLAS is;
    # an optimized one only with compute.batch_invariant (the shim's fixed-order kernel).
    batch_invariant: bool = True

    def describe(self) -> str:
        """One line for ``--stats``."""
        if self.kind == BUNDLED:
            return f"cpu blas: MLX's bundled BLAS{f' ({self.note})' if self.note else ''}"
        mode = "batch-invariant kernel" if self.batch_invariant else "not batch-invariant"
        return f"cpu blas: {self.version or self.library}, {self.threads} threads, via {Path(self.via).name}, {mode}"


_MLX_FIRST = "MLX was imported before qnpipe could load a BLAS in front of it"


class BlasWarning(UserWarning):
    """The configured CPU BLAS could not be put in front of MLX's (MLX was imported first)."""


_lock = threading.Lock()
_chosen: BlasInfo | None = None
_keep: list[ctypes.CDLL] = []  # loaded libraries stay referenced for the life of the process
_shim: list[ctypes.CDLL] = []  # the shim, once loaded


def _shim_loaded() -> ctypes.CDLL | None:
    return _shim[0] if _shim else None


def applied() -> bool:
    """Whether this process has chosen its BLAS (``select`` or ``apply`` ran)."""
    return _chosen is not None


def in_use() -> BlasInfo:
    """What ``select`` chose; before any choice, the bundled BLAS (or nothing to choose on macOS)."""
    if _chosen is not None:
        return _chosen
    return BlasInfo(setting="", kind=BUNDLED, note="compute.cpu_blas not applied in this process")


def apply(compute: ComputeCfg) -> BlasInfo:
    """Apply the ``compute`` section: ``select(cpu_blas)``, then the batch-invariant mode (process-wide)."""
    global _chosen
    info = select(compute.cpu_blas)
    with _lock:
        shim = _shim_loaded()
        if info.kind == BUNDLED or shim is None:
            return info
        shim.qnpipe_cblas_set_exact(int(compute.batch_invariant))
        _chosen = msgspec.structs.replace(info, batch_invariant=compute.batch_invariant)
        return _chosen


def select(setting: str) -> BlasInfo:
    """Apply ``compute.cpu_blas`` = ``setting`` to this process (idempotent; the first load wins).

    Raises ConfigError naming the path when ``setting`` is a path that is not a usable BLAS,
    or when an optimized BLAS is already loaded and ``setting`` asks for something else.
    """
    global _chosen
    with _lock:
        if _chosen is not None and _chosen.setting == setting:
            return _chosen
        if setting not in (AUTO, BUNDLED):
            check_library(setting)
        if _chosen is not None and _chosen.kind != BUNDLED:
            raise ConfigError(
                f"compute.cpu_blas={setting!r}: this process already runs MLX on {_chosen.library} "
                f"(compute.cpu_blas={_chosen.setting!r}); the BLAS is chosen once per process, before MLX "
                "loads: set it in the environment (QNPIPE_COMPUTE__CPU_BLAS) or the config file")
        _chosen = _choose(setting)
        if _chosen.note == _MLX_FIRST:
            warnings.warn(f"compute.cpu_blas={setting!r}: {_MLX_FIRST}, so MLX's CPU matmuls run on its bundled "
                          "reference BLAS (much slower, and other bits than the configured BLAS gives); import "
                          "qnpipe's engine before mlx (qnpipe.Engine, qnpipe.open_engine), or set "
                          "compute.cpu_blas=bundled", BlasWarning, stacklevel=3)
        return _chosen


def _choose(setting: str) -> BlasInfo:
    if setting == BUNDLED:
        return BlasInfo(setting=setting, kind=BUNDLED)
    if not sys.platform.startswith("linux"):
        return BlasInfo(setting=setting, kind=BUNDLED, note=f"compute.cpu_blas applies on Linux only ({sys.platform})")
    path = setting
    if setting == AUTO:
        found = _wheel_openblas()
        if found is None:
            return BlasInfo(setting=setting, kind=BUNDLED, note="no optimized BLAS found (pip install scipy-openblas32)")
        if _shim_path() is None:
            return BlasInfo(setting=setting, kind=BUNDLED,
                            note="qnpipe's C shim qnpipe.compute._cblas_shim was not built (no C compiler at install)")
        path = found
    if "mlx.core" in sys.modules:
        return BlasInfo(setting=setting, kind=BUNDLED, note=_MLX_FIRST)
    return _load(setting, path)


def _wheel_openblas() -> str | None:
    spec = importlib.util.find_spec("scipy_openblas32")
    if spec is None or not spec.submodule_search_locations:
        return None
    libs = sorted(Path(next(iter(spec.submodule_search_locations)), "lib").glob("libscipy_openblas*.so*"))
    return str(libs[0]) if libs else None


def _shim_path() -> str | None:
    here = Path(__file__).resolve().parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        p = here / f"_cblas_shim{suffix}"
        if p.is_file():
            return str(p)
    return None


def _open(path: str, mode: int = os.RTLD_LOCAL) -> ctypes.CDLL:
    try:
        return ctypes.CDLL(path, mode=mode)
    except OSError as e:
        raise ConfigError(f"compute.cpu_blas={path!r}: cannot load it as a shared library ({e})") from None


def _exports(lib: ctypes.CDLL, name: str) -> bool:
    try:
        getattr(lib, name)
    except AttributeError:
        return False
    return True


def _prefix_of(lib: ctypes.CDLL, path: str) -> str:
    for prefix in ("", _PREFIX):
        if all(_exports(lib, prefix + r) for r in _ROUTINES):
            return prefix
    raise ConfigError(
        f"compute.cpu_blas={path!r}: not a BLAS library: it exports neither {', '.join(_ROUTINES)} "
        f"nor their {_PREFIX}-prefixed names (give auto, bundled, or the path of an OpenBLAS)")


def check_library(path: str) -> None:
    """Raise ConfigError naming ``path`` unless it is a regular file, a CBLAS, and computes a product right."""
    # stat before dlopen: opening a FIFO blocks until a writer comes, and a directory or a device is no library.
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise ConfigError(f"compute.cpu_blas={path!r}: no such file (give auto, bundled, or a BLAS library path)") \
            from None
    except OSError as e:
        raise ConfigError(f"compute.cpu_blas={path!r}: cannot read it ({e.strerror})") from None
    if stat.S_ISDIR(mode):
        raise ConfigError(f"compute.cpu_blas={path!r}: is a directory (give auto, bundled, or a BLAS library path)")
    if not stat.S_ISREG(mode):
        raise ConfigError(f"compute.cpu_blas={path!r}: not a regular file (a FIFO, device or socket; give auto, "
                          "bundled, or a BLAS library path)")
    lib = _open(path)
    check_product(lib, _prefix_of(lib, path), f"compute.cpu_blas={path!r}")


_N = 8  # the check's product: 8x8 by 8x8, small integers, so every correct BLAS gives it exactly
_UNWRITTEN = 12345.0  # C's elements before the call (beta = 0: a BLAS must overwrite them)
_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112


def check_product(lib: ctypes.CDLL, prefix: str, label: str) -> None:
    """Compute one small sgemm and one dgemm on ``lib`` itself and compare them with a float64 reference.

    These are the functions the shim forwards to (or, without the shim, the ones libmlx binds to), so
    a library that exports the names but computes wrong (writes zeros, writes nothing) is refused
    before MLX can use it. sgemm runs with B transposed, as MLX's ``x @ W.T`` calls it; dgemm without.
    It costs microseconds (docs/measurements.md, "CPU BLAS").
    """
    a = [float((3 * i + 5 * k) % 7 - 3) for i in range(_N) for k in range(_N)]
    b = [float((2 * j + 3 * k) % 5 - 2) for j in range(_N) for k in range(_N)]
    # sgemm: C = A @ B.T (B read as N x K); dgemm: C = A @ B (B read as K x N).
    want_t = [sum(a[i * _N + k] * b[j * _N + k] for k in range(_N)) for i in range(_N) for j in range(_N)]
    want = [sum(a[i * _N + k] * b[k * _N + j] for k in range(_N)) for i in range(_N) for j in range(_N)]
    for name, ctype, trans, ref in (("cblas_sgemm", ctypes.c_float, _TRANS, want_t),
                                    ("cblas_dgemm", ctypes.c_double, _NO_TRANS, want)):
        arr = ctype * (_N * _N)
        c = arr(*([_UNWRITTEN] * (_N * _N)))
        fn = getattr(lib, prefix + name)
        fn.restype = None
        fn.argtypes = [ctypes.c_int] * 6 + [ctype, arr, ctypes.c_int, arr, ctypes.c_int, ctype, arr, ctypes.c_int]
        fn(_ROW_MAJOR, _NO_TRANS, trans, _N, _N, _N, 1.0, arr(*a), _N, arr(*b), _N, 0.0, c, _N)
        got = list(c)
        diff = max(abs(x - y) for x, y in zip(got, ref, strict=True))
        if diff <= 1e-4 * max(1.0, *map(abs, ref)):  # not-a-number compares False: refused too
            continue
        why = ("writes nothing?" if all(x == _UNWRITTEN for x in got) else "returns zeros?" if not any(got)
               else "not a number" if any(x != x for x in got) else "computes wrong")
        raise ConfigError(f"{label}: {prefix}{name} of an {_N}x{_N} by {_N}x{_N} "
                          f"{'float32' if ctype is ctypes.c_float else 'float64'} product differs from the "
                          f"reference by {diff:.3g} ({why}); give a working BLAS, or compute.cpu_blas=bundled")


def _load(setting: str, path: str) -> BlasInfo:
    lib = _open(path)
    prefix = _prefix_of(lib, path)
    if setting == AUTO:  # a path given was checked by select; the wheel's library is checked here, before binding
        check_product(lib, prefix, f"compute.cpu_blas={setting!r} ({path})")
    shim_path = _shim_path()
    if shim_path is None:
        if prefix:
            raise ConfigError(f"compute.cpu_blas={setting!r}: {path} has {prefix}-prefixed symbols, which need "
                              "qnpipe's C shim qnpipe.compute._cblas_shim, and it was not built (no C compiler at install)")
        # A plain CBLAS (a system OpenBLAS) in the global scope is found before libmlx's own.
        lib = _open(path, os.RTLD_NOW | os.RTLD_GLOBAL)
        via = path
        exact = False
    else:
        # Through the shim even for a plain CBLAS: the batch-invariant kernel lives there.
        shim = _open(shim_path, os.RTLD_NOW | os.RTLD_GLOBAL)
        targets = [ctypes.cast(getattr(lib, prefix + r), ctypes.c_void_p) for r in _ROUTINES]
        shim.qnpipe_cblas_bind.argtypes = [ctypes.c_void_p] * 3
        if shim.qnpipe_cblas_bind(*targets) != 0:
            raise ConfigError(f"compute.cpu_blas={setting!r}: binding the shim to {path} failed")
        shim.qnpipe_cblas_set_exact.argtypes = [ctypes.c_int]
        _keep.append(shim)
        _shim.append(shim)
        via = shim_path
        exact = bool(shim.qnpipe_cblas_exact())
    _keep.append(lib)
    threads = _set_threads(lib, prefix)
    return BlasInfo(setting=setting, kind="openblas", library=path, via=via, version=_config_string(lib, prefix),
                    threads=threads, batch_invariant=exact)


def _set_threads(lib: ctypes.CDLL, prefix: str) -> int:
    name = f"{prefix}openblas_set_num_threads"
    if not _exports(lib, name):
        return 0
    n = max(1, min(_MAX_THREADS, os.cpu_count() or 1))
    fn = getattr(lib, name)
    fn.argtypes = [ctypes.c_int]
    fn(n)
    return n


def _config_string(lib: ctypes.CDLL, prefix: str) -> str:
    name = f"{prefix}openblas_get_config"
    if not _exports(lib, name):
        return ""
    fn = getattr(lib, name)
    fn.restype = ctypes.c_char_p
    return (fn() or b"").decode("ascii", "replace").strip()


def resolver_of(symbol: str = "cblas_sgemm") -> str:
    """The file that defines ``symbol`` in the process's global scope ("" = none there).

    libmlx is loaded RTLD_LOCAL, so its lookups search the global scope first: a library
    named here is the one MLX's calls bind to; "" means they fall through to MLX's bundled BLAS.
    """
    libdl = ctypes.CDLL(ctypes.util.find_library("dl") or "libc.so.6")
    libdl.dlsym.restype = ctypes.c_void_p
    libdl.dlsym.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    addr = libdl.dlsym(ctypes.c_void_p(0), symbol.encode())  # RTLD_DEFAULT
    if not addr:
        return ""

    class DlInfo(ctypes.Structure):
        _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                    ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]

    info = DlInfo()
    libdl.dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(DlInfo)]
    if not libdl.dladdr(ctypes.c_void_p(addr), ctypes.byref(info)) or not info.dli_fname:
        return ""
    return os.path.realpath(info.dli_fname.decode())
