"""Growing while serving: add shards, move buckets, rebalance (Yupoo's growth path).

A bucket moves from its source shard to a target in steps recorded in the
catalog (``bagstore_moves``), so a move killed at any point can be resumed or
rolled back:

1. ``copy``: the target marks the bucket ``INCOMING`` (it refuses writes for
   it) and receives the bucket's entities (every kind) and index rows in
   batches, while the source keeps serving reads and writes;
2. ``frozen``: the source marks the bucket ``FROZEN``: writers to it wait
   (and retry) instead of writing; the target is made identical to the now
   still source (the changes since the copy: new, changed and deleted rows);
3. ``switched``: the target owns the bucket, the catalog points the bucket at
   it, the source lets go of it — a process still routing by the old
   placement is refused there (fencing) and refreshes;
4. after a grace period (stale readers refresh their placement within
   ``refresh_interval``) the source's copy is deleted and the move is done.

Writes to the bucket wait only for step 2's final sync of one bucket.

The copy of step 1 and the deletes of step 4 are paced with the Cleaner's
:class:`bagstore.throttle.Throttle`: after each step the mover pauses ``duty``
times as long as the step took (a slow step earns a long pause), so that live
traffic keeps its latency; step 2 is never paced, since writers to the bucket
wait for it.

    >>> import bagstore, tempfile
    >>> root = tempfile.mkdtemp()
    >>> ds = bagstore.open(root, shards=1, buckets=8)
    >>> _ = ds.put_many([{"n": i} for i in range(20)])
    >>> ds.add_shard(f"sqlite:///{root}/extra.db")
    1
    >>> ds.rebalance(grace=0).buckets
    4
    >>> [s["buckets"] for s in ds.status()["shards"]]
    [4, 4]
    >>> ds.close()
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from bagstore import testing
from bagstore.backends import Backend
from bagstore.backends.buckets import FROZEN, INCOMING, OWNED
from bagstore.backends.changesql import clear_bucket_changes
from bagstore.backends.indexsql import IndexRow
from bagstore.backends.pool import long_statements
from bagstore.catalog import IndexCatalog
from bagstore.changecopy import sync_bucket_changes
from bagstore.changes import prepare_feeds
from bagstore.errors import ConfigurationError
from bagstore.index import Index
from bagstore.throttle import Throttle, check_pacing, check_seconds

if TYPE_CHECKING:
    from bagstore.datastore import Datastore

__all__ = ["MoveStats", "Mover"]

log = logging.getLogger(__name__)

COPY, FROZEN_PHASE, SWITCHED = "copy", "frozen", "switched"

#: Rows per copy or delete step, and the pause after a step in units of its
#: duration.  Gentle by default: on the 2-core machine measured
#: (bench/RESULTS.md), 100-row steps flat out raised a concurrent writer's p99
#: 1.4-2.4x on MariaDB and 3-4x on SQLite, where 10-row steps with a pause half
#: as long as each kept it at 0.8-2.0x (medians 1.5-1.7x), at a half (MariaDB)
#: to a fifth (SQLite) of the speed.  ``duty=0`` and a larger ``batch`` move
#: faster on a store without live traffic.
DEFAULT_BATCH = 10
DEFAULT_DUTY = 0.5


@dataclass
class MoveStats:
    """What a move did: buckets moved, entity and index rows copied and deleted,
    the longest time a bucket was frozen, and how long it all took (seconds,
    the grace period's wait included)."""

    buckets: int = 0
    entities: int = 0
    index_rows: int = 0
    deleted: int = 0
    longest_freeze: float = 0.0
    seconds: float = 0.0


@dataclass(frozen=True)
class _Layout:
    """The kinds and indexes whose rows a move copies and deletes."""

    kinds: tuple[str, ...]
    indexes: tuple[Index, ...]

    def signature(self) -> tuple[str, ...]:
        return (*self.kinds, "|", *(i.to_json() for i in self.indexes))


class Mover:
    """Moves buckets between the shards of one store (all kinds, all indexes).

    ``batch``: rows copied or deleted per step (default 10); ``duty``: after
    each step of a bucket's copy (and of the deletes that end a move), pause
    this many times as long as the step took (default 0.5; 0: flat out);
    ``max_rate``: rows per second at most (None: no cap).

    ``progress(done, total)`` is called after each bucket of a move, a
    rebalance or a resume (a rebalance counts over all its moves), and after
    each batch of a key migration (entities of the old bucket read);
    ``on_step(phase, rows)`` after each step of ``batch`` rows (``"copy"``,
    ``"delete"``) and when a wait begins (``"grace"``, ``"wait"``; rows 0), so
    that a long move of one bucket shows signs of life.
    """

    def __init__(
        self,
        ds: Datastore,
        *,
        batch: int = DEFAULT_BATCH,
        grace: float | None = None,
        progress: Callable[[int, int], None] | None = None,
        duty: float = DEFAULT_DUTY,
        max_rate: float | None = None,
        on_step: Callable[[str, int], None] | None = None,
    ) -> None:
        check_pacing(batch, duty, max_rate)
        if ds.router.pinned:
            raise ConfigurationError(
                f"kind {ds.kind!r} is global (one database, never moved): move buckets "
                "through a datastore of a sharded kind of the store"
            )
        if grace is not None:
            check_seconds("grace", grace)
        self.ds = ds
        self.batch = batch
        self.grace = ds.router.refresh_interval + 1.0 if grace is None else grace
        self.progress = progress
        self.on_step = on_step
        self.duty = duty
        self.max_rate = max_rate
        self.index_catalog = IndexCatalog(ds.router.catalog_backend)
        self._throttle = Throttle(max_rate=max_rate, duty=duty, adaptive=False)
        self._prepared: set[tuple[str, tuple[str, ...]]] = set()

    def _step(self, phase: str, rows: int) -> None:
        if self.on_step is not None:
            self.on_step(phase, rows)

    def _paced(self, backend: Backend, rows: int, started: float, paced: bool) -> None:
        """After a step of ``rows`` rows written on ``backend``, begun at
        ``started``: when ``paced``, the backend's upkeep and the throttle's pause."""
        if not paced:
            return
        backend.after_bulk_step()
        if self.duty or self.max_rate:
            pause = self._throttle.pause_after(rows, time.monotonic() - started)
            if pause > 0:
                time.sleep(pause)

    # -- shards --------------------------------------------------------------------
    def add_shard(self, url: str) -> int:
        """Register a new, empty shard; return its number.  It holds no bucket
        until buckets are moved to it."""
        ds = self.ds
        backend = ds.router.opener.open(url)
        try:
            if any(b.name == backend.name for b in ds.router.backends):
                raise ConfigurationError(f"{backend.name} is already a shard of this store")
            ensure_limits = getattr(backend, "ensure_limits", None)
            if ensure_limits is not None:  # its server must carry the store's largest body
                ensure_limits()
                ds.check_body_capacity(backend)
            no = len(ds.catalog.read_placement().shard_names)
            store, stamped = backend.stamp(ds.placement.store_id, no)
            if store != ds.placement.store_id or stamped != no:
                raise ConfigurationError(
                    f"database {backend.name} already belongs to store {store} as shard {stamped}"
                )
            self._prepare(backend)
        finally:
            backend.close()
        name = ds.router.opener.listed_name(backend.name)
        no = ds.catalog.add_shard(name)
        ds.refresh_placement(force=True)
        log.info("shard %d added: %s (it holds no bucket until buckets move to it)", no, name)
        return no

    def _prepare(self, backend: Backend, layout: _Layout | None = None) -> None:
        """Every kind's entities table and every index table on a shard."""
        layout = layout or self._layout()
        for kind in layout.kinds:
            backend.ensure_kind(kind)
        for index in layout.indexes:
            backend.ensure_index_table(index.table, index.properties, index.unique)
        prepare_feeds(self.ds.router.catalog_backend, backend)  # change feed triggers

    def _layout(self) -> _Layout:
        """The kinds and indexes whose rows a bucket holds, as the catalog says now
        (global kinds' are in their own database: see bagstore.sharding.home)."""
        unmoved = self.ds.catalog.global_kinds()
        kinds = tuple(k for k in self.ds.catalog.kinds() if k not in unmoved)
        entries = self.index_catalog.all_entries()
        indexes = tuple(Index.from_json(d) for _, k, d, _ in entries if k not in unmoved)
        return _Layout(kinds, indexes)

    def _ready(self, dst: Backend, layout: _Layout) -> None:
        """``dst`` has the tables of ``layout`` (created once per move and layout)."""
        key = (dst.name, layout.signature())
        if key not in self._prepared:
            self._prepare(dst, layout)
            self._prepared.add(key)

    def _target(self, to: int | str) -> int:
        names = self.ds.refresh_placement(force=True).shard_names
        if isinstance(to, int) and not isinstance(to, bool) and 0 <= to < len(names):
            return to
        for no, backend in enumerate(self.ds.router.backends):
            if to in (backend.name, names[no]):
                return no
        raise ConfigurationError(f"no shard {to!r} in this store (shards: {list(names)})")

    def server_advice(self) -> list[str]:
        """Settings of the shards' servers that let a move stall live writes
        (each server once), as sentences for people; empty when none."""
        seen: set[str] = set()
        advice: list[str] = []
        for backend in self.ds.router.backends:
            server = backend.server or backend.name  # (embedded: the file)
            if server not in seen:
                seen.add(server)
                advice += backend.server_advice()
        return advice

    # -- moves -----------------------------------------------------------------------
    def move(self, buckets: Sequence[int], to: int | str) -> MoveStats:
        """Move buckets to a shard (a number or a name), one bucket at a time."""
        if isinstance(buckets, str | bytes) or not isinstance(buckets, Iterable):
            raise ConfigurationError(f"buckets must be a list of bucket numbers, not {buckets!r}")
        buckets = list(buckets)  # (a generator is read once)
        target = self._target(to)
        count = self.ds.placement.buckets
        for b in buckets:
            if type(b) is not int or not 0 <= b < count:
                raise ConfigurationError(f"no bucket {b!r} (buckets are 0 to {count - 1})")
        unfinished = self.ds.catalog.moves()
        for b in buckets:
            if b in unfinished and unfinished[b][1] != target:
                raise ConfigurationError(
                    f"bucket {b} has an unfinished move to shard {unfinished[b][1]}: "
                    "resume or roll it back first"
                )
        log.info(
            "moving %d buckets to shard %s", len(buckets), self.ds.router.backends[target].name
        )
        stats = MoveStats()
        started = time.monotonic()
        switched: list[tuple[int, int]] = []
        # Kinds and indexes as they are now: enough for the copy while writes go
        # on (the frozen sync, which must miss nothing, reads them again).
        layout = self._layout()
        with self._then_reread():
            for i, b in enumerate(buckets):
                # Only this bucket's shard is read from the catalog (the whole
                # placement, per bucket, was most of a small bucket's move time).
                source = self._source_of(b)
                if source != target:
                    self._move_one(b, source, target, stats, layout)
                    switched.append((b, source))
                if self.progress is not None:
                    self.progress(i + 1, len(buckets))
        self._finish(switched, stats)
        stats.seconds = time.monotonic() - started
        log.info(
            "moved %d buckets to shard %s: %d entities, %d index rows copied, %d rows "
            "deleted from the old shards in %.1fs",
            stats.buckets,
            self.ds.router.backends[target].name,
            stats.entities,
            stats.index_rows,
            stats.deleted,
            stats.seconds,
        )
        return stats

    @contextlib.contextmanager
    def _then_reread(self) -> Iterator[None]:
        """Read the whole placement after the block (the mover's own was only
        patched at each switch); if the block failed, a failure to read must
        not hide its error."""
        try:
            yield
        except BaseException:
            with contextlib.suppress(Exception):
                self.ds.refresh_placement(force=True)
            raise
        self.ds.refresh_placement(force=True)

    def _source_of(self, bucket: int) -> int:
        shard = self.ds.catalog.shards_of([bucket]).get(bucket)
        if shard is None:
            raise ConfigurationError(f"the catalog's placement has no row for bucket {bucket}")
        return shard

    def _move_one(
        self, b: int, source: int, target: int, stats: MoveStats, layout: _Layout
    ) -> None:
        ds = self.ds
        src, dst = ds.router.backends[source], ds.router.backends[target]
        began, copied = time.monotonic(), (stats.entities, stats.index_rows)
        log.debug("bucket %d: copying from shard %s to shard %s", b, src.name, dst.name)
        ds.catalog.set_move(b, source, target, COPY)
        self._ready(dst, layout)
        dst.set_bucket_state(b, INCOMING)
        self._sync(b, src, dst, stats, layout, paced=True)
        testing.hit("move.after_copy")
        frozen_at = time.monotonic()
        src.set_bucket_state(b, FROZEN)
        ds.catalog.set_move(b, source, target, FROZEN_PHASE)
        now = self._layout()  # a kind or index registered meanwhile is copied too
        self._ready(dst, now)
        self._sync(b, src, dst, stats, now, paced=False)
        testing.hit("move.after_freeze")
        dst.set_bucket_state(b, OWNED)
        ds.catalog.set_bucket(b, target)
        testing.hit("move.after_placement")
        ds.catalog.set_move(b, source, target, SWITCHED)
        src.release_bucket(b)
        testing.hit("move.after_switch")
        stats.longest_freeze = max(stats.longest_freeze, time.monotonic() - frozen_at)
        stats.buckets += 1
        ds.router.learn({b: target})
        log.info(
            "bucket %d moved from shard %s to shard %s: %d entities, %d index rows "
            "in %.2fs (writes frozen %.3fs)",
            b,
            src.name,
            dst.name,
            stats.entities - copied[0],
            stats.index_rows - copied[1],
            time.monotonic() - began,
            time.monotonic() - frozen_at,
        )

    def _finish(self, switched: list[tuple[int, int]], stats: MoveStats) -> None:
        """After the grace period, delete the sources' copies and end the moves."""
        if not switched:
            return
        self._step("grace", 0)
        time.sleep(self.grace)
        # Read after every switch: rows of a kind or index registered later
        # were written to the buckets' new shards only.
        layout = self._layout()
        for b, source in switched:
            deleted = self._clear(b, self.ds.router.backends[source], layout)
            stats.deleted += deleted
            self.ds.catalog.end_move(b)
            log.debug("bucket %d: %d rows deleted from its old shard %d", b, deleted, source)

    @long_statements()  # its statements wait bulk_timeout, not read_timeout
    def _sync(
        self,
        b: int,
        src: Backend,
        dst: Backend,
        stats: MoveStats,
        layout: _Layout,
        *,
        paced: bool,
    ) -> None:
        """Make the target's copy of bucket ``b`` equal to the source's, in steps
        of ``batch`` rows (``paced``: with the throttle's pauses between them)."""
        step = self.batch
        for kind in layout.kinds:
            have = src.bucket_stamps(kind, b)
            got = dst.bucket_stamps(kind, b)
            need = [i for i, stamp in have.items() if got.get(i) != stamp]
            for start in range(0, len(need), step):
                t0 = time.monotonic()
                rows = src.entity_rows(kind, need[start : start + step])
                dst.copy_entity_rows(kind, rows)
                stats.entities += len(rows)
                self._paced(dst, len(rows), t0, paced)
                self._step("copy", len(rows))
            gone = [i for i in got if i not in have]
            for start in range(0, len(gone), step):
                dst.delete_ids(kind, gone[start : start + step])
        for index in layout.indexes:
            have_rows = src.bucket_index_rows(index.table, index.properties, index.unique, b)
            got_rows = dst.bucket_index_rows(index.table, index.properties, index.unique, b)
            missing = [r for r in have_rows if r not in got_rows]
            by_claim: dict[int | None, list[IndexRow]] = {}
            for r in missing:
                by_claim.setdefault(have_rows[r], []).append(r)
            for claimed, part in by_claim.items():
                for start in range(0, len(part), step):
                    t0 = time.monotonic()
                    chunk = part[start : start + step]
                    dst.insert_index_rows(index.table, index.properties, chunk, claimed=claimed)
                    self._paced(dst, len(chunk), t0, paced)
                    self._step("copy", len(chunk))
            stats.index_rows += len(missing)
            extra = [r for r in got_rows if r not in have_rows]
            dst.delete_index_rows(index.table, index.properties, extra)
        # id -> bucket lookup rows of kinds placed by a shard key
        have_ids = set(src.bucket_id_rows(b))
        got_ids = set(dst.bucket_id_rows(b))
        for kind, entity_id, entity_bucket in have_ids - got_ids:
            dst.record_ids(kind, [(entity_id, b, entity_bucket)])
        for kind, entity_id, _ in got_ids - have_ids:
            if not any(k == kind and i == entity_id for k, i, _ in have_ids):
                dst.forget_ids(kind, [entity_id])
        # change feed rows and positions travel with their bucket (bagstore.changes)
        sync_bucket_changes(
            src, dst, b, max(step, 100), lambda n, t0: self._paced(dst, n, t0, paced)
        )

    @long_statements()
    def _clear(self, b: int, backend: Backend, layout: _Layout | None = None) -> int:
        """Delete every entity and index row of bucket ``b`` on ``backend``, in
        paced steps of ``batch`` rows."""
        layout = layout or self._layout()
        deleted = 0
        step = self.batch
        for kind in layout.kinds:
            ids = list(backend.bucket_stamps(kind, b))
            for start in range(0, len(ids), step):
                t0 = time.monotonic()
                n = backend.delete_ids(kind, ids[start : start + step])
                deleted += n
                self._paced(backend, n, t0, True)
                self._step("delete", n)
        testing.hit("move.mid_delete")
        for index in layout.indexes:
            rows = list(backend.bucket_index_rows(index.table, index.properties, index.unique, b))
            for start in range(0, len(rows), step):
                t0 = time.monotonic()
                n = backend.delete_index_rows(
                    index.table, index.properties, rows[start : start + step]
                )
                deleted += n
                self._paced(backend, n, t0, True)
                self._step("delete", n)
        by_kind: dict[str, list[bytes]] = {}
        for kind, entity_id, _ in backend.bucket_id_rows(b):
            by_kind.setdefault(kind, []).append(entity_id)
        for kind, ids in by_kind.items():
            backend.forget_ids(kind, ids)
            deleted += len(ids)
        deleted += clear_bucket_changes(backend, b)  # the change feed's rows
        return deleted

    # -- recovery --------------------------------------------------------------------
    def unfinished(self) -> dict[int, tuple[int, int, str]]:
        """``{bucket: (source, target, phase)}`` of moves a killed process left."""
        return self.ds.catalog.moves()

    def resume(self) -> MoveStats:
        """Finish every unfinished move."""
        stats = MoveStats()
        started = time.monotonic()
        switched = []
        self.ds.refresh_placement(force=True)
        layout = self._layout()
        with self._then_reread():
            unfinished = sorted(self.unfinished().items())
            log.info("resuming %d unfinished bucket moves", len(unfinished))
            for i, (b, (source, target, phase)) in enumerate(unfinished):
                # Killed between the placement's switch and the phase's: the
                # target owns the bucket (and took writes): never copy again.
                if phase != SWITCHED and self._source_of(b) != target:
                    self._move_one(b, source, target, stats, layout)
                else:
                    self.ds.catalog.set_move(b, source, target, SWITCHED)
                    self.ds.router.backends[source].release_bucket(b)
                switched.append((b, source))
                if self.progress is not None:
                    self.progress(i + 1, len(unfinished))
        self._finish(switched, stats)
        stats.seconds = time.monotonic() - started
        return stats

    def rollback(self, bucket: int) -> None:
        """Undo an unfinished move that has not switched: the source owns the
        bucket again and the target's partial copy is deleted."""
        moves = self.unfinished()
        if bucket not in moves:
            raise ConfigurationError(f"bucket {bucket} has no unfinished move")
        source, target, phase = moves[bucket]
        if phase == SWITCHED or self._source_of(bucket) == target:
            raise ConfigurationError(
                f"the move of bucket {bucket} has switched already: resume it instead"
            )
        self.ds.refresh_placement(force=True)
        src, dst = self.ds.router.backends[source], self.ds.router.backends[target]
        src.set_bucket_state(bucket, OWNED)
        dst.release_bucket(bucket)
        self._clear(bucket, dst)
        self.ds.catalog.end_move(bucket)

    # -- one key (directory shard map) ---------------------------------------------------
    def migrate_key(self, value: object, to_bucket: int, *, wait: float | None = None) -> int:
        """Move every entity of one shard key, of every kind placed by that key
        through the directory, to another bucket; return how many (see
        :meth:`migrate_key_by_kind`)."""
        return sum(self.migrate_key_by_kind(value, to_bucket, wait=wait).values())

    def migrate_key_by_kind(
        self, value: object, to_bucket: int, *, wait: float | None = None
    ) -> dict[str, int]:
        """Move one shard key to another bucket in every kind placed by that key
        through the directory (``shard_map="directory"``); ``{kind: entities
        moved}``.

        Every kind's entry is marked migrating (writes to the key get
        KeyMigrating), and after ``wait`` seconds (default: the directory
        cache's lifetime, so that no process still writes by an old entry) the
        entities are copied, their lookup rows switched, the directory entries
        pointed at the new bucket, and the old copies deleted (see
        :mod:`bagstore.keymove`).  Re-running it after a crash finishes the job.
        """
        from bagstore.keymove import KeyMigration, encode_key, placers_of_key

        ds = self.ds
        if ds.placer.directory is None:
            raise ConfigurationError(
                f"kind {ds.kind!r} does not use the directory shard map (shard_map='directory')"
            )
        if (
            not isinstance(to_bucket, int)
            or isinstance(to_bucket, bool)
            or not 0 <= to_bucket < ds.placement.buckets
        ):
            raise ConfigurationError(f"no bucket {to_bucket!r}")
        key = encode_key(value)
        placers = placers_of_key(ds.router, ds.placer, ds.catalog.placements())
        migration = KeyMigration(
            ds.router,
            placers,
            key,
            to_bucket,
            batch=self.batch,
            step=self._step,
            progress=self.progress,
        )
        return migration.run(wait)

    # -- rebalance -------------------------------------------------------------------
    def plan(self) -> list[tuple[int, int]]:
        """``(bucket, target)`` moves that give every shard an even share."""
        placement = self.ds.refresh_placement(force=True)
        n = len(placement.shard_names)
        held: list[list[int]] = [[] for _ in range(n)]
        for b, s in enumerate(placement.shard_of_bucket):
            held[s].append(b)
        base, extra = divmod(placement.buckets, n)
        # the shards holding most keep the larger shares: fewest moves
        order = sorted(range(n), key=lambda s: -len(held[s]))
        want = {s: base + (1 if rank < extra else 0) for rank, s in enumerate(order)}
        surplus = [b for s in range(n) for b in held[s][want[s] :]]
        moves = []
        for s in range(n):
            for _ in range(want[s] - len(held[s])):
                moves.append((surplus.pop(), s))
        return moves

    def rebalance(self) -> MoveStats:
        """Move buckets until every shard holds an even share."""
        total = MoveStats()
        by_target: dict[int, list[int]] = {}
        plan = self.plan()
        for b, target in plan:
            by_target.setdefault(target, []).append(b)
        outer, counted = self.progress, 0
        for target, buckets in by_target.items():
            if outer is not None:  # count over the whole plan, not per target

                def over_plan(done: int, _: int, base: int = counted) -> None:
                    outer(base + done, len(plan))

                self.progress = over_plan
            try:
                stats = self.move(sorted(buckets), target)
            finally:
                self.progress = outer
            counted += len(buckets)
            total.buckets += stats.buckets
            total.entities += stats.entities
            total.index_rows += stats.index_rows
            total.deleted += stats.deleted
            total.longest_freeze = max(total.longest_freeze, stats.longest_freeze)
            total.seconds += stats.seconds
        return total
