"""``python -m bench SUITE [ARGS...]``: one suite (``core``, ``indexes``, ...) or
``all`` (every suite in turn, see bench.all)."""

from __future__ import annotations

import importlib
import sys

from bench.all import SUITES


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in [*SUITES, "all"]:
        print(f"usage: python -m bench {{all,{','.join(SUITES)}}} [ARGS...]", file=sys.stderr)
        return 2
    return int(importlib.import_module(f"bench.{sys.argv[1]}").main(sys.argv[2:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
