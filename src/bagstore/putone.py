"""The put of one entity whose whole write is one transaction on one shard.

Most puts are one entity of a kind placed by its id, on a store whose index
rows live on the entity's shard (every store of one shard: the embedded
default, a one-server store).  Such a put needs none of the general write
path's machinery (:mod:`bagstore.writes`): no unique claims made before the
entity, no lookup row, no entity moving between shards, no rows left to
write after the commit, one shard to group by.  :func:`put_one` writes it
straight: validate and encode, one ``put_entities`` transaction holding the
entity and its index rows (the old body read and the rows diffed under the
row's lock, as :mod:`bagstore.colocated` does), then the cache's
bookkeeping.  The statements are the general path's; what goes is its
per-call Python (the general path costs a single put about as much CPU
again as the SQL does on SQLite).  What the short path needs of the kind's
indexes and the placement (:class:`Plan`) is worked out once for each
registry and topology the store reads, not at every put.

It returns None, having written nothing, when the put is not of that shape
or the shard refused it (a bucket moved or frozen): the general path then
does the whole write, with its refresh and waits.

    >>> import bagstore, tempfile
    >>> by_user = bagstore.Index(table="posts_by_user", properties=["user_id"])
    >>> ds = bagstore.open(tempfile.mkdtemp(), shards=1, kind="posts", indexes=[by_user])
    >>> post = {"user_id": 7, "title": "hello"}
    >>> put_one(ds._writes, post) == post["id"]
    True
    >>> [p["title"] for p in by_user.get_all(ds, user_id=7)]
    ['hello']
    >>> ds.close()
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from bagstore import codec, testing
from bagstore.backends.entities import EntityRow, entity_row
from bagstore.errors import KeyMigrating, StalePlacement
from bagstore.indexer import Change, Indexer
from bagstore.sharding.hashing import bucket_of

if TYPE_CHECKING:
    from bagstore.backends import Backend
    from bagstore.backends.indexsql import IndexRow
    from bagstore.index import Index, Registry
    from bagstore.sharding.topology import Topology
    from bagstore.writes import Writes

__all__ = ["put_one"]


class Plan:
    """What the short path needs of one registry and one topology, worked out
    once (both are replaced, never changed, when they are re-read)."""

    __slots__ = ("backend", "indexes", "registry", "topology")

    def __init__(self, registry: Registry, topology: Topology) -> None:
        self.registry = registry
        self.topology = topology
        self.indexes: list[Index] = registry.maintained()
        #: the shard of every index row, or None when the put is not short
        #: (rows on other shards, or unique claims to make before the entity)
        self.backend: Backend | None = None
        sole = topology.sole_shard
        if sole is not None and not any(i.unique for i in self.indexes):
            self.backend = topology.backends[sole]


def put_one(writes: Writes, entity: Any) -> bytes | None:
    """Store one entity by the short path if its put is one transaction on
    one shard; its id, or None (nothing written) to leave it to the general
    path.  Raises what the general path raises for bad input."""
    if writes.placer.shard_key is not None:  # a lookup row, maybe a move between shards
        return None
    registry = writes.registry()
    topology = writes.router.topology
    plan = writes.short_plan
    if plan is None or plan.registry is not registry or plan.topology is not topology:
        plan = writes.short_plan = Plan(registry, topology)
    indexes = plan.indexes
    backend = plan.backend
    if indexes and backend is None:
        return None  # rows on other shards, or claims before the entity
    entity_id, body, fresh = writes._body(entity)
    buckets = topology.buckets
    bucket = bucket_of(entity_id, buckets)
    row: EntityRow = entity_row((entity_id, bucket, time.time_ns() // 1000, body))
    cache = writes.cache
    leases = cache.cache is not None  # a shared cache level to lease keys in
    if leases:
        cache.before_write([entity_id])
    if backend is None:
        backend = topology.backend_of(bucket)
    versions: dict[bytes, int] = {}
    made: list[list[Change]] = [[]]  # the index diff, made under the row's lock
    within = None
    held: list[int] = []  # the index rows' buckets (a loop: no comprehension's frame)
    if indexes:
        new_rows: dict[str, set[IndexRow]] = {}
        for index in indexes:
            rows = new_rows[index.table] = index.rows_for(entity, entity_id, buckets)
            for r in rows:
                held.append(r.bucket)
        shard = backend

        def within(cur: Any, old: Mapping[bytes, bytes | None]) -> None:
            body = old.get(entity_id)
            prev = codec.decode(body) if body is not None else None
            diff = made[0] = Indexer.diff(indexes, new_rows, prev, entity_id, buckets)
            Indexer.write_in(shard, cur, diff, held)  # (a transaction run again: made again)

    testing.hit("put.before_entity")
    try:
        backend.put_entities(
            writes.kind,
            [row],
            read_old=bool(indexes),
            versions=versions if leases else None,  # (only the shared level's markers)
            within=within,
            fence=held,
        )
    except StalePlacement as exc:  # rolled back: learn where the bucket is now,
        writes.router.refresh_refused(exc.buckets)  # and the general path writes there
        return None
    except KeyMigrating:
        return None  # rolled back: the general path waits for the move
    testing.hit("put.after_entity")
    idle = cache.idle()  # (no level to tell: the two calls below would do nothing)
    if not idle:
        cache.puts_committed([row], versions, writes.fetch_many)
    if indexes:
        testing.hit("put.after_index_delete")  # (every row is written already)
        if not idle:
            cache.rows_written(made[0], (), registry)
    if fresh:
        entity["id"] = entity_id
    return entity_id
