"""The datastore facade: put / get / get_many / delete over sharded backends.

>>> import bagstore, tempfile
>>> with bagstore.open(tempfile.mkdtemp()) as ds:
...     entity_id = ds.put({"title": "hello"})
...     ds.get(entity_id)["title"]
'hello'
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from functools import cached_property
from typing import Any

from bagstore import codec
from bagstore.backends import Backend, MySQLDefaults, Stored, check_identifier
from bagstore.backends.pool import long_statements
from bagstore.cache import open_layer
from bagstore.cache import request as _request
from bagstore.cache.shared import CatalogCell
from bagstore.catalog import Catalog, IndexCatalog, Placement
from bagstore.changes import ChangePage, Feed
from bagstore.conditional import DEFAULT_RETRIES, Conditional, expectations, expecting
from bagstore.errors import (
    ConfigurationError,
    InvalidEntity,
    InvalidQuery,
)
from bagstore.index import RETIRED, Index, Registry
from bagstore.index_tables import IndexTables
from bagstore.indexer import Indexer
from bagstore.opening import (
    SQLITE_SHARD_FILE,
    check_body_capacity,
    open_router,
    prepare_kind,
    sqlite_store,
)
from bagstore.queries import Queries
from bagstore.query import QueryResult
from bagstore.reads import Reads
from bagstore.sharding.failover import failover
from bagstore.sharding.placer import Placer
from bagstore.sharding.replicas import Replication
from bagstore.sharding.topology import ShardOpener
from bagstore.status import shard_counts, store_status
from bagstore.subscriber import Handler, Subscriber
from bagstore.writes import Writes, check_id, check_ids

__all__ = ["SQLITE_SHARD_FILE", "DataStore", "Datastore", "open"]


class Datastore:
    """Schema-less entities sharded over SQLite files or MariaDB/MySQL databases.

    ``shards`` is a list of URLs (``sqlite:///...``, ``mysql://...``, or
    ``host:port``); ``catalog`` an optional URL for the metadata (default: the
    first shard); ``kind`` the entities table this object reads and writes;
    ``shard_map="global"`` keeps the kind in one database (``global_at``, by
    default one beside the catalog's: see docs/tables.md).
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
        global_at: str | None = None,
        sequence_servers: Sequence[str] | None = None,
        freeze_wait: float = 5.0,
        cache: object = None,
        cache_prefix: str | None = None,
        read_from: str = "primary",
        max_lag: float | None = None,
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
        self.max_body_bytes = codec.body_limit(max_body_bytes)
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
        reads = Replication(read_from=read_from, max_lag=max_lag)  # docs/replication.md
        opener = ShardOpener(defaults, sqlite_synchronous, _root, reads)
        self._closed = False
        backends: list[Backend] = []
        self._opened = backends  # closed by close() until the router owns them
        backends += [opener.open(u) for u in urls]
        names = list(_shard_names) if _shard_names is not None else [b.name for b in backends]
        if len(set(b.name for b in backends)) != len(backends):
            raise ConfigurationError(f"the same database is listed twice among the shards {names}")
        catalog_backend = opener.open(catalog) if catalog else backends[0]
        self._opened_catalog = catalog_backend
        if parallel is not None and not isinstance(parallel, bool):
            raise ConfigurationError(f"parallel must be True, False or None, not {parallel!r}")
        self.sequence_servers = list(sequence_servers or ())
        try:  # the placement, the router and the kind's checks (bagstore.opening)
            self.catalog = Catalog(catalog_backend)
            placement, self.router = open_router(
                self.catalog,
                names,
                buckets,
                backends,
                opener,
                refresh_interval=refresh_interval,
                freeze_wait=freeze_wait,
                parallel=parallel,
                max_workers=max_workers or min(32, 2 * len(urls)),
            )
            prepare_kind(
                self.router,
                placement,
                backends,
                self.kind,
                shard_key=shard_key,
                shard_map=shard_map,
                global_at=global_at,
                max_body_bytes=self.max_body_bytes,
            )
        except BaseException:
            self.close()
            raise
        kind = self.kind
        self.router.on_new_shard = lambda backend: backend.ensure_kind(kind)
        self.placer = Placer(self.router, self.kind, shard_key, shard_map)
        self._sequences: dict[tuple[str, int, int], Any] = {}
        self.index_catalog = IndexCatalog(catalog_backend)
        try:
            # level 1 always, level 2 when `cache` names one (see bagstore.cache)
            self.cache_layer = open_layer(
                cache,
                prefix=cache_prefix or f"bs:{placement.store_id}:{self.kind}:",
                cell=CatalogCell(catalog_backend),  # the store's shared cache state
                store=placement.store_id,
            )
            self.index_tables = IndexTables(
                self.kind, self.router, self.catalog, self.index_catalog, self.cache_layer
            )
            self._reads = Reads(self.kind, self.router, self.placer, self.cache_layer)
            self.indexer = Indexer(self.router, unique_lease, self._reads.fetch_many)
            self._writes = Writes(
                self.kind,
                self.router,
                self.placer,
                self.indexer,
                self.cache_layer,
                self.index_tables.registry,  # (what self.registry calls: one call less a put)
                self._reads.fetch_many,
                self.max_body_bytes,
            )
            self._queries = Queries(self.kind, self.index_tables, self._reads)
            self._conditional = Conditional(self._writes, self.placer, self._reads.fetch_versioned)
            declared = IndexTables.check_declared(indexes)
            self.index_tables.load()
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

    def check_body_capacity(self, backend: Backend) -> None:
        """Refuse a shard whose server could not store a body of ``max_body_bytes``
        (MySQL: its ``max_allowed_packet``)."""
        check_body_capacity(backend, self.max_body_bytes)

    def bucket_of_id(self, entity_id: bytes) -> int | None:
        """The bucket holding an entity (None if this kind does not know the id)."""
        for bucket in self.placer.group([check_id(entity_id, InvalidQuery)]):
            return bucket
        return None

    # -- routing (bagstore.sharding.router) ---------------------------------------
    @property
    def placement(self) -> Placement:
        """The bucket placement this process routes by (see ``router``)."""
        return self.router.placement

    def refresh_placement(self, *, force: bool = False) -> Placement:
        """Re-read the bucket placement if the catalog's version moved (at most
        every ``refresh_interval`` seconds unless forced)."""
        return self.router.refresh(force=force)

    # -- indexes (bagstore.index_tables) ---------------------------------------------
    def registry(self, *, refresh: bool = False) -> Registry:
        """This kind's indexes and states, re-read every ``refresh_interval`` seconds
        (the placement's version is checked at the same time)."""
        return self.index_tables.registry(refresh=refresh)

    def indexes(self) -> dict[str, tuple[Index, str]]:
        """``{table: (Index, state)}`` of every index of this kind in the catalog."""
        return dict(self.registry(refresh=True).by_table)

    def add_index(self, index: Index) -> str:
        """Register an index (idempotent); return its state.

        Its tables are created on every shard at once and every writer maintains
        it from then on.  On a kind with no entities it is ``ready`` at once;
        otherwise ``building`` until ``bagstore.Cleaner(ds).backfill(table)``.
        """
        return self.index_tables.add(index)

    def set_index_state(self, table: str, state: str) -> None:
        """Move an index along its life cycle (``ready`` / ``retired``)."""
        self.index_tables.set_state(table, state)

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

    # -- writes (bagstore.writes) ------------------------------------------------
    def put(self, entity: dict[str, Any], *, expect_version: int | None = None) -> bytes:
        """Store the whole entity (replacing any previous body); return its id.

        An entity without ``id`` gets a new one (:func:`bagstore.new_id`), which
        is also set in the dict passed in.  ``expect_version``: write only if
        the stored version is that (0: only if absent), else raise
        :class:`bagstore.Conflict` (see :mod:`bagstore.conditional`).
        """
        return self._writes.put([entity], expectations([entity], expect_version))[0]

    def put_many(
        self, entities: Sequence[dict[str, Any]], *, expect_versions: Any = None
    ) -> list[bytes]:
        """Store many entities: one statement (chunked) per shard, shards in parallel.

        Every entity is validated (and unique values claimed) before any entity
        is written.  The same id twice in one call keeps the last body.
        ``expect_versions`` (``{id: version}``): each shard is written only if
        all its entities' conditions hold (``Conflict`` lists the rest).
        """
        if isinstance(entities, dict):
            raise InvalidEntity("put_many takes a list of entities, not one dict")
        entities = list(entities)
        return self._writes.put(entities, expectations(entities, None, expect_versions))

    def delete(self, entity_id: bytes, *, expect_version: int | None = None) -> bool:
        """Delete one entity and its index rows; False if it did not exist.
        ``expect_version``: only if it is at that version (``Conflict``)."""
        entity_id = check_id(entity_id, InvalidQuery)
        return self._writes.delete([entity_id], expecting(entity_id, expect_version)) == 1

    def get_with_version(self, entity_id: bytes) -> tuple[dict[str, Any], int] | None:
        """``(entity, version)`` from the shard holding it (never a cache), or None."""
        return self._conditional.get_with_version(check_id(entity_id, InvalidQuery))

    def update(self, entity_id: bytes, fn: Any, *, retries: int = DEFAULT_RETRIES) -> Any:
        """Read, ``fn(entity)``, put if unchanged meanwhile, retry on ``Conflict``;
        the entity stored (see :meth:`bagstore.conditional.Conditional.update`)."""
        return self._conditional.update(entity_id, fn, retries)

    def delete_many(self, ids: Iterable[bytes]) -> int:
        """Delete many entities (shards in parallel); return how many existed."""
        return self._writes.delete(check_ids(ids, "delete_many"))

    # -- change feed (bagstore.changes, bagstore.subscriber) ------------------------
    @cached_property
    def feed(self) -> Feed:
        """This kind's change feed: ``enable()``, ``disable()``, ``consumers()``."""
        return Feed(self.kind, self.router)

    def changes(
        self, since: str | None = None, limit: int = 1000, *, kind: str | None = None
    ) -> ChangePage:
        """Committed writes after the cursor ``since``, in order (docs/changes.md)."""
        return self.feed.other(kind).changes(since, limit)

    def subscribe(
        self, name: str, handler: Handler, *, kind: str | None = None, batch: int = 100,
        lease: float = 30.0,
    ) -> Subscriber:  # fmt: skip
        """A process of the named consumer ``name`` (:mod:`bagstore.subscriber`)."""
        return Subscriber(self.feed.other(kind), name, handler, batch=batch, lease=lease)

    # -- reads (bagstore.reads) ----------------------------------------------------
    def get(self, entity_id: bytes, *, read_from: str | None = None) -> dict[str, Any] | None:
        """The entity with this id, or None (``read_from``: docs/replication.md)."""
        if type(entity_id) is not bytes or len(entity_id) != 16:
            check_id(entity_id, InvalidQuery)
        return self._reads.get(entity_id, read_from)

    def get_many(
        self, ids: Iterable[bytes], *, read_from: str | None = None
    ) -> list[dict[str, Any] | None]:
        """Entities in the order asked (None where missing); one query per shard,
        shards in parallel.  An id asked twice gives two separate dicts."""
        return self._reads.get_many(check_ids(ids, "get_many"), read_from)

    def fetch_many(self, ids: Iterable[bytes]) -> dict[bytes, Stored]:
        """``{id: Stored}`` (body, version, ``updated``) of the ids that exist, as
        their shards hold them now, past every cache level (for the Cleaner and
        the index writer)."""
        return self._reads.fetch_many(ids)

    def existing(self, ids: Iterable[bytes]) -> set[bytes]:
        """The ids that exist, as their shards hold them now, past every cache
        level, with no body read (for the Cleaner's sweep)."""
        return self._reads.existing(ids)

    # -- queries (bagstore.queries) ------------------------------------------------
    def query_index(
        self,
        index: Index,
        filters: dict[str, Any],
        *,
        order: str | None = None,
        limit: int | None = None,
        cursor: str | None = None,
        allow_partial: bool = False,
        read_from: str | None = None,
    ) -> QueryResult:
        """Run a query through one index (``Index.get_all`` calls this)."""
        with self._reads.reading(read_from):
            return self._queries.query_index(
                index, filters, order=order, limit=limit, cursor=cursor, allow_partial=allow_partial
            )

    def query(
        self,
        *,
        order: str | None = None,
        limit: int | None = None,
        cursor: str | None = None,
        read_from: str | None = None,
        **filters: Any,
    ) -> QueryResult:
        """Query through the best ready index for these filters.

        Raises ``IndexNotReady`` if only a building index could answer, and
        ``NoIndexForQuery`` (naming an index that would) if none could.
        """
        with self._reads.reading(read_from):
            return self._queries.query(order=order, limit=limit, cursor=cursor, **filters)

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
        """Move one shard key's entities to another bucket, in every kind placed
        by that key through the directory (``shard_map='directory'``); writes
        to the key get KeyMigrating meanwhile.  Returns how many entities moved."""
        from bagstore.scaleout import Mover

        return Mover(self).migrate_key(value, to_bucket, wait=wait)

    def failover(self, shard: int | str, *, to: str | None = None, **options: Any) -> Any:
        """Make replica ``to`` a shard's primary (docs/replication.md)."""
        return failover(self.router, shard, to=to, **options)

    # -- ids -----------------------------------------------------------------------
    def sequence(self, name: str, *, block: int = 1000, start: int = 1) -> Any:
        """An integer id sequence shared by every process of this store (see
        :mod:`bagstore.ids.sequence`); ``.next()`` and ``.next_many(n)``."""
        from bagstore.ids.sequence import open_sequence

        if not (isinstance(name, str) and type(block) is type(start) is int):
            return open_sequence(self, name, block=block, start=start)  # (it names what is wrong)
        key = (name, block, start)
        if key not in self._sequences:
            self._sequences[key] = open_sequence(self, name, block=block, start=start)
        return self._sequences[key]

    # -- status and lifetime ---------------------------------------------------------
    @property
    def shards(self) -> tuple[str, ...]:
        return tuple(b.name for b in self.router.backends)

    @long_statements()  # a COUNT(*) of a large table: bulk_timeout
    def count(self) -> int:
        """Entities of this kind over all shards: a bucket in an unfinished move
        counts once, on the shard that owns it (see :mod:`bagstore.owners`)."""
        return sum(shard_counts(self.router, self.kind))

    def status(self) -> dict[str, Any]:
        """Shards, buckets per shard and entity counts (one query per shard);
        ``index_writes``: which indexes are written with their entity
        (:mod:`bagstore.colocated`); SQLite's version and WAL-reset bug."""
        counts = shard_counts(self.router, self.kind)
        return store_status(
            self.router, self.kind, counts, self.registry, self.placer.shard_key, self.cache_layer
        )

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
        buckets' shards); ``"reads"`` per server and ``"replicas"`` (see
        docs/replication.md).

            >>> import bagstore, tempfile
            >>> ds = bagstore.open(tempfile.mkdtemp(), shards=2)
            >>> ds.stats()["placement"]
            {'refused': 0, 'frozen_waits': 0, 'full_reads': 0, 'bucket_reads': 0}
            >>> ds.close()
        """
        replicas = self.router.replication.stats()  # "reads" per server, "replicas"
        return {**self.cache_layer.stats.as_dict(), "placement": self.router.counts(), **replicas}

    def close(self) -> None:
        """Close every connection; the datastore cannot be used afterwards."""
        if self._closed:
            return
        self._closed = True
        if getattr(self, "cache_layer", None) is not None:
            self.cache_layer.close()
        if getattr(self, "router", None) is not None:
            self.router.close()
        else:  # failed before the router took the backends
            opened = [*self._opened, getattr(self, "_opened_catalog", None)]
            for b in {id(b): b for b in opened if b is not None}.values():
                b.close()

    def __enter__(self) -> Datastore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<bagstore.Datastore kind={self.kind!r} shards={len(self.router.backends)}>"


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
    root, files = sqlite_store(path, shards)  # (bagstore.opening)
    urls = ["sqlite:///" + os.path.join(root, f) for f in files]
    return Datastore(urls, indexes=indexes, _shard_names=files, _root=root, **kwargs)
