"""How many rows a statement that reads bodies asks for: at most a count,
and rows that take about :data:`BATCH_BYTES` at most, their size measured
from the rows read (large entities: a backfill's batch of 5,000 bodies of
8 MB would be 40 GB in one process)."""

from __future__ import annotations

__all__ = ["BATCH_BYTES", "SizedBatch"]

#: what the rows one statement reads may take, about
BATCH_BYTES = 32 * 2**20
#: rows asked before their size is known
FIRST = 10
#: what a row takes beyond its body (its id, its numbers, its tuple), about
OVERHEAD = 400


class SizedBatch:
    """The rows the next statement asks for: ``min(most, 10)`` first, then as
    many as fit in ``budget`` by the size of the rows last read, up to
    ``most``.

    >>> size = SizedBatch(5000)
    >>> size.rows
    10
    >>> size.read(10, 10 * 300)  # small rows: the whole count
    >>> size.rows
    5000
    >>> size.read(5000, 5000 * 2_000_000)  # 2 MB bodies: what fits in 32 MiB
    >>> size.rows
    16
    """

    __slots__ = ("budget", "most", "rows")

    def __init__(self, most: int, budget: int = BATCH_BYTES) -> None:
        self.most, self.budget = most, budget
        self.rows = max(1, min(most, FIRST))

    def read(self, rows: int, body_bytes: int) -> None:
        """``rows`` read, their bodies ``body_bytes`` long in all."""
        if rows:
            self.rows = max(1, min(self.most, self.budget // (body_bytes // rows + OVERHEAD)))
