"""Pacing of bulk work (the Cleaner's backfill and repair, the Mover's copies):
:class:`Throttle` and :func:`check_pacing`; and :func:`check_seconds`, the
check of every option given in seconds (waits, leases, intervals)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from bagstore.errors import ConfigurationError

__all__ = ["Throttle", "check_pacing", "check_seconds"]


@dataclass
class Throttle:
    """Adaptive pauses between batches (one per worker thread).

    ``duty``: pause this fraction of each batch's duration at least.  When the
    time per row, smoothed over the last few batches, rises over three times its
    usual value, the database is busy: the pause doubles (up to ``max_pause``);
    it shrinks back as batches speed up.  The usual value drops to any new low
    at once and follows rises slowly (1% of the difference a batch), so that
    inserts growing slower with the size of the tables over a long backfill are
    not taken for a busy database, while live traffic that suddenly slows the
    batches down is.  (Smoothed, because one slow batch is usually a thread
    waiting for the interpreter lock or the CPU, not a busy database.)
    ``max_rate`` caps rows per second.  ``adaptive=False`` leaves out the
    per-row backoff, for work whose steps vary in size (a bucket move's last
    step of a bucket may hold a few rows, whose time per row says nothing about
    the database).
    """

    max_rate: float | None = None
    duty: float = 0.5
    max_pause: float = 1.0
    adaptive: bool = True
    usual: float | None = None
    smooth: float | None = None
    extra: float = 0.0
    started: float = field(default_factory=time.monotonic)
    rows: int = 0

    def pause_after(self, rows: int, seconds: float) -> float:
        """The pause owed after a batch of ``rows`` that took ``seconds``."""
        self.rows += rows
        if rows and self.adaptive:
            per_row = seconds / rows
            smooth = per_row if self.smooth is None else 0.75 * self.smooth + 0.25 * per_row
            usual = smooth if self.usual is None else self.usual
            self.usual = min(smooth, usual + 0.01 * (smooth - usual))
            self.smooth = smooth
            if smooth > 3 * self.usual:
                self.extra = min(self.max_pause, max(2 * self.extra, seconds))
            else:
                self.extra /= 2
        pause = seconds * self.duty + self.extra
        if self.max_rate:
            ahead = self.rows / self.max_rate - (time.monotonic() - self.started)
            pause = max(pause, ahead)
        return min(pause, self.max_pause) if not self.max_rate else pause


def check_pacing(batch: int, duty: float, max_rate: float | None) -> None:
    """Raise ConfigurationError unless these are valid settings of bulk work
    (the Cleaner's, the Mover's): ``batch`` rows a step, ``duty`` and
    ``max_rate`` as :class:`Throttle` takes them."""
    if not isinstance(batch, int) or isinstance(batch, bool) or not 1 <= batch <= 10_000:
        raise ConfigurationError(f"batch must be from 1 to 10000, not {batch!r}")
    if not isinstance(duty, int | float) or isinstance(duty, bool) or not 0 <= duty <= 10:
        raise ConfigurationError(f"duty must be a number from 0 to 10, not {duty!r}")
    if max_rate is not None and (
        not isinstance(max_rate, int | float)
        or isinstance(max_rate, bool)
        or not 0 < max_rate < math.inf  # (not NaN either)
    ):
        raise ConfigurationError(f"max_rate must be a positive number, not {max_rate!r}")


def check_seconds(name: str, value: object, least: float = 0.0, most: float = 86_400.0) -> float:
    """``value`` as a number of seconds from ``least`` to ``most``: a
    ConfigurationError naming ``name`` for anything else (NaN, infinities,
    bools and text included)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not least <= value <= most:
        raise ConfigurationError(
            f"{name} must be a number of seconds from {least:g} to {most:g}, not {value!r}"
        )
    return float(value)
