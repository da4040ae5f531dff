"""The Cleaner's backfill: fill a new index from the entities already stored.

Every shard's entities are read in ``added_id`` order (shards in parallel), the
index rows built and written with multi-row inserts; a checkpoint per shard is
saved after its first batch and then once a second (and when it stops), so a
killed backfill resumes where it stopped, redoing at most a second of inserts
that leave existing rows alone; then the index is marked ``ready``.  Entities
written while it runs are indexed by their writers; after each batch the
backfill re-reads the stamps of the entities it just indexed and takes back
rows of any that changed meanwhile, so it never leaves a stale row of its own
behind.

Paced (``duty`` above 0, the default) a shard's batches run one after another,
each read, built and written under the server's gate, then a pause (see
:mod:`bagstore.cleaner`).  Flat out (``duty=0``), each shard's next batch is
read, decoded and built in another thread while the current one is written:
the database works on one batch while Python works on the next (SQLite and the
network both let go of the interpreter lock while they wait); batches are
larger (:data:`FLAT_OUT_BATCH` unless ``batch`` is given), and each one's rows
go in one transaction per shard that checks (and share-locks) the ownership of
their buckets once, then inserts them in plain multi-row statements as long as
the driver allows (``Backend.bulk_insert_index_rows``).

Used through :meth:`bagstore.Cleaner.backfill`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from bagstore import codec, keys
from bagstore.backends.indexsql import IndexRow
from bagstore.backends.pool import long_statements
from bagstore.errors import ConfigurationError
from bagstore.index import BUILDING, READY, Index
from bagstore.logs import ProgressLog, rate
from bagstore.owners import unfinished_moves
from bagstore.rowsize import SizedBatch
from bagstore.sharding.hashing import bucket_of

if TYPE_CHECKING:
    from bagstore.backends import Backend
    from bagstore.cleaner import Cleaner, CleanStats

__all__ = ["CHECKPOINT_EVERY", "FLAT_OUT_BATCH", "backfill"]

#: Seconds between a backfill worker's checkpoints (each one is a catalog write).
CHECKPOINT_EVERY = 1.0
#: Entities a flat-out backfill reads per batch unless told otherwise (the
#: paced default, 1,000, keeps each batch short for a live writer's sake).
FLAT_OUT_BATCH = 5000

Progress = Callable[[int, int], None]

log = logging.getLogger("bagstore.cleaner")


@dataclass
class Batch:
    """One batch read from a shard, its index rows built."""

    #: how many rows were read (those skipped too), and the last one's added_id
    count: int
    last: int
    #: their stamps when read (``Backend.scan_bodies``)
    stamps: str
    #: the encoded bodies of the entities indexed
    bodies: dict[bytes, bytes] = field(default_factory=dict)
    rows: list[IndexRow] = field(default_factory=list)


def parse_stamps(text: str) -> dict[bytes, tuple[int, int]]:
    """``{id: (added_id, updated)}`` from ``Backend.stamps_text``'s text."""
    out: dict[bytes, tuple[int, int]] = {}
    for part in text.split(",") if text else ():
        added_id, updated, entity_id = part.split(":")
        out[bytes.fromhex(entity_id)] = (int(added_id), int(updated))
    return out


def backfill(cleaner: Cleaner, table: str, progress: Progress | None) -> CleanStats:
    """The body of :meth:`bagstore.Cleaner.backfill`."""
    ds = cleaner.ds
    index, state = cleaner._index(table)
    if state not in (BUILDING, READY):
        raise ConfigurationError(f"index {table!r} is {state}: nothing to backfill")
    cleaner._stop.clear()
    started = time.monotonic()  # the settle wait counts in stats.seconds
    registered = ds.index_catalog.changed(table) or 0
    wait = registered / 1e6 + cleaner.settle - time.time()
    if wait > 0 and state == BUILDING:
        cleaner._stop.wait(wait)
    router = cleaner.router
    shards = range(len(router.backends))
    names = [cleaner._checkpoint_name(index, s) for s in shards]
    starts = [cleaner.checkpoints.get(n) or 0 for n in names]
    ends = router.on_all(lambda b: b.max_added_id(ds.kind))
    total = sum(max(0, e - s) for s, e in zip(starts, ends, strict=True))
    done = [0]
    lock = threading.Lock()
    what = f"backfill of index {table} (kind {ds.kind})"
    log.info(
        "%s: starting, about %d entities to read on %d shards%s",
        what,
        total,
        len(shards),
        " (resuming from checkpoints)" if any(starts) else "",
    )
    logged = ProgressLog(log, what, total)

    def advance(n: int) -> None:
        logged.advance(n)
        with lock:
            done[0] += n
            if progress is not None:
                progress(min(done[0], total), total)

    if progress is not None:
        progress(0, total)
    stats = cleaner._parallel(
        lambda s: ShardFill(cleaner, index, s, names[s], len(shards)).run(
            starts[s], ends[s], advance
        ),
        shards,
    )
    stats.seconds = time.monotonic() - started
    counts = (
        f"{stats.entities} entities read, {stats.written} rows written, {stats.removed} "
        f"taken back in {stats.seconds:.1f}s ({rate(stats.entities, stats.seconds)})"
    )
    if cleaner._stop.is_set():
        log.info("%s: stopped after %s; it resumes from its checkpoints", what, counts)
        return stats
    now = time.time_ns() // 1000
    ds.index_catalog.set_state(table, READY, now, expect=BUILDING)
    cleaner.checkpoints.clear(cleaner._checkpoint_name(index, None))
    ds.registry(refresh=True)
    log.info("%s: done, %s; the index is ready", what, counts)
    return stats


class ShardFill:
    """The backfill of one index from one shard's entities."""

    def __init__(
        self, cleaner: Cleaner, index: Index, shard: int, checkpoint: str, shards: int
    ) -> None:
        from bagstore.cleaner import CleanStats

        self.cleaner = cleaner
        self.kind = cleaner.ds.kind
        self.index = index
        self.shard = shard
        self.backend: Backend = cleaner.router.backends[shard]
        self.checkpoint = checkpoint
        self.throttle = cleaner._throttle(shards)
        self.flat_out = not cleaner.duty
        self.batch = cleaner.bulk_batch if self.flat_out else cleaner.batch
        #: rows a read asks for: fewer than the batch while the bodies are large
        self.size = SizedBatch(self.batch)
        self.stats = CleanStats()
        self.position = 0
        self.saved = (0, -CHECKPOINT_EVERY)  # position saved, and when

    def run(self, after: int, end: int, advance: Callable[[int], None]) -> CleanStats:
        """Fill the index from this shard's entities after ``after`` up to
        ``end``, the last ``added_id`` when the backfill started: every entity
        added later was written by a writer that already maintained the index,
        so chasing them would only keep a busy store's backfill from ever
        finishing."""
        self.position = after
        self.saved = (after, -CHECKPOINT_EVERY)
        stop = self.cleaner._stop
        try:
            if self.flat_out:
                self._pipelined(end, advance)
            else:
                while self.position < end and not stop.is_set():

                    def one() -> int | None:
                        batch = self.read(self.position)
                        return None if batch is None else self.write(batch, advance)

                    if self.cleaner._paced(self.backend, self.throttle, one) is None:
                        break
        finally:
            self.save(force=True)
        return self.stats

    def _pipelined(self, end: int, advance: Callable[[int], None]) -> None:
        """Write each batch while the next one is read and built in one of the
        router's threads (read here instead when none is free: a pool full of
        shard workers waiting for each other would never free one)."""
        stop = self.cleaner._stop
        pool = self.cleaner.router.pool()
        if self.position >= end or stop.is_set():
            return

        def ahead(after: int) -> Batch | None:
            with long_statements():
                return self.read(after)

        def take(future: Future[Batch | None], after: int) -> Batch | None:
            if future.cancel():  # not started: no thread was free
                return ahead(after)
            return future.result()

        pending = pool.submit(ahead, self.position)
        after = self.position
        try:
            while True:
                batch = take(pending, after)
                if batch is None:
                    return
                after = batch.last
                more = after < end and not stop.is_set()
                pending = pool.submit(ahead, after) if more else _done(None)
                t0 = time.monotonic()
                with long_statements():
                    n = self.write(batch, advance)
                stop.wait(self.throttle.pause_after(n, time.monotonic() - t0))
                if not more or stop.is_set():  # (a batch read ahead is not written)
                    return
        finally:
            if not pending.cancel():  # let a read in flight end before returning
                with contextlib.suppress(Exception):  # (an error this worker does not raise)
                    pending.result()

    def read(self, after: int) -> Batch | None:
        """The next batch after ``after``, its index rows built; None at the end."""
        scanned, stamps = self.backend.scan_bodies(
            self.kind, after, self.size.rows, packed=self.flat_out
        )
        if not scanned:
            return None
        self.size.read(len(scanned), sum(len(body) for _, body in scanned))
        cleaner = self.cleaner
        unseen = unfinished_moves(cleaner.router).ids_on(self.backend, self.shard, self.kind)
        buckets = cleaner.ds.placement.buckets
        index = self.index
        rows_of, decode = index.rows_or_none, codec.decode
        # One property (the common case): Index.rows_for's own fast path, inline.
        one = index.properties[0] if len(index.properties) == 1 else None
        limit, unique = keys.KEY_LIMIT, index.unique
        last = int(stamps.rsplit(",", 1)[-1].split(":", 1)[0])
        batch = Batch(len(scanned), last, stamps)
        bodies, rows = batch.bodies, batch.rows
        for entity_id, body in scanned:
            if entity_id in unseen:  # a copy that is not its bucket owner's
                continue
            bodies[entity_id] = body
            entity = decode(body)
            if one is not None and type(value := entity.get(one)) is not list:
                try:
                    key = keys.encode_value(value)
                except keys.UnindexableValue:
                    continue
                if not unique or len(key) <= limit:
                    rows.append(IndexRow((key[:limit],), entity_id, bucket_of(key, buckets)))
                continue
            rows += rows_of(entity, entity_id, buckets)
        return batch

    def write(self, batch: Batch, advance: Callable[[int], None]) -> int:
        """Insert a batch's rows, take back those of entities that changed
        since it was read, save the position; the entities read."""
        cleaner, index = self.cleaner, self.index
        self.stats.written += cleaner._insert(index, batch.rows, bulk=self.flat_out)
        now = self.backend.stamps_text(self.kind, self.position, batch.last, packed=self.flat_out)
        if now != batch.stamps:
            self.stats.removed += self._take_back(batch, parse_stamps(now))
        self.stats.entities += batch.count
        self.position = batch.last
        self.save(force=False)
        advance(batch.count)
        return batch.count

    def save(self, force: bool) -> None:
        now = time.monotonic()
        position, (saved, at) = self.position, self.saved
        if position != saved and (force or now - at >= CHECKPOINT_EVERY):
            self.cleaner.checkpoints.set(self.checkpoint, position)
            self.saved = (position, now)
            log.debug("checkpoint %s: added_id %d", self.checkpoint, position)

    def _take_back(self, batch: Batch, now: dict[bytes, tuple[int, int]]) -> int:
        """Delete rows just written for entities that changed since they were
        read (their writers may already have removed the old values' rows);
        ``now``: ``{id: (added_id, updated)}`` of the batch's range as it is
        after the insert."""
        read = parse_stamps(batch.stamps)
        changed = [i for i in batch.bodies if now.get(i) != read.get(i)]
        if not changed:
            return 0
        cleaner, index = self.cleaner, self.index
        buckets = cleaner.ds.placement.buckets
        current: dict[bytes, Any] = dict(self.backend.get_bodies(self.kind, changed))
        for moved in cleaner._found_elsewhere([i for i in changed if i not in current]).values():
            current.update(moved)
        stale: list[tuple[int, IndexRow]] = []
        for entity_id in changed:
            wrote = index.rows_or_none(codec.decode(batch.bodies[entity_id]), entity_id, buckets)
            hit = current.get(entity_id)
            keep = (
                index.rows_or_none(codec.decode(hit.body), entity_id, buckets)
                if hit is not None
                else set()
            )
            stale += [(cleaner._shard_of(r), r) for r in wrote - keep]
        return cleaner._delete(index, stale)


def _done(value: Batch | None) -> Future[Batch | None]:
    future: Future[Batch | None] = Future()
    future.set_result(value)
    return future
