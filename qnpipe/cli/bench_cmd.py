"""`qnpipe bench io`: measure this machine's cold random reads and save the fitted device profile."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from qnpipe.cli.common import add_config_flags, config_overrides
from qnpipe.errors import QnpipeError

DEFAULT_RECORDS = "13824,98304,320000,1769472"


def _ints(flag: str, text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise QnpipeError(f"{flag} {text!r}: expected comma-separated integers") from None
    if not out or min(out) < 1:
        raise QnpipeError(f"{flag} {text!r}: expected integers >= 1")
    return out


def cmd_bench_io(args: argparse.Namespace) -> int:
    from qnpipe import config
    from qnpipe.io.device_file import save_profile
    from qnpipe.io.measure import measure_profile

    cfg = config.load(args.config, overrides=config_overrides(args))
    records = _ints("--records", args.records)
    qds = _ints("--qd", args.qd)
    if 1 not in qds or len(set(records)) < 2:
        raise QnpipeError("the fit needs qd 1 in --qd and at least 2 record sizes in --records")
    if not args.seconds > 0 or not args.size_mib > 0:
        raise QnpipeError("--seconds and --size-mib must be > 0")
    from qnpipe.config.user_dirs import device_profile_path

    out = Path(args.output) if args.output else device_profile_path(cfg)
    if not args.output and not cfg.read.device_profile_path:  # the user cache directory: made on first use
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise QnpipeError(f"{out}: cannot make the user cache directory ({e}); give -o FILE") from None
    from qnpipe.trace import check_output_path

    check_output_path(out, "device profile")  # before ~20 s of measuring, not after
    from qnpipe.io.clobber import check_outputs

    check_outputs([("-o" if args.output else "read.device_profile_path", out)], [("--config", args.config)])
    d = Path(args.dir)
    if not d.is_dir():
        raise QnpipeError(f"--dir {d}: not a directory")

    def log(msg: str) -> None:
        if not args.quiet:
            print(msg, file=sys.stderr, flush=True)

    measured = measure_profile(d, records=records, qds=qds, seconds=args.seconds, size_bytes=int(args.size_mib * 2**20),
                               backend=cfg.read.backend, log=log)
    save_profile(out, measured)
    p = measured.profile
    log(f"saved {out}: {p.bandwidth_bytes_per_s / 1e9:.3f} GB/s, {p.latency_s * 1e6:.1f} us + "
        f"{p.per_mb_latency_s * 1e6:.1f} us per MB per read, {p.queue_depth} in service "
        f"(rms {measured.latency_fit_residual_s * 1e6:.1f} us on lone reads, {measured.rate_fit_residual:.3f} "
        "on log rates)")
    if args.json:
        import msgspec

        print(msgspec.json.encode(measured).decode())
    return 0


def register(sub: Any, fmt: Any) -> None:
    b = sub.add_parser("bench", help="measure this machine (bench io: fit a device profile for replay)",
                       formatter_class=fmt,
                       description="Benchmarks of this machine whose results qnpipe uses.",
                       epilog="examples:\n  qnpipe bench io\n  qnpipe bench io --dir /mnt/nvme -o nvme.json")
    bsub = b.add_subparsers(dest="bench_command", metavar="SUBCOMMAND", required=True)
    r = bsub.add_parser("io", help="fit and save the measured device profile (replay --device measured)",
                        formatter_class=fmt,
                        description="Write test files of random bytes in --dir (same disk as your models), read random\n"
                        "records of each --records size with each --qd reads in flight through qnpipe's own\n"
                        "reader (direct I/O, read.backend), remove the files, fit a device profile (bandwidth,\n"
                        "per-read latency + per MB, reads in service at once; docs/replay.md) and save it as JSON\n"
                        "to -o, read.device_profile_path, or by default the user cache directory\n"
                        "(<user cache dir>/device-profile.json: $XDG_CACHE_HOME/qnpipe, else ~/.cache/qnpipe), where\n"
                        "`--device measured` (the planner's default) finds it from any directory.",
                        epilog="examples:\n"
                        "  qnpipe bench io                                   ~20 s, saves ~/.cache/qnpipe/device-profile.json\n"
                        "  qnpipe bench io --dir /mnt/nvme --size-mib 4096 --seconds 2 -o nvme.json\n"
                        "  qnpipe replay run.qtrace --device measured --set read.device_profile_path=nvme.json")
    r.add_argument("--dir", default=".", help="where to write the test files (default: the current directory)")
    r.add_argument("-o", "--output", metavar="FILE", help="profile file (default: read.device_profile_path, else "
                   "the user cache directory's device-profile.json)")
    r.add_argument("--records", default=DEFAULT_RECORDS,
                   help=f"record sizes in bytes, comma-separated (default {DEFAULT_RECORDS})")
    r.add_argument("--qd", default="1,2,4,8,16", help="reads in flight, comma-separated, with 1 (default %(default)s)")
    r.add_argument("--seconds", type=float, default=0.5, help="time per (record, qd) cell (default %(default)s)")
    r.add_argument("--size-mib", type=float, default=1024, help="total size of the test files (default %(default)s)")
    r.add_argument("--json", action="store_true", help="also print the saved profile file on stdout")
    r.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    add_config_flags(r, prefill=False, example="read.backend=python")
    r.set_defaults(func=cmd_bench_io)
