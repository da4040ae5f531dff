"""``python -m bagstore``: the same command line as ``bagstore``."""

from __future__ import annotations

from bagstore.cli import main

if __name__ == "__main__":
    main()
