"""Failpoints: make the write path stop where a crashed process would.

    >>> import bagstore, bagstore.testing, tempfile
    >>> ds = bagstore.open(tempfile.mkdtemp())
    >>> with bagstore.testing.failpoint("put.after_entity"):
    ...     try:
    ...         ds.put({"title": "half written"})
    ...     except bagstore.testing.SimulatedCrash:
    ...         print("crashed")
    crashed
    >>> ds.close()

A failpoint costs one set lookup when no failpoint is active.  Active failpoints
are process-wide (every thread hits them), as in TiKV's fail-rs.

``SimulatedCrash`` derives from ``BaseException``, not ``Exception``: clean-up
code that catches ``Exception`` does not run, just as it would not in a process
that died there.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["POINTS", "SimulatedCrash", "failpoint", "hit"]

#: Every named point of the write path.
POINTS = frozenset(
    {
        "put.before_entity",  # after unique claims, before the entity transaction
        "put.after_entity",  # entity committed, no index row changed yet
        "put.after_index_delete",  # stale index rows deleted, new ones not inserted
        "delete.after_entity",  # entity deleted, its index rows still there
        # bucket moves (bagstore.scaleout.Mover), one bucket's steps in order:
        "move.after_copy",  # target filled (INCOMING), source still serving
        "move.after_freeze",  # source frozen, target synced, placement not switched
        "move.after_placement",  # placement points at the target, phase still frozen
        "move.after_switch",  # switched, the source's copy not deleted yet
        "move.mid_delete",  # the source copy's entities deleted, its index rows not
    }
)

_active: set[str] = set()
_lock = threading.Lock()


class SimulatedCrash(BaseException):
    """Raised at an active failpoint: the process 'died' there."""


def hit(name: str) -> None:
    """Called by the write path at each point; raises if the point is active."""
    if _active and name in _active:
        raise SimulatedCrash(f"failpoint {name}")


@contextmanager
def failpoint(name: str) -> Iterator[None]:
    """Activate the failpoint ``name`` for the duration of the block."""
    if name not in POINTS:
        raise ValueError(f"unknown failpoint {name!r}; known: {sorted(POINTS)}")
    with _lock:
        _active.add(name)
    try:
        yield
    finally:
        with _lock:
            _active.discard(name)
