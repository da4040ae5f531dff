"""Entity versions that never go back.

An entity's version is what a conditional write (``expect_version``), the
cache's markers and a change feed compare, so it must grow for an id over
its whole life: across a delete and a re-create, a bucket move, a key
migration and a failover to a copy that missed the last writes.  A counter
kept in the row cannot do that (a deleted row's counter is gone), so a write
gives the row

    ``max(version read + 1, clock())``

where :func:`clock` is the time in microseconds since the Unix epoch, never
smaller than what it returned before in this process.  The version read is
the row's own, read under its lock in the writing transaction, and the clock
is read after that lock is held: an entity deleted and written again gets a
version above every version it had (each was at most its write's clock, or
one more than the version before, and each of those writes committed before
this one's clock was read), as long as the clocks of the machines writing it
do not disagree by more than the time between the two writes (keep them
synchronized with NTP; the same assumption as the unique claims', see
docs/consistency.md).  Where one statement does the whole write (a put of one
entity with nothing else in its transaction), the clock is read by the
statement itself once the row is locked: on SQLite this process's
:func:`clock`, on MariaDB the server's (``SYSDATE(6)``), which NTP keeps
with the others.  Copies made by a bucket move or a key migration keep
their version.

    >>> from bagstore.versions import clock, next_version
    >>> now = clock()
    >>> next_version(None) >= now and next_version(now + 10**9) == now + 10**9 + 1
    True
"""

from __future__ import annotations

import threading
import time

__all__ = ["clock", "next_version"]

_lock = threading.Lock()
_last = 0


def clock() -> int:
    """Microseconds since the Unix epoch, never below a value returned before."""
    global _last
    now = time.time_ns() // 1000
    with _lock:
        if now < _last:
            now = _last
        _last = now
    return now


def next_version(found: int | None, now: int | None = None) -> int:
    """The version a write gives a row whose version was ``found`` (None: no
    row); read the clock only once the row is locked (``now``: the clock
    read once for a transaction's rows, after their locks)."""
    if now is None:
        now = clock()
    return now if found is None or found < now else found + 1
