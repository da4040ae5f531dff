"""The SQLite library this process uses, and the WAL-reset bug some versions
have (see docs/configuration.md); re-exported by :mod:`bagstore.backends.sqlite`."""

from __future__ import annotations

import sqlite3
from typing import Any

__all__ = ["has_wal_reset_bug", "sqlite_library", "wal_reset_advice"]


def has_wal_reset_bug(version: str = sqlite3.sqlite_version) -> bool:
    """Whether this SQLite library (``sqlite3.sqlite_version`` by default) has
    the WAL-reset bug (https://www.sqlite.org/wal.html#walresetbug): a rare
    race between connections checkpointing and writing one file that can
    corrupt it.  Versions 3.7.0 to 3.51.2 have it, except the 3.44.6 and
    3.50.7 patch releases.

    >>> has_wal_reset_bug("3.40.1"), has_wal_reset_bug("3.51.3"), has_wal_reset_bug("3.44.6")
    (True, False, False)
    """
    parts = tuple(int(p) for p in version.split(".")[:3] if p.isdigit())
    v = parts + (0,) * (3 - len(parts))
    if v >= (3, 51, 3) or v < (3, 7, 0):
        return False
    return not ((3, 44, 6) <= v < (3, 45, 0) or (3, 50, 7) <= v < (3, 51, 0))


def wal_reset_advice(version: tuple[int, ...] = sqlite3.sqlite_version_info) -> str | None:
    """What to do about the WAL-reset bug, when SQLite ``version`` (this
    process's library by default) has it; None when it does not.

    >>> wal_reset_advice((3, 51, 3)) is None
    True
    """
    text = ".".join(map(str, version))
    if not has_wal_reset_bug(text):
        return None
    return (
        f"this Python's SQLite library, {text}, has the WAL-reset bug (SQLite 3.7.0 to "
        "3.51.2): rarely, a file written and checkpointed by several connections at once is "
        "corrupted. Run bagstore on a Python whose sqlite3 module uses SQLite 3.51.3 or later "
        "(or the 3.44.6 or 3.50.7 patch releases; check with python3 -c 'import sqlite3; "
        "print(sqlite3.sqlite_version)'), or store on MariaDB; see docs/configuration.md"
    )


def sqlite_library() -> dict[str, Any]:
    """The SQLite library this process uses, and whether it has the WAL-reset
    bug (see docs/configuration.md)."""
    return {"version": sqlite3.sqlite_version, "wal_reset_bug": has_wal_reset_bug()}
