"""Build hook for the optional C parts, each inside the package that uses it: the reader
`qnpipe.io._preadx` (cextensions/preadx.c), LFU's slot table acquire `qnpipe.policy._slot_table`
(cextensions/slot_table.c), Belady's miss-ratio curve loop `qnpipe.replay._mrc_opt`
(cextensions/mrc_opt.c) and, on Linux, the CBLAS shim `qnpipe.compute._cblas_shim` (cextensions/cblas_shim.c).

Everything else about the package lives in pyproject.toml. Both are optional: when no
compiler (or no Python headers) is available the build prints a warning and the install
goes on; qnpipe/io/ssd.py then uses its pure-Python reader, and compute.cpu_blas=auto
falls back to MLX's bundled BLAS (one line in --stats says so), and `qnpipe replay --mrc` to its
numpy Belady (the same numbers, tens of times slower).
"""

from __future__ import annotations

import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    """build_ext that turns any failure into a warning instead of a failed install."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - distutils raises many unrelated types here
            self._warn(exc)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001
            self._warn(exc, ext.name)

    @staticmethod
    def _warn(exc: BaseException, name: str = "(all)") -> None:
        print(
            f"WARNING: optional C extension {name} was not built ({type(exc).__name__}: {exc}); "
            f"qnpipe will use {FALLBACKS.get(name, 'its fallbacks')}.",
            file=sys.stderr,
        )


FALLBACKS = {"qnpipe.io._preadx": "its pure-Python reader", "qnpipe.compute._cblas_shim": "MLX's bundled BLAS",
             "qnpipe.replay._mrc_opt": "its numpy Belady curves",
             "qnpipe.policy._slot_table": "its Python slot table (the same decisions)"}

ext_modules = []
if sys.platform != "win32":
    ext_modules.append(
        Extension(
            "qnpipe.io._preadx",
            sources=["cextensions/preadx.c"],
            extra_compile_args=["-O2", "-Wall"],
            extra_link_args=["-pthread"] if sys.platform.startswith("linux") else [],
        )
    )

    # LFU's slot table acquire (qnpipe/policy/slot_table.py): the pool's decision right after a layer's compute.
    ext_modules.append(Extension("qnpipe.policy._slot_table", sources=["cextensions/slot_table.c"],
                                 extra_compile_args=["-O2", "-Wall"]))

    # A plain shared library loaded with ctypes (qnpipe/replay/mrc.py), never imported: no Python API.
    ext_modules.append(Extension("qnpipe.replay._mrc_opt", sources=["cextensions/mrc_opt.c"],
                                 extra_compile_args=["-O2", "-Wall"]))

if sys.platform.startswith("linux"):
    # A plain shared library loaded with ctypes (qnpipe/compute/blas.py), never imported: no Python
    # API, and no link to a BLAS (its targets are bound at run time).
    ext_modules.append(Extension("qnpipe.compute._cblas_shim", sources=["cextensions/cblas_shim.c"],
                                 extra_compile_args=["-O3", "-Wall", "-Wno-psabi", "-ffp-contract=off"]))

setup(ext_modules=ext_modules, cmdclass={"build_ext": OptionalBuildExt})
