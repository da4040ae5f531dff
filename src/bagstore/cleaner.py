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

*Backfill* scans every shard's entities in ``added_id`` order (shards in
parallel), writes the missing rows with multi-row inserts, and saves a
checkpoint per shard after its first batch and then once a second (and when it
stops), so a killed backfill resumes where it stopped, redoing at most a second
of inserts that leave existing rows alone; then it marks the index ``ready``.
Entities written while it runs are indexed by their writers; after each batch
the Cleaner re-reads the entities it just indexed and takes back rows of any
that changed meanwhile, so it never leaves a stale row of its own behind.

*Repair* reconciles, for each entity (most recently updated first), the rows it
should have with the rows that point at it (found through the ``entity_id`` key
of every index table, on every shard): missing rows are written, stale ones
deleted, and entities that changed during the pass are reconciled again.  A
sweep over the index tables then removes rows whose entity no longer exists.
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

import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from bagstore import codec
from bagstore.backends.indexsql import IndexRow
from bagstore.catalog import Checkpoints
from bagstore.check import iter_index_rows
from bagstore.errors import ConfigurationError
from bagstore.index import BUILDING, READY, Index

if TYPE_CHECKING:
    from bagstore.backends import Backend
    from bagstore.backends.base import Stored
    from bagstore.datastore import Datastore

__all__ = ["CleanStats", "Cleaner", "Throttle"]

Progress = Callable[[int, int], None]
#: Seconds between a backfill worker's checkpoints (each one is a catalog write).
CHECKPOINT_EVERY = 1.0


@dataclass
class CleanStats:
    """What a Cleaner run did: index rows written and removed, entities read."""

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
        not isinstance(max_rate, int | float) or isinstance(max_rate, bool) or max_rate <= 0
    ):
        raise ConfigurationError(f"max_rate must be a positive number, not {max_rate!r}")


class Cleaner:
    """Backfill and repair for one datastore (one kind).

    ``batch``: entities read per statement; ``max_rate``: rows per second per
    run (None: adaptive only); ``duty``: see :class:`Throttle`; ``settle``:
    seconds after an index is registered before its backfill starts reading
    (default ``refresh_interval`` + 1, so that every writer maintains it by
    then; 0 when no other process writes).
    """

    def __init__(
        self,
        datastore: Datastore,
        *,
        batch: int = 1000,
        max_rate: float | None = None,
        duty: float = 0.5,
        settle: float | None = None,
    ) -> None:
        check_pacing(batch, duty, max_rate)
        self.ds = datastore
        self.batch = batch
        self.max_rate = max_rate
        self.duty = duty
        # Writers learn of a new index within refresh_interval: a backfill that
        # read an entity before every writer maintained the index could miss a
        # later change by a writer that did not know it yet.
        self.settle = datastore._refresh_interval + 1.0 if settle is None else settle
        self.checkpoints = Checkpoints(datastore._catalog_backend)
        self._stop = threading.Event()
        self._gates: dict[str, threading.Lock] = {}
        self._gates_lock = threading.Lock()

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
            rows = batch()
            if rows is not None:
                self._stop.wait(throttle.pause_after(rows, time.monotonic() - t0))
            return rows

    def _parallel(self, fn: Callable[[int], CleanStats], shards: Iterable[int]) -> CleanStats:
        """Run ``fn`` per shard in threads; Ctrl-C stops them after their batch."""
        pool = self.ds._pool()
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

    def _insert(self, index: Index, rows: Iterable[IndexRow]) -> int:
        """Write rows on the shards that own their buckets (fenced, like writers)."""
        claimed = time.time_ns() // 1000 if index.unique else None

        def on(backend: Backend, part: list[IndexRow]) -> int:
            n = backend.insert_index_rows(
                index.table, index.properties, part, claimed=claimed, fenced=True
            )
            backend.after_bulk_step()
            return n

        rows = list(rows)
        written = sum(self.ds._route(rows, lambda r: r.bucket, on))
        self.ds._cache.rows_repaired(index, rows, self.ds.registry())
        return written

    def _rows_of(self, index: Index, ids: Sequence[bytes]) -> list[tuple[int, IndexRow]]:
        """``(shard, row)`` of every row, on any shard, pointing at one of ``ids``."""

        def on(backend: Backend) -> list[IndexRow]:
            return backend.rows_of_entities(index.table, index.properties, ids)

        found = self.ds._map(on, self.ds._backends)
        return [(s, r) for s, rows in enumerate(found) for r in rows]

    def _delete(self, index: Index, rows: Iterable[tuple[int, IndexRow]]) -> int:
        grouped: dict[int, list[IndexRow]] = defaultdict(list)
        for shard, row in rows:
            grouped[shard].append(row)
        removed = sum(
            self.ds._backends[s].delete_index_rows(index.table, index.properties, part)
            for s, part in grouped.items()
        )
        self.ds._cache.rows_repaired(
            index, [r for part in grouped.values() for r in part], self.ds.registry()
        )
        return removed

    # -- backfill ------------------------------------------------------------------
    def backfill(self, table: str, *, progress: Progress | None = None) -> CleanStats:
        """Fill a building index from the existing entities, then mark it ready.

        Resumes from the checkpoints a killed run left.  Running it on a ready
        index is harmless (it writes only rows that are missing).
        """
        index, state = self._index(table)
        if state not in (BUILDING, READY):
            raise ConfigurationError(f"index {table!r} is {state}: nothing to backfill")
        self._stop.clear()
        registered = self.ds._index_catalog.changed(table) or 0
        wait = registered / 1e6 + self.settle - time.time()
        if wait > 0 and state == BUILDING:
            self._stop.wait(wait)
        started = time.monotonic()
        shards = range(len(self.ds._backends))
        names = [self._checkpoint_name(index, s) for s in shards]
        starts = [self.checkpoints.get(n) or 0 for n in names]
        ends = self.ds._map(lambda b: b.max_added_id(self.ds.kind), self.ds._backends)
        total = sum(max(0, e - s) for s, e in zip(starts, ends, strict=True))
        done = [0]
        lock = threading.Lock()

        def advance(n: int) -> None:
            with lock:
                done[0] += n
                if progress is not None:
                    progress(min(done[0], total), total)

        if progress is not None:
            progress(0, total)
        stats = self._parallel(
            lambda s: self._backfill_shard(
                index, s, names[s], starts[s], ends[s], advance, len(shards)
            ),
            shards,
        )
        stats.seconds = time.monotonic() - started
        if self._stop.is_set():
            return stats
        now = time.time_ns() // 1000
        self.ds._index_catalog.set_state(table, READY, now, expect=BUILDING)
        self.checkpoints.clear(self._checkpoint_name(index, None))
        self.ds.registry(refresh=True)
        return stats

    def _checkpoint_name(self, index: Index, shard: int | None) -> str:
        base = f"backfill:{self.ds.kind}:{index.table}:"
        return base if shard is None else f"{base}{shard}"

    def _backfill_shard(
        self,
        index: Index,
        shard: int,
        checkpoint: str,
        after: int,
        end: int,
        advance: Callable[[int], None],
        shards: int,
    ) -> CleanStats:
        """Fill the index from one shard's entities up to ``end``, the last
        ``added_id`` when the backfill started: every entity added later was
        written by a writer that already maintained the index, so chasing them
        would only keep a busy store's backfill from ever finishing."""
        backend = self.ds._backends[shard]
        throttle = self._throttle(shards)
        stats = CleanStats()
        position = [after]
        saved = [after, -CHECKPOINT_EVERY]  # position saved, and when

        def save(force: bool) -> None:
            now = time.monotonic()
            if position[0] != saved[0] and (force or now - saved[1] >= CHECKPOINT_EVERY):
                self.checkpoints.set(checkpoint, position[0])
                saved[:] = [position[0], now]

        def one_batch() -> int | None:
            after = position[0]
            batch = backend.scan_entities(self.ds.kind, after, self.batch)
            if not batch:
                return None
            wanted: dict[bytes, set[IndexRow]] = {}
            stamp: dict[bytes, int] = {}
            for _, entity_id, body, updated in batch:
                wanted[entity_id] = index.rows_or_none(codec.decode(body), entity_id, self._buckets)
                stamp[entity_id] = updated
            stats.written += self._insert(index, (r for rows in wanted.values() for r in rows))
            now = backend.stamps_between(self.ds.kind, after, batch[-1][0])
            stats.removed += self._take_back(index, backend, wanted, stamp, now)
            stats.entities += len(batch)
            position[0] = batch[-1][0]
            save(force=False)
            advance(len(batch))
            return len(batch)

        try:
            while position[0] < end and not self._stop.is_set():
                if self._paced(backend, throttle, one_batch) is None:
                    break
        finally:
            save(force=True)
        return stats

    def _take_back(
        self,
        index: Index,
        backend: Backend,
        wanted: dict[bytes, set[IndexRow]],
        stamp: dict[bytes, int],
        now: dict[bytes, int],
    ) -> int:
        """Delete rows just written for entities that changed since they were read
        (their writers may already have removed the old values' rows); ``now``:
        ``{id: updated}`` of the batch's rows as they are after the insert."""
        changed = [i for i in wanted if now.get(i) != stamp[i]]
        if not changed:
            return 0
        current: dict[bytes, Any] = dict(backend.get_bodies(self.ds.kind, changed))
        for moved in self._found_elsewhere([i for i in changed if i not in current]).values():
            current.update(moved)
        stale: list[tuple[int, IndexRow]] = []
        for entity_id in changed:
            hit = current.get(entity_id)
            keep = (
                index.rows_or_none(codec.decode(hit.body), entity_id, self._buckets)
                if hit is not None
                else set()
            )
            stale += [(self._shard_of(r), r) for r in wanted[entity_id] - keep]
        return self._delete(index, stale)

    # -- repair --------------------------------------------------------------------
    def repair(self, since: int | None = None, *, sweep: bool = True) -> CleanStats:
        """One pass over every building or ready index: write missing rows, delete
        stale ones, most recently updated entities first.

        ``since`` (microseconds since the epoch) limits the pass to entities
        updated since then; ``sweep`` also removes rows whose entity is gone
        (a scan of every index table).
        """
        started = time.monotonic()
        indexes = self.ds.registry(refresh=True).maintained()
        stats = CleanStats()
        if indexes:
            shards = range(len(self.ds._backends))
            stats = self._parallel(
                lambda s: self._repair_shard(indexes, s, since, len(shards)), shards
            )
            if sweep:
                for index in indexes:
                    stats.removed += self._sweep(index)
        stats.seconds = time.monotonic() - started
        return stats

    def _repair_shard(
        self, indexes: Sequence[Index], shard: int, since: int | None, shards: int
    ) -> CleanStats:
        backend = self.ds._backends[shard]
        throttle = self._throttle(shards)
        stats = CleanStats()
        position: list[tuple[int, int] | None] = [None]

        def one_batch() -> int | None:
            batch = backend.scan_recent(self.ds.kind, position[0], since, self.batch)
            if not batch:
                return None
            bodies = {entity_id: (body, updated) for _, entity_id, body, updated in batch}
            written, removed = self._reconcile(indexes, backend, bodies)
            stats.written += written
            stats.removed += removed
            stats.entities += len(batch)
            position[0] = (batch[-1][3], batch[-1][0])
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
            removed += self._delete(index, actual - expected)
        # Entities that changed meanwhile: reconcile them again from their new body.
        now = backend.versions(self.ds.kind, ids)
        changed = [i for i in ids if i not in now or now[i][1] != bodies[i][1]]
        if changed and depth < 3:
            current = backend.get_bodies(self.ds.kind, changed)
            again = {i: (s.body, s.updated) for i, s in current.items()}
            w, r = self._reconcile(indexes, backend, again, depth + 1) if again else (0, 0)
            written, removed = written + w, removed + r
            missing = [i for i in changed if i not in current]
            moved = self._found_elsewhere(missing)
            for shard, found in moved.items():
                if shard < 0:  # found, its bucket unknown here: its shard's pass will do
                    continue
                bodies_there = {i: (s.body, s.updated) for i, s in found.items()}
                w, r = self._reconcile(indexes, self.ds._backends[shard], bodies_there, depth + 1)
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
        found = ds._fetch_many(ids)
        where = ds._placer.locate(list(found))
        out: dict[int, dict[bytes, Stored]] = {}
        for entity_id, stored in found.items():
            bucket = where.get(entity_id)
            shard = ds._shard_of_bucket[bucket] if bucket is not None else -1
            out.setdefault(shard, {})[entity_id] = stored
        return out

    def _remove_rows_of(self, indexes: Sequence[Index], ids: Sequence[bytes]) -> int:
        """Delete every row of entities that no longer exist."""
        if not ids:
            return 0
        removed = 0
        for index in indexes:
            removed += self._delete(index, self._rows_of(index, ids))
        return removed

    def _sweep(self, index: Index) -> int:
        """Remove rows whose entity does not exist (left by a crash in delete).

        Unique indexes are left alone: a claim is written before its entity, so
        a row without an entity may be a write in flight; such a claim is taken
        over when another entity wants the value.
        """
        if index.unique:
            return 0
        removed = 0
        for shard, backend in enumerate(self.ds._backends):
            page: list[tuple[bytes, ...]] = []
            for row in iter_index_rows(backend, index):
                page.append(row)
                if len(page) >= self.batch:
                    removed += self._sweep_page(index, shard, page)
                    page = []
            removed += self._sweep_page(index, shard, page)
        return removed

    def _sweep_page(self, index: Index, shard: int, rows: list[tuple[bytes, ...]]) -> int:
        if not rows:
            return 0
        ids = list(dict.fromkeys(r[-1] for r in rows))
        present = self.ds._fetch_many(ids)
        gone = [i for i in ids if i not in present]
        if not gone:
            return 0
        backend = self.ds._backends[shard]
        orphans = [r for r in backend.rows_of_entities(index.table, index.properties, gone)]
        return backend.delete_index_rows(index.table, index.properties, orphans)

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
        of deleted entities.  ``stop()`` or Ctrl-C ends it."""
        self._stop.clear()
        total = CleanStats()
        since: int | None = None
        n = 0
        while not self._stop.is_set() and (passes is None or n < passes):
            began = time.time_ns() // 1000
            stats = self.repair(since, sweep=n % sweep_every == 0)
            total.add(stats)
            if on_pass is not None:
                on_pass(stats)
            since = began - int(margin * 1_000_000)
            n += 1
            if passes is None or n < passes:
                self._stop.wait(interval)
        return total
