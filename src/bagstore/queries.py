"""Queries: the index that answers, the plan, and its run through the cache.

``Datastore.query_index`` (what ``Index.get_all`` calls) and ``Datastore.query``
(the best ready index for the filters) are here; :func:`bagstore.query.execute`
runs a plan over the shards that :class:`bagstore.reads.Reads` scans.

    >>> import bagstore, tempfile
    >>> ds = bagstore.open(tempfile.mkdtemp(), indexes=[bagstore.Index("index_n", ["n"])])
    >>> _ = ds.put({"n": 1})
    >>> [e["n"] for e in ds.query(n=1)]
    [1]
    >>> ds.close()
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from bagstore import suggest
from bagstore.errors import IndexNotReady, InvalidQuery, NoIndexForQuery
from bagstore.index import BUILDING, READY, RETIRED, Index
from bagstore.query import Plan, QueryResult, execute, parse_filters, plan_query

if TYPE_CHECKING:
    from bagstore.index_tables import IndexTables
    from bagstore.reads import Reads

__all__ = ["Queries"]


class Queries:
    """The queries of one kind: its indexes (``tables``) read through ``reads``."""

    def __init__(self, kind: str, tables: IndexTables, reads: Reads) -> None:
        self.kind = kind
        self.tables = tables
        self.reads = reads

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
        if not isinstance(index, Index):
            raise InvalidQuery(f"query_index takes a bagstore.Index, not {index!r}")
        registry = self.tables.registry()
        state = registry.state(index.table)
        if state is None:
            registry = self.tables.registry(refresh=True)
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
        if self.reads.uncached():  # no cache level
            return self.reads.on_replicas(
                lambda: execute(self.reads, plan, limit=limit, cursor=cursor)
            )
        return self.reads.cache.read_list(
            plan,
            limit,
            cursor,
            lambda: execute(self.reads, plan, limit=limit, cursor=cursor),
            self.reads.fetch_many,
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
        for index, state in self.tables.registry().by_table.values():
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
            return self.reads.cache.read_list(
                chosen,
                limit,
                cursor,
                lambda: self.reads.on_replicas(
                    lambda: execute(self.reads, chosen, limit=limit, cursor=cursor)
                ),
                self.reads.fetch_many,
            )
        if building:
            raise IndexNotReady(
                f"only index {building[0]!r} can answer this query and it is still building",
                index=building[0],
                state=BUILDING,
            )
        taken = [name for name, *_ in self.tables.catalog.all_entries()]
        raise suggest.no_index(parsed, order, taken=[*taken, *self.tables.store_catalog.kinds()])
