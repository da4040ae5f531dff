"""The Cleaner: fills new indexes online and repairs what crashes leave behind.

    >>> import bagstore, tempfile
    >>> ds = bagstore.open(tempfile.mkdtemp())
    >>> _ = ds.put({"link": "http://example.com/"})
    >>> link_index = bagstore.Index(table="index_link", properties=["link"])
    >>> ds.add_index(link_index)
    'building'
    >>> bagstore.Cleaner(ds, settle=0).backfill("index_link").written  # one process: no settle
    1
    >>> ds.indexes()["index_link"][1]
    'ready'
    >>> ds.close()

*Backfill* (:mod:`bagstore.backfill`) scans every shard's entities in
``added_id`` order (shards in parallel), writes the missing rows with multi-row
inserts, and saves a checkpoint per shard after its first batch and then once
a second (and when it stops), so a killed backfill resumes where it stopped,
redoing at most a second of inserts that leave existing rows alone; then it
marks the index ``ready``.  Entities written while it runs are indexed by their
writers; after each batch the Cleaner re-reads the entities it just indexed and
takes back rows of any that changed meanwhile, so it never leaves a stale row
of its own behind.

*Repair* reconciles, for each entity (most recently updated first), the rows it
should have with the rows that point at it (found through the ``entity_id`` key
of every index table, on every shard): missing rows are written, stale ones
deleted, and entities that changed during the pass are reconciled again.  A
sweep over the index tables then removes rows whose entity no longer exists
(asking which exist, no body read) and unique rows whose entity no longer
holds the value (their bodies read).  A unique row goes
only when the claim rules let its value be taken over, and a bucket in an
unfinished move is read from its owner's copy only (see :mod:`bagstore.owners`).
``follow()`` repeats repair from the last time it saw, so what a crash left is
found again within seconds.

Throttling: with ``duty`` above 0, batches read from shards of one database
server run one at a time, each followed by a pause of ``duty`` times how long
it took, longer when statements slow down (the database is busy with live
traffic); the server's next batch waits for the pause.  So ``duty=1`` leaves
the server to live traffic at least half the time, however many of its shards
are being read.  (Each SQLite file is its own "server": SQLite writes files
side by side far faster than one after another.)  ``duty=0`` reads every shard
in parallel, flat out.  ``max_rate`` caps rows per second either way.
Smaller batches (``batch=100``) disturb a concurrent writer less than fewer,
larger ones; see docs/cleaner.md for measured trade-offs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from bagstore import codec
from bagstore.backends.base import Stored
from bagstore.backends.indexsql import IndexRow
from bagstore.backends.pool import long_statements
from bagstore.backfill import FLAT_OUT_BATCH
from bagstore.catalog import Checkpoints
from bagstore.check import iter_index_rows
from bagstore.errors import ConfigurationError
from bagstore.index import Index
from bagstore.owners import Moves, drop_dead_claims, unfinished_moves
from bagstore.rowsize import SizedBatch
from bagstore.throttle import Throttle, check_pacing, check_seconds

if TYPE_CHECKING:
    from bagstore.backends import Backend
    from bagstore.datastore import Datastore

__all__ = ["CleanStats", "Cleaner", "Throttle"]

Progress = Callable[[int, int], None]
#: Seconds between a backfill worker's checkpoints (each one is a catalog write).
CHECKPOINT_EVERY = 1.0

log = logging.getLogger(__name__)


@dataclass
class CleanStats:
    """What a Cleaner run did: index rows written and removed, entities read,
    and how long it took (every wait included, a backfill's settle too)."""

    written: int = 0
    removed: int = 0
    entities: int = 0
    seconds: float = 0.0

    def add(self, other: CleanStats) -> None:
        self.written += other.written
        self.removed += other.removed
        self.entities += other.entities

    def as_dict(self) -> dict[str, float]:
        return {
            "written": self.written,
            "removed": self.removed,
            "entities": self.entities,
            "seconds": round(self.seconds, 3),
        }


class Cleaner:
    """Backfill and repair for one datastore (one kind).

    ``batch``: entities read per statement (default 1,000; a flat-out
    backfill's, ``duty=0``, 5,000); ``max_rate``: rows per second per
    run (None: adaptive only); ``duty``: see :class:`Throttle`; ``settle``:
    seconds after an index is registered before its backfill starts reading
    (default ``refresh_interval`` + 1, so that every writer maintains it by
    then; 0 when no other process writes).
    """

    def __init__(
        self,
        datastore: Datastore,
        *,
        batch: int | None = None,
        max_rate: float | None = None,
        duty: float = 0.5,
        settle: float | None = None,
    ) -> None:
        check_pacing(FLAT_OUT_BATCH if batch is None else batch, duty, max_rate)
        if settle is not None:
            check_seconds("settle", settle)
        self.ds = datastore
        #: where rows go and the retries on a moved bucket (bagstore.sharding.router)
        self.router = datastore.router
        self.batch = 1000 if batch is None else batch
        #: entities a flat-out (duty=0) backfill reads per batch
        self.bulk_batch = FLAT_OUT_BATCH if batch is None else batch
        self.max_rate = max_rate
        self.duty = duty
        # Writers learn of a new index within refresh_interval: a backfill that
        # read an entity before every writer maintained the index could miss a
        # later change by a writer that did not know it yet.
        self.settle = datastore.router.refresh_interval + 1.0 if settle is None else settle
        self.checkpoints = Checkpoints(datastore.router.catalog_backend)
        self._stop = threading.Event()
        self._gates: dict[str, threading.Lock] = {}
        self._gates_lock = threading.Lock()
        #: copies that unfinished bucket moves hide (see bagstore.owners), as
        #: last read: repair neither reads nor deletes them
        self._moves = Moves()

    def stop(self) -> None:
        """Ask a running backfill or follow() to stop after its current batch."""
        self._stop.set()

    # -- helpers -----------------------------------------------------------------
    @property
    def _buckets(self) -> int:
        return self.ds.placement.buckets

    def _shard_of(self, row: IndexRow) -> int:
        return self.ds.placement.shard_of_bucket[row.bucket]

    def _throttle(self, shards: int) -> Throttle:
        rate = self.max_rate / shards if self.max_rate else None
        return Throttle(max_rate=rate, duty=self.duty)

    def _gate(self, backend: Backend) -> AbstractContextManager[Any]:
        """What a worker holds for a batch on ``backend`` and the pause after
        it: with ``duty`` above 0, one lock per database server (per SQLite
        file); with ``duty=0``, nothing."""
        if not self.duty:
            return nullcontext()
        key = backend.server or backend.name
        with self._gates_lock:
            return self._gates.setdefault(key, threading.Lock())

    def _paced(
        self, backend: Backend, throttle: Throttle, batch: Callable[[], int | None]
    ) -> int | None:
        """Run ``batch`` (it returns the rows it handled, None when there were
        none) holding the server's gate, then pause as the throttle says, still
        holding it: the server's next batch starts after the pause."""
        with self._gate(backend):
            t0 = time.monotonic()
            with long_statements():  # bulk_timeout, not read_timeout
                rows = batch()
            if rows is not None:
                self._stop.wait(throttle.pause_after(rows, time.monotonic() - t0))
            return rows

    def _parallel(self, fn: Callable[[int], CleanStats], shards: Iterable[int]) -> CleanStats:
        """Run ``fn`` per shard in threads; Ctrl-C stops them after their batch."""
        pool = self.router.pool()
        futures: list[Future[CleanStats]] = [pool.submit(fn, s) for s in shards]
        try:
            while True:
                done, pending = wait(futures, timeout=0.2, return_when=FIRST_EXCEPTION)
                if not pending or any(f.exception() for f in done):
                    break
        except KeyboardInterrupt:
            self._stop.set()
            wait(futures)
            raise
        total = CleanStats()
        for f in futures:
            total.add(f.result())
        return total

    def _index(self, table: str) -> tuple[Index, str]:
        entry = self.ds.registry(refresh=True).by_table.get(table)
        if entry is None:
            raise ConfigurationError(f"no index {table!r} on kind {self.ds.kind!r}")
        return entry

    def _insert(self, index: Index, rows: Iterable[IndexRow], *, bulk: bool = False) -> int:
        """Write rows on the shards that own their buckets (fenced, like writers;
        ``bulk``: one transaction per shard, see ``bulk_insert_index_rows``)."""
        claimed = time.time_ns() // 1000 if index.unique else None

        def on(backend: Backend, part: list[IndexRow]) -> int:
            if bulk:
                n = backend.bulk_insert_index_rows(
                    index.table, index.properties, part, claimed=claimed
                )
            else:
                n = backend.insert_index_rows(
                    index.table, index.properties, part, claimed=claimed, fenced=True
                )
            backend.after_bulk_step()
            return n

        rows = list(rows)
        written = sum(self.router.by_bucket(rows, lambda r: r.bucket, on))
        self.ds.cache_layer.rows_repaired(index, rows, self.ds.registry())
        return written

    def _rows_of(self, index: Index, ids: Sequence[bytes]) -> list[tuple[int, IndexRow]]:
        """``(shard, row)`` of every row, on any shard, pointing at one of ``ids``."""

        def on(backend: Backend) -> list[IndexRow]:
            return backend.rows_of_entities(index.table, index.properties, ids)

        found = self.router.on_all(on)
        moves = self._moves
        return [
            (s, r) for s, part in enumerate(found) for r in part if not moves.hides(s, r.bucket)
        ]

    def _delete(self, index: Index, rows: Iterable[tuple[int, IndexRow]]) -> int:
        grouped: dict[int, list[IndexRow]] = defaultdict(list)
        for shard, row in rows:
            grouped[shard].append(row)
        removed = sum(
            self.router.backends[s].delete_index_rows(index.table, index.properties, part)
            for s, part in grouped.items()
        )
        self.ds.cache_layer.rows_repaired(
            index, [r for part in grouped.values() for r in part], self.ds.registry()
        )
        return removed

    # -- backfill ------------------------------------------------------------------
    def backfill(self, table: str, *, progress: Progress | None = None) -> CleanStats:
        """Fill a building index from the existing entities, then mark it ready
        (see :mod:`bagstore.backfill`).

        Resumes from the checkpoints a killed run left.  Running it on a ready
        index is harmless (it writes only rows that are missing).
        """
        from bagstore.backfill import backfill

        return backfill(self, table, progress)

    def _checkpoint_name(self, index: Index, shard: int | None) -> str:
        base = f"backfill:{self.ds.kind}:{index.table}:"
        return base if shard is None else f"{base}{shard}"

    # -- repair --------------------------------------------------------------------
    def repair(
        self, since: int | None = None, *, sweep: bool = True, progress: Progress | None = None
    ) -> CleanStats:
        """One pass over every building or ready index: write missing rows, delete
        stale ones, most recently updated entities first.

        ``since`` (microseconds since the epoch) limits the pass to entities
        updated since then; ``sweep`` also removes rows whose entity is gone
        (a scan of every index table); ``progress(done, total)`` is called
        after each batch (``total``: the kind's entities when the pass began).
        """
        started = time.monotonic()
        indexes = self.ds.registry(refresh=True).maintained()
        self.ds.refresh_placement(force=True)  # a stale owner would make live rows look stale
        stats = CleanStats()
        if indexes:
            shards = range(len(self.router.backends))
            total = self.ds.count() if progress is not None else 0
            done, lock = [0], threading.Lock()

            def advance(n: int) -> None:
                with lock:
                    done[0] += n
                    if progress is not None:
                        progress(done[0], max(total, done[0]))

            stats = self._parallel(
                lambda s: self._repair_shard(indexes, s, since, len(shards), advance), shards
            )
            if sweep:
                for index in indexes:
                    stats.removed += self._sweep(index)
        stats.seconds = time.monotonic() - started
        # INFO when the pass changed something (follow() runs a pass a second)
        log.log(
            logging.INFO if stats.written or stats.removed else logging.DEBUG,
            "repair pass (kind %s%s): %d entities read, %d rows written, %d removed in %.1fs",
            self.ds.kind,
            "" if since is None else f", updated since {since}",
            stats.entities,
            stats.written,
            stats.removed,
            stats.seconds,
        )
        return stats

    def _repair_shard(
        self,
        indexes: Sequence[Index],
        shard: int,
        since: int | None,
        shards: int,
        advance: Callable[[int], None],
    ) -> CleanStats:
        backend = self.router.backends[shard]
        throttle = self._throttle(shards)
        stats = CleanStats()
        position: list[tuple[int, int] | None] = [None]
        size = SizedBatch(self.batch)  # fewer rows a read while the bodies are large

        def one_batch() -> int | None:
            batch = backend.scan_recent(self.ds.kind, position[0], since, size.rows)
            if not batch:
                return None
            size.read(len(batch), sum(len(r[2]) for r in batch))
            # A bucket in an unfinished move is reconciled from its owner's copy only.
            self._moves = seen = unfinished_moves(self.router)
            unseen = seen.ids_on(backend, shard, self.ds.kind)
            bodies = {i: (body, updated) for _, i, body, updated in batch if i not in unseen}
            written, removed = self._reconcile(indexes, backend, bodies, seen=seen)
            stats.written += written
            stats.removed += removed
            stats.entities += len(batch)
            position[0] = (batch[-1][3], batch[-1][0])
            advance(len(batch))
            return len(batch)

        while not self._stop.is_set():
            if self._paced(backend, throttle, one_batch) is None:
                break
        return stats

    def _reconcile(
        self,
        indexes: Sequence[Index],
        backend: Backend,
        bodies: dict[bytes, tuple[bytes, int]],
        depth: int = 0,
        seen: Moves | None = None,
    ) -> tuple[int, int]:
        """Make the rows of these entities (on ``backend``) match their bodies."""
        ids = list(bodies)
        decoded = {i: codec.decode(b) for i, (b, _) in bodies.items()}
        written = removed = 0
        for index in indexes:
            expected: set[tuple[int, IndexRow]] = set()
            for entity_id, entity in decoded.items():
                for row in index.rows_or_none(entity, entity_id, self._buckets):
                    expected.add((self._shard_of(row), row))
            actual = set(self._rows_of(index, ids))
            written += self._insert(index, (r for _, r in expected - actual))
            if index.unique:  # a claim goes only as the claim rules allow
                stored = {i: Stored(b, 0, u) for i, (b, u) in bodies.items()}
                removed += self._drop_claims(index, actual - expected, stored)
            else:
                removed += self._delete(index, actual - expected)
        # Entities that changed meanwhile: reconcile them again from their new body.
        now = backend.versions(self.ds.kind, ids)
        left = self._left_behind(backend, ids, seen) if seen is not None else set()
        changed = [i for i in ids if i not in now or now[i][1] != bodies[i][1] or i in left]
        if changed and depth < 3:
            current = backend.get_bodies(self.ds.kind, [i for i in changed if i not in left])
            again = {i: (s.body, s.updated) for i, s in current.items()}
            w, r = self._reconcile(indexes, backend, again, depth + 1) if again else (0, 0)
            written, removed = written + w, removed + r
            missing = [i for i in changed if i not in current]
            moved = self._found_elsewhere(missing)
            for shard, found in moved.items():
                if shard < 0:  # found, its bucket unknown here: its shard's pass will do
                    continue
                bodies_there = {i: (s.body, s.updated) for i, s in found.items()}
                w, r = self._reconcile(
                    indexes, self.router.backends[shard], bodies_there, depth + 1
                )
                written, removed = written + w, removed + r
            elsewhere = {i for found in moved.values() for i in found}
            removed += self._remove_rows_of(indexes, [i for i in missing if i not in elsewhere])
        return written, removed

    def _found_elsewhere(self, ids: Sequence[bytes]) -> dict[int, dict[bytes, Stored]]:
        """Entities missing from the shard a batch was read from: deleted, or their
        bucket moved to another shard since.  ``{shard: {id: Stored}}`` of those
        found where the placement (read afresh) puts them now; the rest are gone.
        (A mover keeps the source copy for ``grace`` seconds after the switch,
        so that readers with a placement that old still find it; a batch can be
        older than that.)"""
        if not ids:
            return {}
        ds = self.ds
        ds.refresh_placement(force=True)
        found = ds.fetch_many(ids)
        where = ds.placer.locate(list(found))
        out: dict[int, dict[bytes, Stored]] = {}
        for entity_id, stored in found.items():
            bucket = where.get(entity_id)
            shard = self.router.topology.shard_of_bucket[bucket] if bucket is not None else -1
            out.setdefault(shard, {})[entity_id] = stored
        return out

    def _drop_claims(
        self, index: Index, rows: Iterable[tuple[int, IndexRow]], stored: dict[bytes, Stored]
    ) -> int:
        """Delete the unique rows among ``rows`` whose claims are dead (see
        :func:`bagstore.owners.drop_dead_claims`)."""
        removed, tried = drop_dead_claims(
            self.router, self.ds.indexer.lease_us, index, rows, stored
        )
        if tried:
            self.ds.cache_layer.rows_repaired(index, tried, self.ds.registry())
        return removed

    def _left_behind(self, backend: Backend, ids: Sequence[bytes], seen: Moves) -> set[bytes]:
        """Ids of a batch whose bucket's copy on ``backend`` stopped being the
        owner's while the batch was reconciled (a move switched): reconciled
        again from the owner's body (``seen``: the moves when the batch was read)."""
        shard = self.router.backends.index(backend)
        self._moves = later = unfinished_moves(self.router)
        new = later.hidden.get(shard, frozenset()) - seen.hidden.get(shard, frozenset())
        if not new:
            return set()
        return set(ids) & Moves({shard: new}).ids_on(backend, shard, self.ds.kind)

    def _remove_rows_of(self, indexes: Sequence[Index], ids: Sequence[bytes]) -> int:
        """Delete every row of entities that no longer exist."""
        if not ids:
            return 0
        removed = 0
        for index in indexes:
            rows = self._rows_of(index, ids)
            if index.unique:
                removed += self._drop_claims(index, rows, {})
            else:
                removed += self._delete(index, rows)
        return removed

    def _sweep(self, index: Index) -> int:
        """Remove rows whose entity does not exist (left by a crash in delete);
        of a unique index, also rows whose entity no longer holds the value.

        A unique row goes only when the claim rules would let another entity
        take it over (:func:`bagstore.owners.claim_is_dead`): a claim is written
        before its entity, so a row without its entity may be a write in flight
        until the lease runs out.  Copies hidden by unfinished moves are left
        to the mover.
        """
        removed = 0
        self._moves = unfinished_moves(self.router)
        size = SizedBatch(self.batch)  # the entities a page fetches: fewer while large
        for shard, backend in enumerate(self.router.backends):
            page: list[tuple[bytes, ...]] = []
            for row in iter_index_rows(backend, index):
                page.append(row)
                if len(page) >= size.rows:
                    removed += self._sweep_page(index, shard, page, size)
                    page = []
            removed += self._sweep_page(index, shard, page, size)
        return removed

    def _sweep_page(
        self, index: Index, shard: int, rows: list[tuple[bytes, ...]], size: SizedBatch
    ) -> int:
        if not rows:
            return 0
        ids = list(dict.fromkeys(r[-1] for r in rows))
        present: dict[bytes, Stored] = {}
        if index.unique:  # (whether each entity still holds its value: its body)
            present = self.ds.fetch_many(ids)
            size.read(len(present), sum(len(s.body) for s in present.values()))
            gone = ids
        else:  # which entities exist: no body read, nor a page cut to the bodies' size
            exists = self.ds.existing(ids)
            size.read(len(ids), 0)
            gone = [i for i in ids if i not in exists]
        if not gone:
            return 0
        backend, moves = self.router.backends[shard], self._moves
        orphans = [
            r
            for r in backend.rows_of_entities(index.table, index.properties, gone)
            if not moves.hides(shard, r.bucket)
        ]
        if index.unique:
            return self._drop_claims(index, [(shard, r) for r in orphans], present)
        return backend.delete_index_rows(index.table, index.properties, orphans)

    def prune_changes(self) -> int:
        """Delete the change feed's changes that retention allows (every kind;
        :mod:`bagstore.retention`); the number deleted."""
        from bagstore.retention import prune_changes

        return prune_changes(self.ds.feed)

    def follow(
        self,
        *,
        interval: float = 1.0,
        margin: float = 10.0,
        sweep_every: int = 30,
        passes: int | None = None,
        on_pass: Callable[[CleanStats], Any] | None = None,
    ) -> CleanStats:
        """Repair forever (or ``passes`` times): each pass covers entities updated
        since the previous pass began, less ``margin`` seconds for writes in
        flight and clock skew; every ``sweep_every`` passes also sweeps for rows
        of deleted entities and prunes the change feed (:meth:`prune_changes`).
        ``stop()`` or Ctrl-C ends it."""
        check_seconds("interval", interval, 0.001)
        check_seconds("margin", margin)
        if type(sweep_every) is not int or sweep_every < 1:
            raise ConfigurationError(f"sweep_every must be a positive integer, not {sweep_every!r}")
        self._stop.clear()
        total = CleanStats()
        since: int | None = None
        n = 0
        while not self._stop.is_set() and (passes is None or n < passes):
            began = time.time_ns() // 1000
            stats = self.repair(since, sweep=n % sweep_every == 0)
            if n % sweep_every == 0:
                self.prune_changes()  # the change feed's retention (docs/changes.md)
            total.add(stats)
            if on_pass is not None:
                on_pass(stats)
            since = began - int(margin * 1_000_000)
            n += 1
            if passes is None or n < passes:
                self._stop.wait(interval)
        return total
