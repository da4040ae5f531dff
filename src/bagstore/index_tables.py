"""The indexes of one kind: registered in the catalog, created on every shard.

:class:`IndexTables` keeps the kind's :class:`~bagstore.index.Registry`
(indexes and their states), re-read every ``refresh_interval`` seconds, and
creates an index's tables on every shard (through the router) before anyone
writes them.  ``Datastore.add_index``, ``set_index_state`` and ``registry``
call it.

    >>> import bagstore, tempfile
    >>> ds = bagstore.open(tempfile.mkdtemp())
    >>> ds.add_index(bagstore.Index("index_n", ["n"]))
    'ready'
    >>> ds.close()
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from bagstore.errors import ConfigurationError
from bagstore.index import BUILDING, READY, RETIRED, Index, Registry
from bagstore.names import check_new_index

if TYPE_CHECKING:
    from bagstore.cache.layer import CacheLayer
    from bagstore.catalog import Catalog, IndexCatalog
    from bagstore.sharding.router import Router

__all__ = ["IndexTables"]

#: The facade's logger name, kept (docs/configuration.md).
log = logging.getLogger("bagstore.datastore")


class IndexTables:
    """One kind's indexes: their registrations (``catalog``), their tables on
    the shards (``tables_ready``; ``clashing``: registered indexes whose table
    on some shard is not theirs -- a kind's, from a store made before
    :mod:`bagstore.names` -- neither written nor read) and the registry."""

    def __init__(
        self,
        kind: str,
        router: Router,
        store_catalog: Catalog,
        catalog: IndexCatalog,
        cache: CacheLayer,
    ) -> None:
        self.kind = kind
        self.router = router
        self.store_catalog = store_catalog
        self.catalog = catalog
        self.cache = cache
        self.tables_ready: set[str] = set()
        self.clashing: set[str] = set()
        self._registry = Registry()
        self._registry_at = 0.0

    @staticmethod
    def check_declared(indexes: Iterable[Any]) -> list[Index]:
        if isinstance(indexes, str | bytes | Index) or not isinstance(indexes, Iterable):
            raise ConfigurationError(
                f"indexes must be a list of bagstore.Index objects, not {indexes!r}"
            )
        declared = list(indexes)
        for index in declared:
            if not isinstance(index, Index):
                raise ConfigurationError(f"indexes must be bagstore.Index objects, not {index!r}")
        tables = [i.table for i in declared]
        if len(set(tables)) != len(tables):
            raise ConfigurationError(f"an index table is declared twice in {tables}")
        return declared

    def load(self) -> Registry:
        """Re-read this kind's indexes and states from the catalog."""
        entries = [
            (Index.from_json(definition), state)
            for _, definition, state in self.catalog.entries(self.kind)
        ]
        for index, state in entries:
            if state != RETIRED and index.table not in self.tables_ready | self.clashing:
                self.create_tables(index)
        # An index whose table is a kind's (bagstore.names) is left out: check()
        # reports it, rename_index() replaces it.
        entries = [(i, s) for i, s in entries if i.table not in self.clashing]
        self._registry = Registry(entries)
        self._registry_at = time.monotonic()
        return self._registry

    def create_tables(self, index: Index) -> bool:
        """Create the index's tables; False if a shard holds another table of
        that name (nothing is written to it: the index is set aside)."""
        made = self.router.on_all(
            lambda b: b.ensure_index_table(index.table, index.properties, index.unique)
        )
        if not all(made):
            self.clashing.add(index.table)
            return False
        self.tables_ready.add(index.table)
        return True

    def registry(self, *, refresh: bool = False) -> Registry:
        """This kind's indexes and states, re-read every ``refresh_interval`` seconds
        (the placement's version is checked at the same time)."""
        self.router.refresh()
        if refresh or time.monotonic() - self._registry_at > self.router.refresh_interval:
            return self.load()
        return self._registry

    def add(self, index: Index) -> str:
        """Register an index (idempotent); return its state.

        Its tables are created on every shard at once and every writer maintains
        it from then on.  On a kind with no entities it is ``ready`` at once;
        otherwise ``building`` until ``bagstore.Cleaner(ds).backfill(table)``.
        """
        if not isinstance(index, Index):
            raise ConfigurationError(f"add_index takes a bagstore.Index, not {index!r}")
        for name, kind, definition, state in self.catalog.all_entries():
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
            index.table, self.kind, self.store_catalog.kinds(), self.catalog.all_entries()
        )
        if not self.create_tables(index):
            self.clashing.discard(index.table)
            raise ConfigurationError(
                f"index table {index.table!r} (kind {self.kind!r}): a table of that name that "
                "is not this index's exists on a shard; choose another table name"
            )
        now = time.time_ns() // 1000
        self.catalog.register(index.table, self.kind, index.to_json(), BUILDING, now)
        self.cache.index_changed(index.table)
        if not any(self.router.on_all(lambda b: b.has_rows(self.kind))):
            self.catalog.set_state(index.table, READY, now, expect=BUILDING)
        state = self.registry(refresh=True).state(index.table) or BUILDING
        log.info("index %s registered on kind %s: %s", index.table, self.kind, state)
        return state

    def set_state(self, table: str, state: str) -> None:
        """Move an index along its life cycle (``ready`` / ``retired``)."""
        if state not in (BUILDING, READY, RETIRED):
            raise ConfigurationError(f"unknown index state {state!r}")
        if all(n != table for n, _, _ in self.catalog.entries(self.kind)):
            raise ConfigurationError(f"no index {table!r} on kind {self.kind!r}")
        self.catalog.set_state(table, state, time.time_ns() // 1000)
        self.cache.index_changed(table)
        self.registry(refresh=True)
        log.info("index %s of kind %s: %s", table, self.kind, state)
