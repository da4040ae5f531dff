"""The datastore facade: put / get / get_many / delete over sharded backends.

>>> import bagstore, tempfile
>>> with bagstore.open(tempfile.mkdtemp()) as ds:
...     entity_id = ds.put({"title": "hello"})
...     ds.get(entity_id)["title"]
'hello'
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import AbstractContextManager, suppress
from dataclasses import replace
from typing import Any, TypeVar

from bagstore import codec, suggest, testing
from bagstore.backends import (
    Backend,
    EntityRow,
    MySQLDefaults,
    Stored,
    check_identifier,
    open_backend,
)
from bagstore.backends.base import TOGETHER_MAX_IDS, read_bodies_together
from bagstore.backends.pool import in_long_statements, long_statements
from bagstore.cache import open_layer
from bagstore.cache import request as _request
from bagstore.cache.request import _current as _current_request
from bagstore.cache.shared import CatalogCell
from bagstore.catalog import Catalog, IndexCatalog, Placement, check_stamps
from bagstore.errors import (
    BackendError,
    BagstoreError,
    ConfigurationError,
    IndexNotReady,
    InvalidEntity,
    InvalidQuery,
    KeyMigrating,
    NoIndexForQuery,
    Retryable,
    ShardTimeout,
    StalePlacement,
)
from bagstore.ids import new_id
from bagstore.index import BUILDING, READY, RETIRED, Index, Registry
from bagstore.indexer import Change, Claim, Indexer
from bagstore.names import check_new_index, check_new_kind
from bagstore.query import (
    Plan,
    QueryResult,
    _Stream,
    execute,
    merged_eq,
    parse_filters,
    plan_query,
    shard_scans,
)
from bagstore.sharding.hashing import bucket_of
from bagstore.sharding.placer import Placer

__all__ = ["DataStore", "Datastore", "open"]

T = TypeVar("T")
R = TypeVar("R")

SQLITE_SHARD_FILE = "shard_{}.db"

log = logging.getLogger(__name__)

#: Set in the threads of a datastore's pool: work they fan out runs in place,
#: since waiting on the same (bounded) pool from inside it can deadlock.
_worker = threading.local()


def _mark_worker() -> None:
    _worker.active = True


def _check_id(entity_id: object, error: type[BagstoreError]) -> bytes:
    if type(entity_id) is not bytes:
        hint = " (use bytes.fromhex)" if isinstance(entity_id, str) else ""
        raise error(f"an id must be bytes, not {type(entity_id).__name__}{hint}")
    if len(entity_id) != 16:
        raise error(f"an id must be 16 bytes, got {len(entity_id)}")
    return entity_id


class Datastore:
    """Schema-less entities sharded over SQLite files or MariaDB/MySQL databases.

    ``shards`` is a list of URLs (``sqlite:///...``, ``mysql://...``, or
    ``host:port``); ``catalog`` an optional URL for the metadata (default: the
    first shard); ``kind`` the entities table this object reads and writes.
    ``max_body_bytes`` (default :data:`bagstore.MAX_BODY_BYTES`) is the largest
    encoded body ``put`` accepts, the same on every backend.
    A Datastore is safe to share between threads.
    """

    def __init__(
        self,
        shards: Sequence[str] | None = None,
        *,
        indexes: Iterable[Any] = (),
        catalog: str | None = None,
        kind: str = "entities",
        buckets: int | None = None,
        mysql_shards: Sequence[str] | None = None,
        mysql_user: str | None = None,
        mysql_password: str | None = None,
        mysql_database: str | None = None,
        connect_timeout: float | None = None,
        read_timeout: float | None = None,
        write_timeout: float | None = None,
        bulk_timeout: float | None = None,
        sqlite_synchronous: str = "NORMAL",
        max_body_bytes: int | None = None,
        max_workers: int | None = None,
        parallel: bool | None = None,
        refresh_interval: float = 5.0,
        unique_lease: float = 2.0,
        shard_key: str | None = None,
        shard_map: str = "hash",
        sequence_servers: Sequence[str] | None = None,
        freeze_wait: float = 5.0,
        cache: object = None,
        cache_prefix: str | None = None,
        _shard_names: Sequence[str] | None = None,
        _root: str | None = None,
    ) -> None:
        if shards is not None and mysql_shards is not None:
            raise ConfigurationError("give shards or mysql_shards, not both")
        urls = list(shards if shards is not None else (mysql_shards or ()))
        if isinstance(shards, str) or isinstance(mysql_shards, str):
            raise ConfigurationError("shards must be a list of URLs, not one string")
        if not urls:
            raise ConfigurationError("a datastore needs at least one shard URL")
        self.kind = check_identifier(kind, "kind")
        self.max_body_bytes = _body_limit(max_body_bytes)
        defaults = MySQLDefaults(
            mysql_user,
            mysql_password,
            mysql_database,
            # MySQL shards' timeouts (seconds; None: the default; docs/configuration.md)
            {
                "connect_timeout": connect_timeout,
                "read_timeout": read_timeout,
                "write_timeout": write_timeout,
                "bulk_timeout": bulk_timeout,
            },
        )
        self._backends: list[Backend] = [
            open_backend(u, mysql=defaults, sqlite_synchronous=sqlite_synchronous) for u in urls
        ]
        names = list(_shard_names) if _shard_names is not None else [b.name for b in self._backends]
        if len(set(b.name for b in self._backends)) != len(self._backends):
            raise ConfigurationError(f"the same database is listed twice among the shards {names}")
        self._catalog_backend = (
            open_backend(catalog, mysql=defaults, sqlite_synchronous=sqlite_synchronous)
            if catalog
            else self._backends[0]
        )
        self._executor: ThreadPoolExecutor | None = None
        # see _joinable: (group, alone, shards) -> (shards, schemas, backends)
        self._join_plans: dict[
            tuple[tuple[int, ...], bool, int],
            tuple[tuple[int, ...], tuple[str | None, ...], tuple[Backend, ...]],
        ] = {}
        self._max_workers = max_workers or min(32, 2 * len(self._backends))
        if parallel is not None and not isinstance(parallel, bool):
            raise ConfigurationError(f"parallel must be True, False or None, not {parallel!r}")
        self._parallel_option = parallel
        self._parallel = self._fan_out()
        self._closed = False
        self._mysql_defaults = defaults
        self._sqlite_synchronous = sqlite_synchronous
        self._root = _root
        self._freeze_wait = freeze_wait
        self._placement_lock = threading.Lock()
        self._pool_lock = threading.Lock()
        self._stats_lock = threading.Lock()
        #: how this process learned of bucket moves (see ``stats()``)
        self._placement_counts = {
            "refused": 0,
            "frozen_waits": 0,
            "full_reads": 0,
            "bucket_reads": 0,
        }
        try:
            self.catalog = Catalog(self._catalog_backend)
            self.placement: Placement = self.catalog.open(names, buckets)
            for name in self.placement.shard_names[len(self._backends) :]:
                self._backends.append(self._open_shard(name))
            self._parallel = self._fan_out()
            check_stamps(self.placement, self._backends)
            if self.catalog.read_meta().get("owned_init") != "1":
                for no, backend in enumerate(self._backends):
                    backend.claim_buckets(self.placement.buckets_of_shard(no))
                self.catalog.set_meta("owned_init", "1")
            if shard_key is not None:
                check_identifier(shard_key, "shard_key")
            known = self.catalog.kinds()
            if self.kind not in known:  # a new kind: its name must be free (bagstore.names)
                check_new_kind(self.kind, known, IndexCatalog(self._catalog_backend).all_entries())
            recorded = self.catalog.register_kind(self.kind, shard_key or "", shard_map)
            if recorded != (shard_key or "", shard_map):
                raise ConfigurationError(
                    f"kind {self.kind!r} is placed by {recorded[0] or 'id'!r} "
                    f"({recorded[1]} map), not by {shard_key or 'id'!r} ({shard_map} map)"
                )
            self._map(lambda b: b.ensure_kind(self.kind), self._backends)
            for b in self._backends:
                ensure_limits = getattr(b, "ensure_limits", None)
                if ensure_limits is not None:
                    ensure_limits()
                    self._check_body_capacity(b)
        except BaseException:
            self.close()
            raise
        self._buckets = self.placement.buckets
        self._take_placement(self.placement)
        self._refresh_interval = refresh_interval
        self._placement_at = time.monotonic()
        self._placer = Placer(self, shard_key, shard_map)
        self._sequence_servers = list(sequence_servers or ())
        self._sequences: dict[tuple[str, int, int], Any] = {}
        self._index_catalog = IndexCatalog(self._catalog_backend)
        self._registry = Registry()
        self._registry_at = 0.0
        self._tables_ready: set[str] = set()
        #: registered indexes whose table on some shard is not theirs (a kind's,
        #: from a store made before bagstore.names): neither written nor read
        self._clashing: set[str] = set()
        self._indexer = Indexer(self, unique_lease)
        self._direct_reads = False
        try:
            # level 1 always, level 2 when `cache` names one (see bagstore.cache)
            self._cache = open_layer(
                cache,
                prefix=cache_prefix or f"bs:{self.placement.store_id}:{self.kind}:",
                cell=CatalogCell(self._catalog_backend),  # the store's shared cache state
                store=self.placement.store_id,
            )
            self._direct_reads = self._cache.cache is None and not self._placer.keyed
            declared = self._check_declared(indexes)
            self._load_registry()
            for index in declared:
                self.add_index(index)
        except BaseException:
            self.close()
            raise

    # -- construction helpers -------------------------------------------------
    @classmethod
    def from_config(cls, path: str | os.PathLike[str]) -> Datastore:
        """Open the datastore a TOML file describes (see docs/configuration.md).

        >>> # bagstore.toml:  [bagstore]  path = "data/"  shards = 4
        """
        from bagstore.config import load_config

        return load_config(path)

    def _check_body_capacity(self, backend: Backend) -> None:
        """Refuse a shard whose server could not store a body of ``max_body_bytes``
        (MySQL: its ``max_allowed_packet``)."""
        if backend.max_body_bytes < self.max_body_bytes:
            raise ConfigurationError(
                f"shard {backend.name} stores bodies of at most {backend.max_body_bytes} "
                "bytes (what its server's max_allowed_packet carries, at most a MEDIUMBLOB), "
                f"under this store's max_body_bytes "
                f"of {self.max_body_bytes}: raise the server's max_allowed_packet to at least "
                f"{2 * self.max_body_bytes + 64 * 1024}, or give max_body_bytes="
                f"{backend.max_body_bytes} or less"
            )

    # -- routing ---------------------------------------------------------------
    def _open_shard(self, name: str) -> Backend:
        """A backend for a shard name the catalog lists (added after this
        process's configuration was written)."""
        if "://" not in name and not name.startswith("sqlite:"):
            if self._root is None:
                raise ConfigurationError(
                    f"cannot locate shard {name!r} outside its store directory"
                )
            name = "sqlite:///" + os.path.join(self._root, name)
        return open_backend(
            name, mysql=self._mysql_defaults, sqlite_synchronous=self._sqlite_synchronous
        )

    def _fan_out(self) -> bool:
        """Whether work over several shards runs in parallel threads: as told by
        ``parallel``, else only when the shards live on more than one server
        (threads only add a hand-off to statements that one server or one
        embedded file would run no faster side by side)."""
        if self._parallel_option is not None:
            return self._parallel_option
        return len({b.server for b in self._backends if b.server is not None}) > 1

    def refresh_placement(self, *, force: bool = False) -> Placement:
        """Re-read the bucket placement if the catalog's version moved (at most
        every ``refresh_interval`` seconds unless forced)."""
        if not force and time.monotonic() - self._placement_at < self._refresh_interval:
            return self.placement
        with self._placement_lock:
            self._placement_at = time.monotonic()
            if self.catalog.placement_version() == self.placement.version and not force:
                return self.placement
            placement = self.catalog.read_placement()
            self._count("full_reads")
            opened = placement.shard_names[len(self._backends) :]
            for name in opened:
                backend = self._open_shard(name)
                backend.ensure_kind(self.kind)
                self._backends.append(backend)
            self._parallel = self._fan_out()
            old = self.placement
            self._take_placement(placement)
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
            return placement

    def _refresh_refused(self, buckets: Iterable[int]) -> None:
        """A shard refused writes to ``buckets``: this process's placement is out
        of date for them.  Read where the catalog puts those buckets now and
        take that (one short read, where re-reading the whole placement costs
        milliseconds, a cost every write would pay during a bucket move); the
        whole placement is read instead if that tells nothing new (or names a
        shard this process has not opened).  The version is left as it was, so
        the next timed refresh still reads the whole placement."""
        wanted = sorted(set(buckets))
        self._count("refused")
        log.info(
            "a shard refused a write to bucket(s) %s: this process's placement was out of "
            "date; refreshing it and writing again",
            ", ".join(map(str, wanted[:16])) + (" ..." if len(wanted) > 16 else "") or "?",
        )
        if wanted and len(wanted) <= 16:
            self._count("bucket_reads")
            if self._learn_buckets(self.catalog.shards_of(wanted)):
                return
        self.refresh_placement(force=True)

    def _count(self, event: str) -> None:
        with self._stats_lock:
            self._placement_counts[event] += 1

    def _learn_buckets(self, now: Mapping[int, int]) -> bool:
        """Take ``{bucket: shard}`` read from the catalog into this process's
        placement (its version unchanged); False, changing nothing, if no bucket
        moved or one names a shard this process has not opened."""
        with self._placement_lock:
            placement = self.placement
            changed = {b: s for b, s in now.items() if placement.shard_of_bucket[b] != s}
            if not changed or any(s >= len(self._backends) for s in changed.values()):
                return False
            shard_of = list(placement.shard_of_bucket)
            for b, s in changed.items():
                shard_of[b] = s
            self._take_placement(replace(placement, shard_of_bucket=tuple(shard_of)))
            return True

    def _take_placement(self, placement: Placement) -> None:
        """Route by ``placement`` from now on.  ``_sole_shard`` is the shard that
        holds every bucket, when one does (None when they are spread): reads
        then go there without hashing each id."""
        shard_of = placement.shard_of_bucket
        self.placement = placement
        self._shard_of_bucket = shard_of
        self._sole_shard: int | None = (
            shard_of[0] if shard_of.count(shard_of[0]) == len(shard_of) else None
        )

    def _route(
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
        for _ in range(1000):
            groups: dict[int, list[T]] = defaultdict(list)
            for item in pending:
                groups[self._shard_of_bucket[bucket(item)]].append(item)
            jobs = [(self._backends[k], part) for k, part in groups.items()]
            outcomes = self._map(lambda job: _attempt(work, job[0], job[1]), jobs)
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
                now = time.monotonic()
                if deadline is None:
                    log.info("a bucket is frozen by a move: waiting up to %gs", self._freeze_wait)
                deadline = deadline or now + self._freeze_wait
                if now >= deadline:
                    raise last
                self._count("frozen_waits")
                time.sleep(0.005)
                self.refresh_placement(force=True)
            else:
                self._refresh_refused(bucket(item) for item in pending)
        raise StalePlacement("the placement kept changing; gave up")

    def _fenced(self, work: Callable[[], T]) -> T:
        """Run a write; when a shard says it does not own a bucket (this process's
        placement is stale), refresh and run it again; while a bucket is frozen
        by a move, wait up to ``freeze_wait`` seconds, then raise KeyMigrating."""
        deadline: float | None = None
        for _ in range(1000):
            try:
                return work()
            except StalePlacement as exc:
                self._refresh_refused(exc.buckets)
            except KeyMigrating:
                now = time.monotonic()
                if deadline is None:
                    log.info("a bucket is frozen by a move: waiting up to %gs", self._freeze_wait)
                deadline = deadline or now + self._freeze_wait
                if now >= deadline:
                    raise
                self._count("frozen_waits")
                time.sleep(0.005)
                self.refresh_placement(force=True)
        raise StalePlacement("the placement kept changing; gave up")

    def bucket_of_id(self, entity_id: bytes) -> int | None:
        """The bucket holding an entity (None if this kind does not know the id)."""
        for bucket in self._placer.group([entity_id]):
            return bucket
        return None

    def _pool(self) -> ThreadPoolExecutor:
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

    def _map(self, fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
        """``fn`` over items, in parallel threads when there is more than one and
        the shards are worth it (see ``_fan_out``); in place when called from
        one of the pool's own threads."""
        if len(items) <= 1:
            return [fn(x) for x in items]
        if not self._parallel or getattr(_worker, "active", False):
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
        futures = [self._pool().submit(fn, x) for x in items]
        # Wait for every shard before raising: no work may still be running
        # (and committing) after the caller has seen the error.
        wait(futures)
        return [f.result() for f in futures]

    def _per_shard(self, groups: Mapping[int, T], fn: Callable[[Backend, T], R]) -> dict[int, R]:
        keys = list(groups)
        results = self._map(lambda k: fn(self._backends[k], groups[k]), keys)
        return dict(zip(keys, results, strict=True))

    # -- index registry ----------------------------------------------------------
    @staticmethod
    def _check_declared(indexes: Iterable[Any]) -> list[Index]:
        declared = list(indexes)
        for index in declared:
            if not isinstance(index, Index):
                raise ConfigurationError(f"indexes must be bagstore.Index objects, not {index!r}")
        tables = [i.table for i in declared]
        if len(set(tables)) != len(tables):
            raise ConfigurationError(f"an index table is declared twice in {tables}")
        return declared

    def _load_registry(self) -> Registry:
        """Re-read this kind's indexes and states from the catalog."""
        entries = [
            (Index.from_json(definition), state)
            for _, definition, state in self._index_catalog.entries(self.kind)
        ]
        for index, state in entries:
            if state != RETIRED and index.table not in self._tables_ready | self._clashing:
                self._create_index_tables(index)
        # An index whose table is a kind's (bagstore.names) is left out: check()
        # reports it, rename_index() replaces it.
        entries = [(i, s) for i, s in entries if i.table not in self._clashing]
        self._registry = Registry(entries)
        self._registry_at = time.monotonic()
        return self._registry

    def _create_index_tables(self, index: Index) -> bool:
        """Create the index's tables; False if a shard holds another table of
        that name (nothing is written to it: the index is set aside)."""
        made = self._map(
            lambda b: b.ensure_index_table(index.table, index.properties, index.unique),
            self._backends,
        )
        if not all(made):
            self._clashing.add(index.table)
            return False
        self._tables_ready.add(index.table)
        return True

    def registry(self, *, refresh: bool = False) -> Registry:
        """This kind's indexes and states, re-read every ``refresh_interval`` seconds
        (the placement's version is checked at the same time)."""
        self.refresh_placement()
        if refresh or time.monotonic() - self._registry_at > self._refresh_interval:
            return self._load_registry()
        return self._registry

    def indexes(self) -> dict[str, tuple[Index, str]]:
        """``{table: (Index, state)}`` of every index of this kind in the catalog."""
        return dict(self.registry(refresh=True).by_table)

    def add_index(self, index: Index) -> str:
        """Register an index (idempotent); return its state.

        Its tables are created on every shard at once and every writer maintains
        it from then on.  On a kind with no entities it is ``ready`` at once;
        otherwise ``building`` until ``bagstore.Cleaner(ds).backfill(table)``.
        """
        if not isinstance(index, Index):
            raise ConfigurationError(f"add_index takes a bagstore.Index, not {index!r}")
        for name, kind, definition, state in self._index_catalog.all_entries():
            if name != index.table:
                continue
            if kind != self.kind:
                raise ConfigurationError(f"index table {name!r} already belongs to kind {kind!r}")
            if Index.from_json(definition) != index:
                raise ConfigurationError(
                    f"index {name!r} is registered as {Index.from_json(definition)!r}, not "
                    f"{index!r}: retire and drop it first, or choose another table name"
                )
            return state
        check_new_index(
            index.table, self.kind, self.catalog.kinds(), self._index_catalog.all_entries()
        )
        if not self._create_index_tables(index):
            self._clashing.discard(index.table)
            raise ConfigurationError(
                f"index table {index.table!r} (kind {self.kind!r}): a table of that name that "
                "is not this index's exists on a shard; choose another table name"
            )
        now = time.time_ns() // 1000
        self._index_catalog.register(index.table, self.kind, index.to_json(), BUILDING, now)
        self._cache.index_changed(index.table)
        if not any(self._map(lambda b: b.has_rows(self.kind), self._backends)):
            self._index_catalog.set_state(index.table, READY, now, expect=BUILDING)
        state = self.registry(refresh=True).state(index.table) or BUILDING
        log.info("index %s registered on kind %s: %s", index.table, self.kind, state)
        return state

    def set_index_state(self, table: str, state: str) -> None:
        """Move an index along its life cycle (``ready`` / ``retired``)."""
        if state not in (BUILDING, READY, RETIRED):
            raise ConfigurationError(f"unknown index state {state!r}")
        if all(n != table for n, _, _ in self._index_catalog.entries(self.kind)):
            raise ConfigurationError(f"no index {table!r} on kind {self.kind!r}")
        self._index_catalog.set_state(table, state, time.time_ns() // 1000)
        self._cache.index_changed(table)
        self.registry(refresh=True)
        log.info("index %s of kind %s: %s", table, self.kind, state)

    def retire_index(self, table: str) -> None:
        """Stop maintaining an index (queries on it raise IndexNotReady)."""
        self.set_index_state(table, RETIRED)

    @long_statements()  # statements wait bulk_timeout (a large table's DROP)
    def drop_index(self, table: str) -> None:
        """Drop a retired index's tables on every shard and forget it.

        Only a table the catalog records as this index's, with exactly its
        columns, is dropped: a name that is also a kind's (a store made before
        :mod:`bagstore.names`) loses only its index registration."""
        from bagstore.rename import forget_index

        forget_index(self, table)

    def rename_index(self, old: str, new: str, *, settle: float | None = None) -> str:
        """Replace index ``old`` by the same index under table name ``new``
        (built and backfilled, then ``old`` forgotten); return ``new``'s state.

        The way out of a name clash (``check()["clashes"]``): a table that is
        a kind's is never dropped nor written.  ``settle``: as for the Cleaner.
        """
        from bagstore.rename import rename_index

        return rename_index(self, old, new, settle=settle)

    # -- writes ------------------------------------------------------------------
    def _row(self, entity: object) -> tuple[EntityRow, bool]:
        """Validate and encode one entity; returns the row and whether the id is new."""
        if not isinstance(entity, dict):
            raise InvalidEntity(f"an entity must be a dict, not {type(entity).__name__}")
        fresh = "id" not in entity or entity["id"] is None
        if fresh:
            entity_id = new_id()
            body = codec.encode({**entity, "id": entity_id})
        else:
            entity_id = _check_id(entity["id"], InvalidEntity)
            body = codec.encode(entity)
        if len(body) > self.max_body_bytes:
            raise InvalidEntity(
                f"entity {entity_id.hex()} is {len(body)} bytes encoded, over the store's "
                f"limit of {self.max_body_bytes} bytes (max_body_bytes)"
            )
        bucket = self._placer.entity_bucket(entity, entity_id)
        row = EntityRow(entity_id, bucket, time.time_ns() // 1000, body)
        return row, fresh

    def put(self, entity: dict[str, Any]) -> bytes:
        """Store the whole entity (replacing any previous body); return its id.

        An entity without ``id`` gets a new one (:func:`bagstore.new_id`), which
        is also set in the dict passed in.
        """
        return self._put([entity])[0]

    def put_many(self, entities: Sequence[dict[str, Any]]) -> list[bytes]:
        """Store many entities: one statement (chunked) per shard, shards in parallel.

        Every entity is validated (and unique values claimed) before any entity
        is written.  The same id twice in one call keeps the last body.
        """
        if isinstance(entities, dict):
            raise InvalidEntity("put_many takes a list of entities, not one dict")
        return self._put(list(entities))

    def _put(self, entities: list[dict[str, Any]]) -> list[bytes]:
        prepared = [self._row(e) for e in entities]
        indexes = self.registry().maintained()
        last: dict[bytes, tuple[EntityRow, dict[str, Any]]] = {}
        for (row, _), entity in zip(prepared, entities, strict=True):
            last[row.id] = (row, entity)
        new_rows = {
            entity_id: {i.table: i.rows_for(entity, entity_id, self._buckets) for i in indexes}
            for entity_id, (_, entity) in last.items()
        }
        claimed = self._indexer.claim_all(
            [
                Claim(i, r)
                for entity_id in last
                for i in indexes
                if i.unique
                for r in sorted(new_rows[entity_id][i.table], key=lambda r: r.keys)
            ]
        )
        # Kinds placed by a shard key: record id -> bucket first; an entity whose
        # key moved it to another bucket is deleted from the old one afterwards.
        prior = self._placer.locate(last) if self._placer.keyed else {}
        moved = [(i, b) for i, b in prior.items() if b != last[i][0].bucket]
        self._placer.record(
            {i: row.bucket for i, (row, _) in last.items() if prior.get(i) != row.bucket}
        )
        self._cache.before_write(list(last))
        testing.hit("put.before_entity")
        # Stamped after the claims: a claim newer than its owner's `updated`
        # marks a write still in flight (see Indexer._claim).
        now = time.time_ns() // 1000
        rows = [replace(row, updated=now) for row, _ in last.values()]
        stamps: dict[bytes, int] = {}  # the `updated` of the rows replaced
        try:
            versions: dict[bytes, int] = {}  # new versions, for the cache's markers
            olds = self._route(
                rows,
                lambda r: r.bucket,
                lambda b, part: b.put_entities(
                    self.kind, part, read_old=bool(indexes), versions=versions, stamps=stamps
                ),
            )
        except Exception as exc:
            # Some shards may have committed: give back only the claims whose
            # entity does not hold the value now.  Not after a timeout (reading
            # a hung shard would make the caller wait twice; the claims lapse
            # after unique_lease), and never hiding the write's own error.
            if claimed and not isinstance(exc, ShardTimeout):
                with suppress(BackendError):
                    self._indexer.release_unheld(claimed)
            raise
        old_bodies: dict[bytes, bytes] = {}
        for part in olds:
            old_bodies.update(part)
        if moved:
            moved_stamps: dict[bytes, int] = {}
            gone = self._delete_at(moved, read_old=bool(indexes), stamps=moved_stamps)
            for i, body in gone.items():
                if body is not None and i not in old_bodies:
                    old_bodies[i] = body
                    stamps[i] = moved_stamps[i]
        testing.hit("put.after_entity")
        self._cache.puts_committed(rows, versions, self._fetch_many)
        if indexes:
            # A unique row this put removes goes only if claimed no later than
            # this put's stamp (nor the replaced body's): a writer of this
            # entity that committed after this one and regained the value
            # re-stamps the row after its commit (Indexer.apply;
            # docs/consistency.md, "Writers of the same entity at once").
            made = {c.row: c.at for c in claimed}
            changes: list[Change] = []
            for entity_id in last:
                body = old_bodies.get(entity_id)
                old = codec.decode(body) if body is not None else None
                changes += Indexer.diff(
                    indexes,
                    new_rows[entity_id],
                    old,
                    entity_id,
                    self._buckets,
                    stamp=now,
                    old_stamp=stamps.get(entity_id),
                    made=made,
                )
            self._indexer.apply(changes, failpoint="put.after_index_delete")
            self._cache.rows_written(changes, claimed, self.registry())
        for entity, (row, fresh) in zip(entities, prepared, strict=True):
            if fresh:
                entity["id"] = row.id
        return [row.id for row, _ in prepared]

    def delete(self, entity_id: bytes) -> bool:
        """Delete one entity and its index rows; False if it did not exist."""
        entity_id = _check_id(entity_id, InvalidQuery)
        return self._delete([entity_id]) == 1

    def delete_many(self, ids: Iterable[bytes]) -> int:
        """Delete many entities (shards in parallel); return how many existed."""
        if isinstance(ids, bytes):
            raise InvalidQuery("delete_many takes a list of ids, not one id")
        return self._delete([_check_id(i, InvalidQuery) for i in ids])

    def _delete(self, ids: list[bytes]) -> int:
        indexes = self.registry().maintained()
        where = {i: b for b, part in self._placer.group(ids).items() for i in part}
        versions: dict[bytes, int] = {}
        stamps: dict[bytes, int] = {}  # the deleted rows' `updated` (see _put)
        self._cache.before_write(list(where))
        now = time.time_ns() // 1000  # this delete's stamp (see _put's unique rows)
        done = self._delete_at(
            list(where.items()), read_old=bool(indexes), versions=versions, stamps=stamps
        )
        self._placer.forget(list(where))
        found = done
        if found:
            testing.hit("delete.after_entity")
        self._cache.deletes_committed(versions)
        if indexes:
            changes: list[Change] = []
            for entity_id, body in found.items():
                old = codec.decode(body) if body is not None else None
                changes += Indexer.diff(
                    indexes,
                    {},
                    old,
                    entity_id,
                    self._buckets,
                    stamp=now,
                    old_stamp=stamps.get(entity_id),
                )
            self._indexer.apply(changes)
            self._cache.rows_written(changes, (), self.registry())
        return len(found)

    # -- reads -------------------------------------------------------------------
    def get(self, entity_id: bytes) -> dict[str, Any] | None:
        """The entity with this id, or None."""
        if type(entity_id) is not bytes or len(entity_id) != 16:
            _check_id(entity_id, InvalidQuery)
        if time.monotonic() - self._placement_at >= self._refresh_interval:
            self.refresh_placement()
        if self._direct_reads and _current_request.get() is None:
            # No cache level to consult and the id alone names the bucket:
            # one statement on one shard.
            bucket = bucket_of(entity_id, self._buckets)
            body = self._backends[self._shard_of_bucket[bucket]].get_body(self.kind, entity_id)
            return None if body is None else codec.decode(body)
        return self._cache.get(entity_id, self._fetch_many)

    def _fetch_stored(self, entity_id: bytes) -> Stored | None:
        return self._fetch_many([entity_id]).get(entity_id)

    def _fetch_many(self, ids: Iterable[bytes]) -> dict[bytes, Stored]:
        """``{id: Stored}`` of the ids that exist (what the cache layer keeps)."""
        return {r[0]: Stored(r[1], r[2], r[3]) for r in self._read_rows(ids, stamps=True)}

    def _fetch_bodies(self, ids: Iterable[bytes]) -> dict[bytes, bytes]:
        """``{id: encoded body}`` of the ids that exist (reads with no cache level)."""
        return {r[0]: r[1] for r in self._read_rows(ids, stamps=False)}

    def _read_rows(self, ids: Iterable[bytes], *, stamps: bool) -> list[tuple[Any, ...]]:
        wanted = list(dict.fromkeys(ids))
        if not self._placer.keyed:  # the id names the bucket
            sole = self._sole_shard
            if sole is not None:  # and every bucket is on one shard
                return self._backends[sole].read_bodies(self.kind, wanted, stamps=stamps)
            return self._rows_at(self._placer.locate(wanted), stamps)
        rows = self._rows_at(self._placer.locate(wanted), stamps)
        found = {r[0] for r in rows}
        lost = [i for i in wanted if i not in found]
        if lost:  # a stale or missing lookup row: look everywhere
            rows += self._rows_at(self._placer.search(lost), stamps)
        return rows

    def _rows_at(self, where: Mapping[bytes, int], stamps: bool) -> list[tuple[Any, ...]]:
        """Rows (see ``Backend.read_bodies``) of ids whose buckets are known: one
        query per shard, or one for all the shards that share a server and
        login (see ``_together``)."""
        groups: dict[int, list[bytes]] = defaultdict(list)
        shard_of = self._shard_of_bucket
        for entity_id, bucket in where.items():
            groups[shard_of[bucket]].append(entity_id)
        if len(groups) == 1:
            ((shard, only),) = groups.items()
            return self._backends[shard].read_bodies(self.kind, only, stamps=stamps)

        def read(job: list[int]) -> list[tuple[Any, ...]]:
            if len(job) == 1:
                return self._backends[job[0]].read_bodies(self.kind, groups[job[0]], stamps=stamps)
            parts = [(self._backends[k], groups[k]) for k in job]
            return read_bodies_together(self.kind, parts, stamps=stamps)

        shards = list(groups)
        if len(where) <= TOGETHER_MAX_IDS:
            jobs = self._together(shards, self._backends.__getitem__)
        else:  # too many ids for one statement
            jobs = [[k] for k in shards]
        rows: list[tuple[Any, ...]] = []
        for part in self._map(read, jobs):
            rows += part
        return rows

    @staticmethod
    def _together(
        items: Sequence[T], backend_of: Callable[[T], Backend], *, scans: bool = False
    ) -> list[list[T]]:
        """Items (shard numbers) grouped so that each group's shards can be read
        in one statement (databases of one server reached with one login; with
        ``scans``, also SQLite files, whose other reads gain nothing from it:
        see ``Backend.union_reads``); the others alone, in order."""
        groups: dict[Any, list[T]] = {}
        for n, item in enumerate(items):
            backend = backend_of(item)
            key = backend.together if scans or backend.union_reads else None
            groups.setdefault(key if key is not None else ("alone", n), []).append(item)
        return list(groups.values())

    def fetch_streams(self, streams: list[_Stream]) -> None:
        """query.Source: the first page of every stream (each stream's shards
        share one connection: see scan_streams)."""
        if len(streams) == 1:
            streams[0].fetch()
        else:
            self._map(_Stream.fetch, streams)

    def _delete_at(
        self,
        located: list[tuple[bytes, int]],
        *,
        read_old: bool,
        versions: dict[bytes, int] | None = None,
        stamps: dict[bytes, int] | None = None,
    ) -> dict[bytes, bytes | None]:
        """Delete ``(id, bucket)`` entities (fenced); ``{id: old body}`` of those found
        (and their versions into ``versions``, their ``updated`` into ``stamps``,
        if given)."""

        def work(backend: Backend, part: list[tuple[bytes, int]]) -> dict[bytes, bytes | None]:
            return backend.delete_entities(
                self.kind,
                [i for i, _ in part],
                [b for _, b in part],
                read_old=read_old,
                versions=versions,
                stamps=stamps,
            )

        found: dict[bytes, bytes | None] = {}
        for part in self._route(located, lambda item: item[1], work):
            found.update(part)
        return found

    def _uncached(self) -> bool:
        """Whether reads go straight to the shards: no shared cache level and
        no request-scoped one open on this thread."""
        return self._cache.cache is None and _current_request.get() is None

    def get_many(self, ids: Iterable[bytes]) -> list[dict[str, Any] | None]:
        """Entities in the order asked (None where missing); one query per shard,
        shards in parallel.  An id asked twice gives two separate dicts."""
        if isinstance(ids, bytes):
            raise InvalidQuery("get_many takes a list of ids, not one id")
        wanted = [_check_id(i, InvalidQuery) for i in ids]
        self.refresh_placement()
        if self._uncached():
            bodies = self._fetch_bodies(wanted)
            decode = codec.decode
            return [decode(bodies[i]) if i in bodies else None for i in wanted]
        return self._cache.get_many(wanted, self._fetch_many)

    # -- queries -------------------------------------------------------------------
    def query_index(
        self,
        index: Index,
        filters: dict[str, Any],
        *,
        order: str | None = None,
        limit: int | None = None,
        cursor: str | None = None,
        allow_partial: bool = False,
    ) -> QueryResult:
        """Run a query through one index (``Index.get_all`` calls this)."""
        registry = self.registry()
        state = registry.state(index.table)
        if state is None:
            registry = self.registry(refresh=True)
            state = registry.state(index.table)
        if state is None:
            raise NoIndexForQuery(
                f"index {index.table!r} is not registered on kind {self.kind!r}: declare it in "
                f"indexes=[...] or run `{suggest.command_for(index)}`",
                suggestion=repr(index),
                index=index,
                command=suggest.command_for(index),
            )
        registered = registry.by_table[index.table][0]
        if registered is not index and registered != index:
            raise InvalidQuery(
                f"index {index.table!r} is registered as {registry.by_table[index.table][0]!r}"
            )
        if state == RETIRED or (state == BUILDING and not allow_partial):
            raise IndexNotReady(
                f"index {index.table!r} is {state}"
                + (
                    ": run `bagstore clean --index` to backfill it, or pass allow_partial=True"
                    if state == BUILDING
                    else ""
                ),
                index=index.table,
                state=state,
            )
        plan = plan_query(index, parse_filters(filters), order)
        if self._uncached():
            return execute(self, plan, limit=limit, cursor=cursor)  # no cache level
        return self._cache.read_list(
            plan,
            limit,
            cursor,
            lambda: execute(self, plan, limit=limit, cursor=cursor),
            self._fetch_many,
            cacheable=state == READY,
        )

    def query(
        self,
        *,
        order: str | None = None,
        limit: int | None = None,
        cursor: str | None = None,
        **filters: Any,
    ) -> QueryResult:
        """Query through the best ready index for these filters.

        Raises ``IndexNotReady`` if only a building index could answer, and
        ``NoIndexForQuery`` (naming an index that would) if none could.
        """
        parsed = parse_filters(filters)
        if not parsed:
            raise InvalidQuery("a query needs at least one filter")
        best: tuple[tuple[int, int, int], Plan] | None = None
        building: list[str] = []
        for index, state in self.registry().by_table.values():
            try:
                plan = plan_query(index, parsed, order)
            except InvalidQuery:
                continue
            if state == BUILDING:
                building.append(index.table)
            elif state == READY and (best is None or plan.score() > best[0]):
                best = (plan.score(), plan)
        if best is not None:
            chosen = best[1]
            return self._cache.read_list(
                chosen,
                limit,
                cursor,
                lambda: execute(self, chosen, limit=limit, cursor=cursor),
                self._fetch_many,
            )
        if building:
            raise IndexNotReady(
                f"only index {building[0]!r} can answer this query and it is still building",
                index=building[0],
                state=BUILDING,
            )
        taken = [name for name, *_ in self._index_catalog.all_entries()]
        raise suggest.no_index(parsed, order, taken=[*taken, *self.catalog.kinds()])

    @long_statements()  # reads every row: statements wait bulk_timeout
    def check(self) -> dict[str, Any]:
        """Report index rows missing and stale, per index; changes nothing.

        Returns ``{"missing": n, "stale": m, "indexes": {table: {"state",
        "missing", "stale", "examples"}}, "clashes": [...]}`` over every building
        or ready index; ``clashes`` lists names that meet another's (an index
        named like a kind's table, see :mod:`bagstore.names`), each with its remedy.
        """
        from bagstore.check import check

        return check(self)

    # query.Source
    def scan_streams(self, plan: Plan, page: int) -> list[_Stream]:
        scans = shard_scans(
            plan, self._backends, self._shard_of_bucket, self._buckets, self._sole_shard
        )
        backends = self._backends
        groups = self._scan_groups(list(scans))
        # A kind placed by the index's shard_on value (hashed, as index rows are)
        # keeps each entity beside its index rows: joining the other databases
        # would only add lookups that find nothing (~10 us a row on MariaDB).
        placer = self._placer
        beside = placer.shard_key == plan.index.shard_on and placer.directory is None
        # With no cache level, a stream reads the bodies of its rows' entities in
        # its own statement (LEFT JOIN with the entity tables its connection
        # reaches), saving a second round trip: when it is the only stream, or
        # when the entities sit beside their index rows.  Streams of several
        # servers each read past their share of the page (see first_page), and
        # half or more of their rows' entities live on another server.
        join = self._uncached() and (len(groups) == 1 or beside)
        streams = []
        for group in groups:
            scan = scans[group[0]]
            if len(group) > 1:
                scan.eq = merged_eq([scans[k].eq for k in group])
                scan.parts = tuple(str(backends[k].schema) for k in group)
            if join:
                joined, schemas, reach = self._joinable(group, beside)
                scan.join_kind, scan.join = self.kind, schemas
            else:
                joined, reach = (), tuple(backends[k] for k in group[1:])
            streams.append(
                _Stream(
                    backends[group[0]],
                    scan,
                    page,
                    shards=len(group),
                    joined=joined,
                    reach=reach,
                    shard_of_bucket=self._shard_of_bucket,
                )
            )
        return streams

    def _scan_groups(self, shards: list[int]) -> list[tuple[int, ...]]:
        """The shards to scan, grouped so that one statement reads each group's
        index tables (see ``_together``), at most as many as one statement may
        name."""
        if len(shards) == 1:  # a query that gives its shard_on value
            return [(shards[0],)]
        out: list[tuple[int, ...]] = []
        for group in self._together(shards, self._backends.__getitem__, scans=True):
            size = self._backends[group[0]].max_together or len(group)
            out += [tuple(group[n : n + size]) for n in range(0, len(group), size)]
        return out

    def _joinable(
        self, group: tuple[int, ...], alone: bool
    ) -> tuple[tuple[int, ...], tuple[str | None, ...], tuple[Backend, ...]]:
        """The shards whose entity tables a scan of ``group`` joins: ``group``
        (its first shard is scanned on its own connection), then (unless
        ``alone``) the other shards its connection reaches (the databases of one
        server and login, SQLite files; as many as one statement may name);
        their ``schema`` names (None: the first one); and the backends of all
        but the first.  Kept until a shard is added."""
        backends = self._backends
        key = (group, alone, len(backends))
        known = self._join_plans.get(key)
        if known is not None:
            return known
        lead = backends[group[0]]
        shards = list(group)
        if not alone and lead.together is not None:
            shards += [
                k for k, b in enumerate(backends) if k not in group and b.together == lead.together
            ]
            # (a group is never longer than max_together: see _scan_groups)
            shards = shards[: lead.max_together]  # the rest are read by id afterwards
        plan = (
            tuple(shards),
            (None, *(backends[k].schema for k in shards[1:])),
            tuple(backends[k] for k in shards[1:]),
        )
        self._join_plans[key] = plan
        return plan

    def fetch_for_query(self, ids: Sequence[bytes]) -> dict[bytes, dict[str, Any]]:
        if self._uncached():
            decode = codec.decode
            return {r[0]: decode(r[1]) for r in self._read_rows(ids, stamps=False)}
        return self._cache.decoded(list(dict.fromkeys(ids)), self._fetch_many)

    # -- scale-out -----------------------------------------------------------------
    def add_shard(self, url: str) -> int:
        """Register a new, empty shard (a database URL); return its number.
        Move buckets to it with :meth:`move_buckets` or :meth:`rebalance`."""
        from bagstore.scaleout import Mover

        return Mover(self).add_shard(url)

    def move_buckets(
        self,
        buckets: Sequence[int],
        to: int | str,
        *,
        grace: float | None = None,
        duty: float | None = None,
        max_rate: float | None = None,
        batch: int | None = None,
    ) -> Any:
        """Move buckets to a shard while serving (see :mod:`bagstore.scaleout`);
        ``grace``: seconds to keep the source copy for stale readers (default
        ``refresh_interval`` + 1); ``duty``: pause after each copy step, in units
        of its duration (default 0.5; 0: flat out); ``max_rate``: rows per
        second; ``batch``: rows per copy or delete statement (default 10)."""
        return self._mover(grace, duty, max_rate, batch).move(buckets, to)

    def rebalance(
        self,
        *,
        grace: float | None = None,
        duty: float | None = None,
        max_rate: float | None = None,
        batch: int | None = None,
    ) -> Any:
        """Move buckets until every shard holds an even share (paced as
        :meth:`move_buckets`); returns MoveStats."""
        return self._mover(grace, duty, max_rate, batch).rebalance()

    def _mover(
        self, grace: float | None, duty: float | None, max_rate: float | None, batch: int | None
    ) -> Any:
        from bagstore.scaleout import DEFAULT_BATCH, DEFAULT_DUTY, Mover

        return Mover(
            self,
            grace=grace,
            duty=DEFAULT_DUTY if duty is None else duty,
            max_rate=max_rate,
            batch=DEFAULT_BATCH if batch is None else batch,
        )

    def migrate_key(self, value: object, to_bucket: int, *, wait: float | None = None) -> int:
        """Move one shard key's entities to another bucket (``shard_map='directory'``
        kinds); writes to the key get KeyMigrating meanwhile.  Returns how many
        entities moved."""
        from bagstore.scaleout import Mover

        return Mover(self).migrate_key(value, to_bucket, wait=wait)

    # -- ids -----------------------------------------------------------------------
    def sequence(self, name: str, *, block: int = 1000, start: int = 1) -> Any:
        """An integer id sequence shared by every process of this store (see
        :mod:`bagstore.ids.sequence`); ``.next()`` and ``.next_many(n)``."""
        from bagstore.ids.sequence import open_sequence

        key = (name, block, start)
        if key not in self._sequences:
            self._sequences[key] = open_sequence(self, name, block=block, start=start)
        return self._sequences[key]

    # -- status and lifetime ---------------------------------------------------------
    @property
    def shards(self) -> tuple[str, ...]:
        return tuple(b.name for b in self._backends)

    @long_statements()  # a COUNT(*) of a large table: bulk_timeout
    def count(self) -> int:
        """Entities of this kind over all shards: a bucket in an unfinished move
        counts once, on the shard that owns it (see :mod:`bagstore.owners`)."""
        return sum(self._counts())

    def _counts(self) -> list[int]:
        """Entities of this kind per shard, each bucket counted on its owner only."""
        from bagstore.owners import unfinished_moves

        moves = unfinished_moves(self)

        def on(shard: int) -> int:
            backend = self._backends[shard]
            n = backend.count(self.kind)
            return n - len(moves.ids_on(backend, shard, self.kind)) if moves else n

        return self._map(on, range(len(self._backends)))

    def status(self) -> dict[str, Any]:
        """Shards, buckets per shard and entity counts (one query per shard); for
        SQLite files, the library's version and whether it has the WAL-reset bug."""
        counts = self._counts()
        embedded = any(b.dialect.name == "sqlite" for b in self._backends)
        return {
            "kind": self.kind,
            "buckets": self._buckets,
            "shards": [
                {
                    "shard": i,
                    "name": b.name,
                    "buckets": self._shard_of_bucket.count(i),
                    "entities": counts[i],
                }
                for i, b in enumerate(self._backends)
            ],
            "entities": sum(counts),
            **({"cache": self._cache.status()} if self._cache.cache is not None else {}),
            **({"sqlite": _sqlite_library()} if embedded else {}),
        }

    # -- cache -----------------------------------------------------------------------
    def request(self) -> AbstractContextManager[Any]:
        """A level-1 cache for the block: what it reads is kept for its duration
        (``with ds.request(): ...``; see :mod:`bagstore.cache.request`)."""
        return _request()

    def stats(self) -> dict[str, dict[str, int]]:
        """Counters since open: the cache's per level (``"l1"``, ``"l2"``: hits,
        misses, fills, invalidations, errors) and ``"placement"``, how this
        process followed bucket moves: ``refused`` (writes a shard refused
        because this process's placement was stale, then retried),
        ``frozen_waits`` (5 ms waits for a bucket frozen by a move),
        ``full_reads`` (whole placements read from the catalog) and
        ``bucket_reads`` (refusals answered by reading only the refused
        buckets' shards).

            >>> import bagstore, tempfile
            >>> ds = bagstore.open(tempfile.mkdtemp(), shards=2)
            >>> ds.stats()["placement"]
            {'refused': 0, 'frozen_waits': 0, 'full_reads': 0, 'bucket_reads': 0}
            >>> ds.close()
        """
        with self._stats_lock:
            placement = dict(self._placement_counts)
        return {**self._cache.stats.as_dict(), "placement": placement}

    def close(self) -> None:
        """Close every connection; the datastore cannot be used afterwards."""
        if self._closed:
            return
        self._closed = True
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        if getattr(self, "_cache", None) is not None:
            self._cache.close()
        for b in {
            id(b): b for b in [*getattr(self, "_backends", []), self._catalog_backend]
        }.values():
            b.close()

    def __enter__(self) -> Datastore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<bagstore.Datastore kind={self.kind!r} shards={len(self._backends)}>"


def _sqlite_library() -> dict[str, Any]:
    """The SQLite library this process uses, and whether it has the WAL-reset
    bug (see docs/configuration.md)."""
    import sqlite3

    from bagstore.backends.sqlite import has_wal_reset_bug

    return {"version": sqlite3.sqlite_version, "wal_reset_bug": has_wal_reset_bug()}


def _body_limit(value: object) -> int:
    """``max_body_bytes`` checked (None: :data:`bagstore.MAX_BODY_BYTES`)."""
    if value is None:
        return codec.MAX_BODY_BYTES
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 10**9:
        raise ConfigurationError(  # 10**9: SQLite's own longest value
            f"max_body_bytes must be a number of bytes from 1 to 1000000000, not {value!r}"
        )
    return value


def _attempt(
    work: Callable[[Backend, list[T]], R], backend: Backend, items: list[T]
) -> tuple[R | None, Retryable | None]:
    """``(result, None)``, or ``(None, error)`` when the shard refused the
    write for routing reasons (other errors propagate)."""
    try:
        return work(backend, items), None
    except (StalePlacement, KeyMigrating) as exc:
        return None, exc


#: FriendFeed's spelling: ``DataStore(mysql_shards=["127.0.0.1:3306", ...], indexes=[...])``.
DataStore = Datastore


def open(
    path: str | os.PathLike[str],
    indexes: Iterable[Any] = (),
    shards: int | None = None,
    **kwargs: Any,
) -> Datastore:
    """The embedded default: a store of SQLite files under the directory ``path``.

    ``shards`` is how many files a new store gets (default 4); an existing store
    keeps the number it was created with.
    """
    from bagstore.backends.sqlite import SQLiteBackend

    root = os.fspath(path)
    if shards is not None and (
        not isinstance(shards, int) or isinstance(shards, bool) or shards < 1
    ):
        raise ConfigurationError(f"shards must be a positive integer, not {shards!r}")
    os.makedirs(root, exist_ok=True)
    first = os.path.join(root, SQLITE_SHARD_FILE.format(0))
    existing: int | None = None
    if os.path.exists(first):
        probe = SQLiteBackend(first)
        try:
            existing = Catalog(probe).stored_shard_count()
        finally:
            probe.close()
    if existing is not None and shards is not None and shards != existing:
        raise ConfigurationError(
            f"the store in {root!r} has {existing} shards; {shards} were asked for"
        )
    # An existing store lists its shards (some maybe added later) in its catalog,
    # which lives in the first file: name only that one.
    count = 1 if existing else (shards or 4)
    files = [SQLITE_SHARD_FILE.format(i) for i in range(count)]
    urls = ["sqlite:///" + os.path.join(root, f) for f in files]
    return Datastore(urls, indexes=indexes, _shard_names=files, _root=root, **kwargs)
