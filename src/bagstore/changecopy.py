"""Copying a bucket's change rows to another shard (a bucket move,
:mod:`bagstore.scaleout`)."""

from __future__ import annotations

import time
from collections.abc import Callable

from bagstore.backends import Backend
from bagstore.backends import changesql as sql
from bagstore.rowsize import SizedBatch

__all__ = ["sync_bucket_changes"]

# -- bucket moves (bagstore.scaleout.Mover) ------------------------------------------
#: what the change rows a move reads at a time may take in memory, about
_COPY_BYTES = 8 * 2**20


def sync_bucket_changes(
    src: Backend,
    dst: Backend,
    bucket: int,
    step: int,
    after_step: Callable[[int, float], None] | None = None,
) -> int:
    """Copy a bucket's change rows that ``dst`` lacks, up to ``step`` rows per
    statement (fewer while the rows are large: ~:data:`_COPY_BYTES` a
    statement), then its position rows: change rows are never rewritten, so
    those above ``dst``'s highest are all it lacks.  Rows at or below the
    source's ``pruned`` mark are going (:mod:`bagstore.retention` marks
    before it deletes): not copied, and those an earlier sync copied before
    they were marked are deleted from ``dst``.  ``after_step(rows,
    started)`` after each statement (the mover's pacing).  Returns rows copied."""
    copied = 0
    have = sql.bucket_change_tops(dst, bucket)
    tops = sql.bucket_positions(src, bucket)
    size = SizedBatch(step, _COPY_BYTES)
    for kind, (top, pruned) in tops.items():
        after = max(have.get(kind, 0), pruned)
        while after < top:
            started = time.monotonic()
            rows = sql.bucket_change_rows(src, kind, bucket, after, size.rows)
            if not rows:
                break
            sql.copy_change_rows(dst, rows)
            copied += len(rows)
            after = rows[-1].pos
            size.read(len(rows), sum(len(r.body or b"") for r in rows))
            if after_step is not None:
                after_step(len(rows), started)
    sql.set_positions(dst, bucket, tops)
    for kind, (_, pruned) in tops.items():
        sql.delete_marked(dst, kind, bucket, pruned, step)
    return copied
