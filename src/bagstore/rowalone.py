"""The write of an entity that is its row alone, and the ``Conflict`` of a
conditional write: :class:`RowAlone`, mixed into :class:`bagstore.writes.Writes`.

An entity's write is its row alone when the kind has no index to maintain,
no lookup row (placed by its id) and no shared cache level to lease keys in.
A conditional put of such an entity that already exists is one fenced
``UPDATE ... WHERE version = expected`` (:meth:`RowAlone.update_row`), which
``put(..., expect_version=v)`` and ``update(id, fn)``
(:mod:`bagstore.conditional`) reach without the general write path; where
that row is (:meth:`RowAlone.alone_route`) is worked out once for each
registry and topology the store reads.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from bagstore import testing
from bagstore.backends import EntityRow, Stored
from bagstore.errors import Conflict
from bagstore.sharding.hashing import bucket_of

if TYPE_CHECKING:
    from bagstore.backends import Backend
    from bagstore.cache.layer import CacheLayer
    from bagstore.index import Registry
    from bagstore.sharding.placer import Placer
    from bagstore.sharding.router import Router

__all__ = ["Memo", "RowAlone", "conflict"]

#: :meth:`RowAlone.alone_route`'s memo: the registry, the topology, the route.
Memo = tuple[object, object, "tuple[Backend | None, tuple[Backend, ...]]"]


class RowAlone:
    """The row-alone conditional write of :class:`bagstore.writes.Writes`."""

    # Provided by Writes:
    kind: str
    router: Router
    placer: Placer
    cache: CacheLayer
    registry: Callable[[], Registry]
    fetch_many: Callable[[Iterable[bytes]], dict[bytes, Stored]]
    buckets: int
    _route: Memo

    def _body(self, entity: object) -> tuple[bytes, bytes, bool]:
        raise NotImplementedError

    def alone(self) -> bool:
        """Whether an entity's write is its row alone: no index to maintain, no
        lookup row, no shared cache level to lease keys in.  (The registry is
        asked each time: it re-reads the placement and the indexes when due.)"""
        return self._alone_in(self.registry())

    def _alone_in(self, registry: Registry) -> bool:
        if self.placer.shard_key is not None or self.cache.cache is not None:
            return False
        return not registry.by_table or not registry.maintained()

    def alone_route(self) -> tuple[Backend | None, tuple[Backend, ...]]:
        """Where the row of an entity whose write is its row alone (see
        :meth:`alone`) is: ``(backend, ())`` when one shard holds every bucket
        and its update binds no bucket (no id need be hashed), else ``(None,
        backend of each bucket)`` (``Topology.backend_by_bucket``); ``(None,
        ())`` when the write is not the row alone.  Worked out once for each
        registry and topology the store reads (both are replaced, never
        changed), the registry asked each time as ``alone`` asks it."""
        registry = self.registry()
        topology = self.router.topology
        memo = self._route
        if memo[0] is not registry or memo[1] is not topology:
            route: tuple[Backend | None, tuple[Backend, ...]] = (None, ())
            by_bucket = topology.backend_by_bucket
            if by_bucket and self._alone_in(registry):
                # (a bucket need not be hashed where the statement fences on
                # the row's own: see EntitySQL.fences_by_row)
                sole = by_bucket[0] if topology.sole_shard is not None else None
                fenced = sole is not None and sole.dialect.fences_by_row
                route = (sole, ()) if fenced else (None, by_bucket)
            memo = self._route = (registry, topology, route)
        return memo[2]

    def update_one(
        self, entity: dict[str, Any], expect: Mapping[bytes, int], bucket: int | None = None
    ) -> bytes | None:
        """A conditional put of one existing entity that is its row alone (see
        :meth:`alone`): :meth:`update_row` after the checks and the encoding of
        :meth:`row`, on the shard of ``bucket`` (as for :meth:`row`: the
        entity's, when the caller hashed its id already); None where
        ``update_row`` gives up, or the entity is new."""
        entity_id, body, fresh = self._body(entity)
        expected = expect.get(entity_id, 0)
        if fresh or expected <= 0:
            return None
        if bucket is None:
            bucket = self.placer.entity_bucket(entity, entity_id)
        topology = self.router.topology
        by_bucket = topology.backend_by_bucket
        backend = by_bucket[bucket] if by_bucket else topology.backend_of(bucket)
        return entity_id if self.update_row(backend, entity_id, bucket, body, expected) else None

    def update_row(
        self, backend: Backend, entity_id: bytes, bucket: int | None, body: bytes, expected: int
    ) -> bool:
        """Write the encoded ``body`` of an existing entity whose write is its
        row alone (see :meth:`alone`) if its version is still ``expected``:
        one ``UPDATE ... WHERE version = expected`` on ``backend``, fenced by
        the row's bucket (``bucket``, the id's: None only where the backend's
        dialect ``fences_by_row``).  If
        it changed nothing, the row is read: at another version, that is the
        ``Conflict``; else (no row, or a bucket not owned) False, and the
        whole write path finds out why.  (A copy left on a shard that let the
        bucket go takes no write, so its version is still the one expected:
        it never passes for a conflict.)  An :class:`EntityRow` is made only
        for a cache level to tell."""
        updated = time.time_ns() // 1000
        testing.hit("put.before_entity")
        version = backend.update_row_if(
            self.kind, entity_id, bucket, updated, body, expected, moves=False
        )
        if not version:
            found = backend.read_bodies(self.kind, [entity_id], stamps=True)
            if found and int(found[0][2]) != expected:
                raise conflict({entity_id: int(found[0][2])}, [], "put")
            return False
        testing.hit("put.after_entity")
        cache = self.cache
        if not cache.idle():
            if bucket is None:
                bucket = bucket_of(entity_id, self.buckets)
            row = EntityRow(entity_id, bucket, updated, body)
            cache.puts_committed([row], {entity_id: version}, self.fetch_many)
        return True


def conflict(refused: Mapping[bytes, int], written: list[bytes], what: str) -> Conflict:
    """The ``Conflict`` of a conditional write refused for ``refused``."""
    first = min(refused)
    more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
    return Conflict(
        f"conditional {what} refused: entity {first.hex()} is at version {refused[first]}"
        f"{' (absent)' if refused[first] == 0 else ''}{more}; {len(written)} written",
        id=first,
        found=refused[first],
        refused=dict(refused),
        written=written,
    )
