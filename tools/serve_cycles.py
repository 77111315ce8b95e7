"""`qnpipe serve` started and stopped by Ctrl-C with requests in flight, N times: one JSON line.

Each cycle is tests/server/test_serve_stop.py's (`_cycle`): a real server process, one request answered,
three in flight, one or two SIGINTs (alternating); it asserts exit 0, no traceback, the "stopped by" line
and one access-log line per request. Kept out of the test suite for its time (~4 s a cycle here).

    python tools/serve_cycles.py --cycles 20
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.server.test_serve_stop import _cycle  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cycles", type=int, default=20)
    args = ap.parse_args()
    clean = 0
    for i in range(args.cycles):
        _cycle(1 + i % 2)  # raises on the first unclean stop, naming it
        clean += 1
        print(f"cycle {i + 1}: clean", file=sys.stderr)
    print(json.dumps({"bench": "serve_cycles", "cycles": args.cycles, "clean": clean,
                      "loadavg": [round(x, 2) for x in os.getloadavg()]}))


if __name__ == "__main__":
    main()
