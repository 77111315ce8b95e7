"""Build hook for the optional C reader `qnpipe._preadx` (cextensions/preadx.c).

Everything else about the package lives in pyproject.toml. The extension is optional:
when no compiler (or no Python headers) is available the build prints a warning and
the install goes on; qnpipe/io/ssd.py then uses its pure-Python reader.
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
    def _warn(exc: BaseException, name: str = "qnpipe._preadx") -> None:
        print(
            f"WARNING: optional C extension {name} was not built ({type(exc).__name__}: {exc}); "
            "qnpipe will use its pure-Python reader.",
            file=sys.stderr,
        )


ext_modules = []
if sys.platform != "win32":
    ext_modules.append(
        Extension(
            "qnpipe._preadx",
            sources=["cextensions/preadx.c"],
            extra_compile_args=["-O2", "-Wall"],
            extra_link_args=["-pthread"] if sys.platform.startswith("linux") else [],
        )
    )

setup(ext_modules=ext_modules, cmdclass={"build_ext": OptionalBuildExt})
