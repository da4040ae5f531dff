"""Every benchmark in turn: ``python -m bench all [--quick]`` (or ``bagstore bench all``).

Each suite prints its own table (metric, bagstore, raw, ratio, goal, met?);
then one line per suite says how long it took and whether it ran.  A server
that is not there (MariaDB, memcached, Redis, a second MariaDB server) is
skipped with a line saying so; a suite that fails makes the exit code 1.
``--json PATH`` writes every row (for bench/RESULTS.md's table).

``--quick`` runs every suite at a small size: under two minutes on a
2-core machine with the local MariaDB.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import traceback
from dataclasses import asdict

from bench import common

SUITES = [
    "codec",
    "core",
    "indexes",
    "update",
    "sequences",
    "cache",
    "cleaner",
    "scaleout",
    "tables",
    "replicas",
    "changes",
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="run every benchmark in turn")
    p.add_argument("--quick", action="store_true", help="every suite at a small size")
    p.add_argument("--backend", choices=["sqlite", "mysql", "all"], default="all")
    p.add_argument("--format", choices=["rich", "plain", "markdown"], default="plain")
    p.add_argument("--only", nargs="+", choices=SUITES, default=SUITES, metavar="SUITE")
    p.add_argument("--json", metavar="PATH", help="write every row measured to PATH")
    args = p.parse_args(argv)
    ran: list[tuple[str, float, int]] = []
    started = time.perf_counter()
    for suite in args.only:
        argv_suite = ["--format", args.format] + (["--quick"] if args.quick else [])
        if suite != "codec":
            argv_suite += ["--backend", args.backend]
        print(f"\n==== bench.{suite} {' '.join(argv_suite)}", flush=True)
        t0 = time.perf_counter()
        try:
            code = importlib.import_module(f"bench.{suite}").main(argv_suite) or 0
        except Exception:  # report it, run the others, fail at the end
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        ran.append((suite, time.perf_counter() - t0, code))
    total = time.perf_counter() - started
    print("\n==== bench all" + (" --quick" if args.quick else ""))
    for suite, seconds, code in ran:
        print(f"  bench.{suite:10} {seconds:6.1f}s  {'ok' if code == 0 else f'FAILED ({code})'}")
    print(f"  total {total:.1f}s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    "quick": args.quick,
                    "suites": {s: {"seconds": round(t, 1), "code": c} for s, t, c in ran},
                    "rows": [{"bench": title, **asdict(row)} for title, row in common.RECORDED],
                },
                f,
                indent=1,
            )
    return 1 if any(code for _, _, code in ran) else 0


if __name__ == "__main__":
    sys.exit(main())
