"""Logging helpers: progress lines for long work, at a pace an operator can read.

bagstore logs with the standard :mod:`logging` module, one logger per module
(``bagstore.cleaner``, ``bagstore.scaleout``, ``bagstore.datastore``...; the
cache under ``bagstore.cache``), and never prints.  The package logger has a
``NullHandler``: an application that configures no logging sees nothing.  INFO
is what an operator wants in a log (a backfill's start, checkpoints and end, a
bucket moved, a fenced write retried, a placement that changed, a shard marked
unavailable, a repair pass that changed something); DEBUG the rest.  Shard URLs
in messages are redacted (:func:`bagstore.backends.redact`).

:class:`ProgressLog` logs a long run's progress at most every ``every`` seconds
and at every tenth of the way, never once per batch::

    >>> import logging
    >>> progress = ProgressLog(logging.getLogger("bagstore.example"), "backfill of index_x", 1000)
    >>> progress.advance(100)  # logs "backfill of index_x: 100/1000 entities (10%), ..."
"""

from __future__ import annotations

import logging
import threading
import time

__all__ = ["ProgressLog", "rate"]


def rate(count: int, seconds: float) -> str:
    """``"1234/s"``: ``count`` per second over ``seconds`` (``"-"`` for no time)."""
    return f"{count / seconds:.0f}/s" if seconds > 0 else "-"


class ProgressLog:
    """INFO lines ``WHAT: done/total UNIT (p%), rate`` as work advances: one at
    each further tenth of ``total`` and at least every ``every`` seconds while
    work goes on (none more often than that).  Thread-safe."""

    def __init__(
        self,
        log: logging.Logger,
        what: str,
        total: int,
        *,
        unit: str = "entities",
        every: float = 30.0,
    ) -> None:
        self.log = log
        self.what = what
        self.total = total
        self.unit = unit
        self.every = every
        self.done = 0
        self._started = self._logged_at = time.monotonic()
        self._tenth = 0
        self._lock = threading.Lock()

    def advance(self, n: int) -> None:
        """Count ``n`` more; log a line when a tenth is crossed or ``every``
        seconds passed since the last line."""
        with self._lock:
            self.done += n
            now = time.monotonic()
            # tenths up to 90%: the end of the work is the caller's own line
            tenth = min(9, self.done * 10 // self.total) if self.total > 0 else 0
            if tenth <= self._tenth and now - self._logged_at < self.every:
                return
            self._tenth = max(tenth, self._tenth)
            self._logged_at = now
            done, elapsed = self.done, now - self._started
        if not self.log.isEnabledFor(logging.INFO):
            return
        share = f" ({100 * min(done, self.total) // self.total}%)" if self.total > 0 else ""
        self.log.info(
            "%s: %d/%d %s%s, %s", self.what, done, self.total, self.unit, share, rate(done, elapsed)
        )
