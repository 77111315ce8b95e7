"""This machine's measured device profile for the planner, measured in a child process when none is saved.

The first `--memory` run on a machine with no saved profile measures the device (qnpipe.io.measure
`measured_once`, FIRST_MEASURE: ~2 s). Its read buffers (~0.2 GB) would be in the run's own peak resident set,
which the budget bounds: so it runs in a fresh interpreter (qnpipe.plan.fresh), which keeps the profile in the
user cache when it can and hands it back as a file either way.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from qnpipe.errors import QnpipeError
from qnpipe.io.device_file import load_profile, save_profile
from qnpipe.io.measure import measured_once
from qnpipe.io.simssd import DeviceProfile
from qnpipe.plan.fresh import ROOT, STDERR_TAIL, die_with

# False measures in this process (tests whose fake measurement could not reach a child).
_measure_in_child = True


def measured_device(path: Path) -> DeviceProfile:
    """This machine's measured device profile (`measured_once`): the one saved at `path`, else measured now in a
    child process, which keeps it at `path` when it can. QnpipeError (the child's exit status and the end of its
    stderr) when the child fails."""
    if path.exists() or not _measure_in_child:
        return measured_once(path)[0].profile
    with tempfile.TemporaryDirectory(prefix="qnpipe-measure-child-") as d:
        out = Path(d) / "profile.json"
        code = (f"import sys\nsys.path.insert(0, {ROOT!r})\nfrom qnpipe.plan.measured import measure_main\n"
                "measure_main(sys.argv[1], sys.argv[2], int(sys.argv[3]))\n")
        proc = subprocess.run([sys.executable, "-c", code, str(path), str(out), str(os.getpid())],
                              capture_output=True, check=False)
        if proc.returncode != 0 or not out.is_file():
            tail = proc.stderr.decode(errors="replace")[-STDERR_TAIL:]
            raise QnpipeError(f"measuring this machine's device for {path} in a child process ({sys.executable}) "
                              f"failed: exit status {proc.returncode}; its stderr ends:\n{tail}")
        return load_profile(out).profile


def measure_main(path: str, out: str, parent: int) -> None:
    """The measuring child: `measured_once(path)` (kept at `path` when it can be), its profile written to `out`."""
    die_with(parent)
    try:
        measured, _ = measured_once(Path(path))
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    save_profile(out, measured)


__all__ = ["measure_main", "measured_device"]
