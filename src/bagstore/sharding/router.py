"""Where a statement goes, and the one place that retries when it went wrong.

The :class:`Router` owns this process's :class:`~bagstore.sharding.topology.Topology`
(placement version, bucket -> shard, the shards' backends), the pool that runs
work on several shards at once, and the **one** retry layer: a shard that
refuses work because this process's placement is stale (``StalePlacement``, a
fenced write to a bucket it no longer owns) makes the router learn where the
bucket is now and run the work again; a bucket frozen by a move
(``KeyMigrating``) makes it wait, up to ``freeze_wait`` seconds, re-reading
the placement every 5 ms.  Both give up after 1,000 rounds.

Routing is two steps, as in Vitess: a :class:`Route` (a plain value: which
shards, for a write or a read, at which placement version) is computed first;
:meth:`Router.resolve` binds it to backends.  The facade
(:class:`bagstore.Datastore`) never sees a server: it builds work, hands it to
the router, and merges what comes back (see docs/consistency.md).

    >>> route = Route((2,), write=True, version=7)
    >>> route.scope, route.shards
    ('one', (2,))
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, TypeVar

from bagstore.backends.pool import in_long_statements, long_statements
from bagstore.errors import KeyMigrating, Retryable, ShardUnavailable, StalePlacement
from bagstore.sharding.replicas import records as replica_records
from bagstore.sharding.topology import ShardOpener, Topology
from bagstore.throttle import check_seconds

if TYPE_CHECKING:
    from bagstore.backends import Backend
    from bagstore.catalog import Catalog, Placement

__all__ = ["Route", "Router"]

T = TypeVar("T")
R = TypeVar("R")

#: The facade's logger name, kept: what operators filter on (docs/configuration.md).
log = logging.getLogger("bagstore.datastore")

#: How many times the router re-reads the placement before giving up.
MAX_ROUNDS = 1000
#: The pause between two looks at a bucket frozen by a move.
FROZEN_PAUSE = 0.005

#: Set in the threads of a router's pool: work they fan out runs in place,
#: since waiting on the same (bounded) pool from inside it can deadlock.
_worker = threading.local()


def _mark_worker() -> None:
    _worker.active = True


@dataclass(frozen=True)
class Route:
    """Which shards a piece of work goes to: ``shards`` (one, some or all of
    them), for a write (fenced: the shard checks it owns the bucket) or a read,
    as placement ``version`` put them."""

    shards: tuple[int, ...]
    write: bool
    version: int
    every: bool = False

    @property
    def scope(self) -> str:
        """``"one"``, ``"some"`` or ``"all"``."""
        return "all" if self.every else "one" if len(self.shards) == 1 else "some"


class Router:
    """The topology of one store as this process knows it, and how work reaches it.

    ``backends`` are the shards' backends in shard order (the router owns and
    closes them, and the catalog's); ``on_new_shard`` prepares a shard the
    catalog names that this process had not opened (its tables).
    """

    def __init__(
        self,
        catalog: Catalog,
        placement: Placement,
        backends: Sequence[Backend],
        opener: ShardOpener,
        *,
        refresh_interval: float = 5.0,
        freeze_wait: float = 5.0,
        parallel: bool | None = None,
        max_workers: int | None = None,
    ) -> None:
        self.catalog = catalog
        self.opener = opener
        self.refresh_interval = check_seconds("refresh_interval", refresh_interval)
        self.freeze_wait = check_seconds("freeze_wait", freeze_wait)
        self.on_new_shard: Callable[[Backend], None] = lambda backend: None
        self._parallel_option = parallel
        self._max_workers = max_workers or min(32, 2 * len(backends))
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()  # refreshes, one at a time
        self._pool_lock = threading.Lock()
        self._stats_lock = threading.Lock()
        #: how this process learned of bucket moves (see ``Datastore.stats()``)
        self._counts = {"refused": 0, "frozen_waits": 0, "full_reads": 0, "bucket_reads": 0}
        self.topology = Topology(placement, tuple(backends))
        #: set by :meth:`pin`: every bucket is on one backend for good (a global kind)
        self.pinned = False
        #: the replicated shards: where their primaries are, replica reads
        self.replication = opener.replication
        self.replication.catalog = catalog
        for no, backend in enumerate(backends):
            self.replication.name(backend, str(no))
        self.replication.name(catalog.backend, "catalog")  # (unless it is a shard's)
        self.parallel = self._fan_out()
        #: when the placement's version was last compared with the catalog's
        self.checked_at = time.monotonic()

    # -- the topology ----------------------------------------------------------------
    @property
    def placement(self) -> Placement:
        return self.topology.placement

    @property
    def backends(self) -> tuple[Backend, ...]:
        """Every shard's backend, in shard order (of the current topology)."""
        return self.topology.backends

    @property
    def catalog_backend(self) -> Backend:
        return self.catalog.backend

    def _fan_out(self) -> bool:
        """Whether work over several shards runs in parallel threads: as told by
        ``parallel``, else only when the shards live on more than one server
        (threads only add a hand-off to statements that one server or one
        embedded file would run no faster side by side)."""
        if self._parallel_option is not None:
            return self._parallel_option
        return len({b.server for b in self.topology.backends if b.server is not None}) > 1

    def _install(self, placement: Placement, backends: tuple[Backend, ...] | None = None) -> None:
        """Route by ``placement`` from now on (under ``_lock``), unless it is
        older than the one in use: a topology is replaced whole, never edited."""
        if placement.version < self.topology.version:
            return
        if backends is None:
            backends = self.topology.backends
        self.topology = Topology(placement, backends)

    def pin(self, backend: Backend) -> list[Backend]:
        """Route every bucket to ``backend`` from now on, whatever the catalog's
        placement says or comes to say (a global kind, stored in one place:
        docs/tables.md); return the shards' backends no longer used (the
        catalog's excepted), for the caller to close."""
        with self._lock:
            old = self.topology
            placement = replace(
                old.placement, shard_names=(backend.name,), shard_of_bucket=(0,) * old.buckets
            )
            self.topology = Topology(placement, (backend,))
            self.pinned = True
            self.parallel = False
        keep = {id(backend), id(self.catalog.backend)}
        return [b for b in {id(b): b for b in old.backends}.values() if id(b) not in keep]

    def refresh(self, *, force: bool = False) -> Placement:
        """Re-read the bucket placement if the catalog's version moved (at most
        every ``refresh_interval`` seconds unless forced)."""
        if self.pinned:  # bucket moves never concern a pinned router
            self.checked_at = time.monotonic()
            return self.topology.placement
        if not force and time.monotonic() - self.checked_at < self.refresh_interval:
            return self.topology.placement
        with self._lock:
            self.checked_at = time.monotonic()
            old = self.topology.placement
            try:
                version = self.catalog.placement_version()
            except ShardUnavailable:
                if force:
                    raise
                # The catalog's server is down (its primary failed over, say):
                # reads go on by the placement known, writes stay fenced.
                log.info("the catalog cannot be reached: placement version %d kept", old.version)
                return old
            if version == old.version and not force:
                return old
            placement = self.catalog.read_placement()
            self.count("full_reads")
            backends = list(self.topology.backends)
            opened = placement.shard_names[len(backends) :]
            for name in opened:
                backend = self.opener.open_listed(name)
                self.replication.name(backend, str(len(backends)))
                self.on_new_shard(backend)
                backends.append(backend)
            if self.replication.replicated():
                self.replication.learn(replica_records(self.catalog.read_meta()))
            self._install(placement, tuple(backends))
            self.parallel = self._fan_out()
            moved = sum(
                a != b for a, b in zip(old.shard_of_bucket, placement.shard_of_bucket, strict=True)
            )
            if moved or opened:
                log.info(
                    "placement refreshed (version %d to %d): %d buckets on other shards, "
                    "%d shards added",
                    old.version,
                    placement.version,
                    moved,
                    len(opened),
                )
            return self.topology.placement

    def refresh_refused(self, buckets: Iterable[int]) -> None:
        """A shard refused writes to ``buckets``: this process's placement is out
        of date for them.  Read where the catalog puts those buckets now and
        take that (one short read, where re-reading the whole placement costs
        milliseconds, a cost every write would pay during a bucket move); the
        whole placement is read instead if that tells nothing new (or names a
        shard this process has not opened).  The version is left as it was, so
        the next timed refresh still reads the whole placement."""
        wanted = sorted(set(buckets))
        if self.pinned:  # no placement to learn: the one database must own them all
            raise StalePlacement(
                f"{self.topology.backends[0].name} refused bucket(s) {wanted[:16]}: it does not "
                "hold them as this global kind's database",
                buckets=tuple(wanted),
            )
        self.count("refused")
        log.info(
            "a shard refused a write to bucket(s) %s: this process's placement was out of "
            "date; refreshing it and writing again",
            ", ".join(map(str, wanted[:16])) + (" ..." if len(wanted) > 16 else "") or "?",
        )
        if wanted and len(wanted) <= 16:
            self.count("bucket_reads")
            if self.learn(self.catalog.shards_of(wanted)):
                return
        self.refresh(force=True)

    def learn(self, now: Mapping[int, int]) -> bool:
        """Take ``{bucket: shard}`` read from the catalog into this process's
        placement (its version unchanged); False, changing nothing, if no bucket
        moved or one names a shard this process has not opened."""
        if self.pinned:
            return False
        with self._lock:
            topology = self.topology
            placement = topology.placement
            changed = {b: s for b, s in now.items() if placement.shard_of_bucket[b] != s}
            if not changed or any(s >= len(topology.backends) for s in changed.values()):
                return False
            shard_of = list(placement.shard_of_bucket)
            for b, s in changed.items():
                shard_of[b] = s
            self._install(replace(placement, shard_of_bucket=tuple(shard_of)))
            return True

    def count(self, event: str) -> None:
        with self._stats_lock:
            self._counts[event] += 1

    def counts(self) -> dict[str, int]:
        """``refused``, ``frozen_waits``, ``full_reads``, ``bucket_reads`` since open."""
        with self._stats_lock:
            return dict(self._counts)

    # -- routes ------------------------------------------------------------------------
    def route(self, buckets: Iterable[int], *, write: bool) -> Route:
        """The route of work on ``buckets`` by the current topology."""
        topology = self.topology
        shard_of = topology.shard_of_bucket
        shards = tuple(sorted({shard_of[b] for b in buckets}))
        return Route(shards, write, topology.version)

    def route_all(self, *, write: bool = False) -> Route:
        """Every shard (scans, counts, schema changes)."""
        topology = self.topology
        return Route(tuple(range(len(topology.backends))), write, topology.version, every=True)

    def resolve(self, route: Route) -> list[Backend]:
        """The backends of a route's shards."""
        backends = self.topology.backends
        return [backends[k] for k in route.shards]

    # -- the one retry layer -------------------------------------------------------------
    def by_bucket(
        self,
        items: Sequence[T],
        bucket: Callable[[T], int],
        work: Callable[[Backend, list[T]], R],
    ) -> list[R]:
        """Group items by the shard that owns their bucket and run ``work`` per
        shard (in parallel).  Groups a shard refuses (stale placement, frozen
        bucket) are regrouped by the refreshed placement and run again; groups
        that succeeded are not repeated."""
        results: list[R] = []
        pending = list(items)
        deadline: float | None = None
        for _ in range(MAX_ROUNDS):
            topology = self.topology
            shard_of = topology.shard_of_bucket
            groups: dict[int, list[T]] = defaultdict(list)
            for item in pending:
                groups[shard_of[bucket(item)]].append(item)
            jobs = [(topology.backends[k], part) for k, part in groups.items()]
            outcomes = self.map(lambda job: _attempt(work, job[0], job[1]), jobs)
            pending = []
            migrating = False
            for k, (value, error) in zip(groups, outcomes, strict=True):
                if error is None:
                    results.append(value)  # type: ignore[arg-type]
                else:
                    migrating = migrating or isinstance(error, KeyMigrating)
                    pending += groups[k]
                    last = error
            if not pending:
                return results
            if migrating:
                deadline = self._wait_frozen(deadline, last)
            else:
                self.refresh_refused(bucket(item) for item in pending)
        raise StalePlacement("the placement kept changing; gave up")

    def read_on(self, shard: int, work: Callable[[Backend], T], read_from: str | None = None) -> T:
        """A read on ``shard``: on one of its replicas when ``read_from`` (or
        the datastore's default) is ``"replica"`` and one is fit, else on its
        primary (see :mod:`bagstore.sharding.replicas`)."""
        return self.replication.read(self.topology.backends[shard], work, read_from)

    def on_bucket(self, bucket: int, work: Callable[[Backend], T]) -> T:
        """Run ``work`` on the shard that owns ``bucket``, resolved again after
        each refusal (see :meth:`retry`)."""
        return self.retry(lambda: work(self.topology.backend_of(bucket)))

    def retry(self, work: Callable[[], T]) -> T:
        """Run a write; when a shard says it does not own a bucket (this process's
        placement is stale), refresh and run it again; while a bucket is frozen
        by a move, wait up to ``freeze_wait`` seconds, then raise KeyMigrating."""
        deadline: float | None = None
        for _ in range(MAX_ROUNDS):
            try:
                return work()
            except StalePlacement as exc:
                self.refresh_refused(exc.buckets)
            except KeyMigrating as exc:
                deadline = self._wait_frozen(deadline, exc)
        raise StalePlacement("the placement kept changing; gave up")

    def _wait_frozen(self, deadline: float | None, error: Exception) -> float:
        """One pause for a frozen bucket (raising ``error`` once ``freeze_wait``
        has passed since the first); the deadline to keep."""
        now = time.monotonic()
        if deadline is None:
            log.info("a bucket is frozen by a move: waiting up to %gs", self.freeze_wait)
        deadline = deadline or now + self.freeze_wait
        if now >= deadline:
            raise error
        self.count("frozen_waits")
        time.sleep(FROZEN_PAUSE)
        self.refresh(force=True)
        return deadline

    # -- running work on shards ------------------------------------------------------------
    def pool(self) -> ThreadPoolExecutor:
        """The threads that run work on several shards at once."""
        if self._executor is not None:
            return self._executor
        with self._pool_lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    max_workers=self._max_workers,
                    thread_name_prefix="bagstore",
                    initializer=_mark_worker,
                )
            return self._executor

    def map(self, fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
        """``fn`` over items, in parallel threads when there is more than one and
        the shards are worth it (see ``_fan_out``); in place when called from
        one of the pool's own threads."""
        if len(items) <= 1:
            return [fn(x) for x in items]
        if not self.parallel or getattr(_worker, "active", False):
            # One after another, but like the threads: every item is tried
            # before the first error is raised.
            results: list[R] = []
            first: Exception | None = None
            for x in items:
                try:
                    results.append(fn(x))
                except Exception as exc:
                    first = first or exc
            if first is not None:
                raise first
            return results
        if in_long_statements():  # bulk work stays bulk work in the pool's threads
            fn = long_statements()(fn)
        futures = [self.pool().submit(fn, x) for x in items]
        # Wait for every shard before raising: no work may still be running
        # (and committing) after the caller has seen the error.
        wait(futures)
        return [f.result() for f in futures]

    def on_all(self, fn: Callable[[Backend], R]) -> list[R]:
        """``fn`` on every shard's backend (see :meth:`map`), in shard order."""
        return self.map(fn, self.resolve(self.route_all()))

    def per_shard(self, groups: Mapping[int, T], fn: Callable[[Backend, T], R]) -> dict[int, R]:
        """``fn(backend, group)`` for each ``{shard: group}``."""
        backends = self.topology.backends
        keys = list(groups)
        results = self.map(lambda k: fn(backends[k], groups[k]), keys)
        return dict(zip(keys, results, strict=True))

    def close(self) -> None:
        """Stop the pool and close every shard's connections and the catalog's."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        self.replication.close()
        for b in {id(b): b for b in [*self.topology.backends, self.catalog.backend]}.values():
            b.close()


def _attempt(
    work: Callable[[Backend, list[T]], R], backend: Backend, items: list[T]
) -> tuple[R | None, Retryable | None]:
    """``(result, None)``, or ``(None, error)`` when the shard refused the
    write for routing reasons (other errors propagate)."""
    try:
        return work(backend, items), None
    except (StalePlacement, KeyMigrating) as exc:
        return None, exc
