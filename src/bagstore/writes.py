"""The write path: put and delete, top to bottom.

A put, in order (docs/consistency.md tells why each step comes where it does):

1. :meth:`Writes.rows_of` validates and encodes each entity; the placer names
   its bucket.
2. The indexer claims its unique values (each claim a fenced statement on the
   shard owning the value's bucket, through :meth:`Router.on_bucket`).
3. The placer records ``id -> bucket`` for kinds placed by a shard key.
4. The router runs one ``put_entities`` per shard (:meth:`Router.by_bucket`:
   fenced; a refusal refreshes the topology and retries only the refused part).
5. The cache layer learns what committed; the indexer deletes the old index
   rows and inserts the new ones (fenced, through the router again).

Two shorter paths skip what they do not need: the put of one entity whose
write is one transaction on one shard (:mod:`bagstore.putone`), and the
conditional put of an entity whose write is its row alone
(:mod:`bagstore.rowalone`, mixed into :class:`Writes`).

    >>> import bagstore, tempfile
    >>> ds = bagstore.open(tempfile.mkdtemp())
    >>> ds.delete(ds.put({"n": 1}))
    True
    >>> ds.close()
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from contextlib import suppress
from itertools import filterfalse
from operator import attrgetter, itemgetter
from typing import TYPE_CHECKING, Any, cast

from bagstore import codec, testing
from bagstore.backends import EntityRow, Stored
from bagstore.backends.entities import entity_rows
from bagstore.colocated import Colocated
from bagstore.errors import (
    BackendError,
    BagstoreError,
    InvalidEntity,
    InvalidQuery,
    ShardTimeout,
)
from bagstore.ids import new_id
from bagstore.indexer import Change, Claim, Indexer
from bagstore.putone import Plan, put_one
from bagstore.rowalone import Memo, RowAlone, conflict
from bagstore.sharding.hashing import bucket_list

if TYPE_CHECKING:
    from bagstore.backends import Backend
    from bagstore.backends.indexsql import IndexRow
    from bagstore.cache.layer import CacheLayer
    from bagstore.index import Index, Registry
    from bagstore.sharding.placer import Placer
    from bagstore.sharding.router import Router

__all__ = ["Writes", "check_id", "conflict"]

_FIRST, _SECOND, _THIRD = (itemgetter(k) for k in range(3))


def check_id(entity_id: object, error: type[BagstoreError]) -> bytes:
    """``entity_id`` if it is 16 bytes, else ``error``."""
    if type(entity_id) is not bytes:
        hint = " (use bytes.fromhex)" if isinstance(entity_id, str) else ""
        raise error(f"an id must be bytes, not {type(entity_id).__name__}{hint}")
    if len(entity_id) != 16:
        raise error(f"an id must be 16 bytes, got {len(entity_id)}")
    return entity_id


def check_ids(ids: object, what: str) -> list[bytes]:
    """``ids`` (an iterable of 16-byte ids) as a list, else InvalidQuery
    naming the method ``what``."""
    if isinstance(ids, bytes | str) or not isinstance(ids, Iterable):
        raise InvalidQuery(f"{what} takes a list of ids, not {type(ids).__name__}")
    return [check_id(i, InvalidQuery) for i in ids]


class Writes(RowAlone):
    """Puts and deletes of one kind.

    ``registry`` gives the kind's current indexes; ``fetch_many`` reads rows as
    their shards hold them (for the cache's markers)."""

    def __init__(
        self,
        kind: str,
        router: Router,
        placer: Placer,
        indexer: Indexer,
        cache: CacheLayer,
        registry: Callable[[], Registry],
        fetch_many: Callable[[Iterable[bytes]], dict[bytes, Stored]],
        max_body_bytes: int,
    ) -> None:
        self.kind = kind
        self.router = router
        self.placer = placer
        self.indexer = indexer
        self.cache = cache
        self.registry = registry
        self.fetch_many = fetch_many
        self.max_body_bytes = max_body_bytes
        self.buckets = router.placement.buckets
        #: the short put's view of the current registry and topology
        #: (:class:`bagstore.putone.Plan`), remade when either is replaced
        self.short_plan: Plan | None = None
        #: :meth:`alone_route`'s registry, topology and answer
        self._route: Memo = (None, None, (None, ()))

    def row(self, entity: object, bucket: int | None = None) -> tuple[EntityRow, bool]:
        """Validate and encode one entity; returns the row and whether the id
        is new.  ``bucket``: the entity's, when the caller hashed its id
        already (a kind placed by its id)."""
        entity_id, body, fresh = self._body(entity)
        if bucket is None:
            bucket = self.placer.entity_bucket(cast("dict[str, Any]", entity), entity_id)
        return EntityRow(entity_id, bucket, time.time_ns() // 1000, body), fresh

    def rows_of(
        self, entities: list[dict[str, Any]]
    ) -> tuple[list[bytes], list[int], list[bytes], list[bool]]:
        """:meth:`row` of each entity, as the lists of their ids, buckets,
        bodies and whether each id is new (the stamp is the write's, taken
        later): the same checks in the same order, the buckets of a kind
        placed by id hashed in one loop."""
        body_of = self._body
        if self.placer.shard_key is not None:  # each entity's bucket after its checks
            entity_bucket = self.placer.entity_bucket
            made = []
            buckets = []
            for entity in entities:
                made.append(body_of(entity))
                buckets.append(entity_bucket(entity, made[-1][0]))
            ids = [m[0] for m in made]
        else:
            made = list(map(body_of, entities))  # (id, body, fresh) each
            ids = list(map(_FIRST, made))
            buckets = bucket_list(ids, self.router.placement.buckets)
        return ids, buckets, list(map(_SECOND, made)), list(map(_THIRD, made))

    def _body(self, entity: object) -> tuple[bytes, bytes, bool]:
        """Validate and encode one entity: its id, its body, whether the id is new."""
        if not isinstance(entity, dict):
            raise InvalidEntity(f"an entity must be a dict, not {type(entity).__name__}")
        entity_id = entity.get("id")
        fresh = entity_id is None
        if fresh:
            entity_id = new_id()
            body = codec.encode({**entity, "id": entity_id})
        else:
            if type(entity_id) is not bytes or len(entity_id) != 16:
                entity_id = check_id(entity_id, InvalidEntity)
            body = codec.encode(entity)
        if len(body) > self.max_body_bytes:
            raise self.too_big(entity_id, body)
        return entity_id, body, fresh

    def too_big(self, entity_id: bytes, body: bytes) -> InvalidEntity:
        """The error of an entity whose encoded ``body`` is over the store's limit."""
        return InvalidEntity(
            f"entity {entity_id.hex()} is {len(body)} bytes encoded, over the store's "
            f"limit of {self.max_body_bytes} bytes (max_body_bytes)"
        )

    def put(
        self, entities: list[dict[str, Any]], expect: Mapping[bytes, int] | None = None
    ) -> list[bytes]:
        """Store entities; with ``expect`` (``{id: version}``, checked by the
        caller: see :mod:`bagstore.conditional`) only on the shards where every
        entity has the version expected, raising ``Conflict`` for the rest."""
        if len(entities) == 1:
            if expect is None:
                done = put_one(self, entities[0])
            else:
                done = self.update_one(entities[0], expect) if self.alone() else None
            if done is not None:
                return [done]
        return self.put_general(entities, expect)

    def put_general(
        self, entities: list[dict[str, Any]], expect: Mapping[bytes, int] | None = None
    ) -> list[bytes]:
        """:meth:`put` by the general path, whatever the entities.  (Apart
        from :meth:`put`, whose short paths then run without this method's
        frame: its locals and its closures' cells, made on entry, cost a
        short put ~2% of its instructions.)"""
        ids, buckets, bodies, fresh = self.rows_of(entities)
        indexes = self.registry().maintained()
        # {id: (bucket, body, entity)}, the last of an id (at its first place)
        last = dict(zip(ids, zip(buckets, bodies, entities, strict=True), strict=True))
        new_rows = self.index_rows(indexes, last)
        uniques = [i for i in indexes if i.unique]
        claimed = self.indexer.claim_all(
            [
                Claim(i, r)
                for entity_id in last
                for i in uniques
                for r in sorted(new_rows[entity_id][i.table], key=lambda r: r.keys)
            ]
            if uniques
            else []
        )
        # Kinds placed by a shard key: record id -> bucket first; an entity whose
        # key moved it to another bucket is deleted from the old one afterwards.
        prior = self.placer.locate(last) if self.placer.keyed else {}
        # (A move between buckets of one shard rewrites the same row in place.)
        shard_of = self.router.topology.shard_of_bucket
        moved = [
            (i, b)
            for i, b in prior.items()
            if b != last[i][0] and shard_of[b] != shard_of[last[i][0]]
        ]
        recorded = (
            {i: b for i, (b, _, _) in last.items() if prior.get(i) != b}
            if self.placer.keyed
            else {}
        )
        # A lookup row on the entity's shard goes into its transaction; the
        # others are written first, as the entity's index rows elsewhere after.
        ahead = {i: b for i, b in recorded.items() if not self._beside(self.placer.id_bucket(i), b)}
        self.placer.record(ahead)
        along = {i: b for i, b in recorded.items() if i not in ahead}
        together = Colocated(self.router, self.placer, self.kind, indexes)
        skip = frozenset(i for i, _ in moved)
        # A conditional put that moves an entity checks its old copy's version.
        carried = self.versions_at([m for m in moved if m[0] in expect]) if expect and moved else {}
        if expect is None:
            self.cache.before_write(list(last))
        testing.hit("put.before_entity")
        # Stamped after the claims: a claim newer than its owner's `updated`
        # marks a write still in flight (see Indexer._claim).
        now = time.time_ns() // 1000
        rows = entity_rows(last, map(_FIRST, last.values()), now, map(_SECOND, last.values()))
        stamps: dict[bytes, int] = {}  # the `updated` of the rows replaced
        refused: dict[bytes, int] = {}  # conditional: {id: version found}
        unwritten: set[bytes] = set()  # conditional: the refused shards' ids

        leases = self.cache.cache is not None  # a shared cache level to lease keys in

        def write(backend: Backend, part: list[EntityRow]) -> dict[bytes, bytes]:
            ids = [r.id for r in part]
            fence = together.fence(backend, ids, new_rows)
            within = together.within(
                backend,
                ids,
                new_rows,
                skip=skip,
                lookups=along,
                locked=fence,
                # a conditional put's cache lease: once its conditions held
                before=None
                if expect is None or not leases
                else lambda: self.cache.before_write(ids),
            )
            if expect is None:
                return backend.put_entities(
                    self.kind,
                    part,
                    read_old=bool(indexes),
                    versions=versions if leases else None,  # (only the shared level's markers)
                    stamps=stamps,
                    within=within,
                    fence=fence,
                )
            old = backend.put_entities(
                self.kind,
                part,
                read_old=bool(indexes),
                versions=versions,
                stamps=stamps,
                expect={i: expect[i] for i in ids if i in expect},
                carried={i: carried[i] for i in ids if i in carried},
                refused=refused,
                within=within,
                fence=fence,
            )
            if any(i in refused for i in ids):
                unwritten.update(ids)
            return old

        try:
            versions: dict[bytes, int] = {}  # new versions, for the cache's markers
            olds = self.router.by_bucket(rows, attrgetter("bucket"), write)
        except Exception as exc:
            # Some shards may have committed: give back only the claims whose
            # entity does not hold the value now.  Not after a timeout (reading
            # a hung shard would make the caller wait twice; the claims lapse
            # after unique_lease), and never hiding the write's own error.
            if claimed and not isinstance(exc, ShardTimeout):
                with suppress(BackendError):
                    self.indexer.release_unheld(claimed)
            raise
        self.placer.remember(together.recorded)
        self.placer.record(together.late)  # lookup rows whose bucket moved meanwhile
        if unwritten:
            claimed = self._undo(unwritten, claimed, ahead, prior)
            rows = [r for r in rows if r.id not in unwritten]
            moved = [m for m in moved if m[0] not in unwritten]
        old_bodies: dict[bytes, bytes] = {}
        for part in olds:
            old_bodies.update(part)
        if moved:
            moved_stamps: dict[bytes, int] = {}
            # (change feed) the put is the move's one change: no delete recorded
            gone = self.delete_at(moved, read_old=bool(indexes), stamps=moved_stamps, record=False)
            for i, body in gone.items():
                if body is not None and i not in old_bodies:
                    old_bodies[i] = body
                    stamps[i] = moved_stamps[i]
        testing.hit("put.after_entity")
        self.cache.puts_committed(rows, versions, self.fetch_many)
        if indexes:
            # A unique row this put removes goes only if claimed no later than
            # this put's stamp (nor the replaced body's): a writer of this
            # entity that committed after this one and regained the value
            # re-stamps the row after its commit (Indexer.apply;
            # docs/consistency.md, "Writers of the same entity at once").
            made = {c.row: c.at for c in claimed}
            changes: list[Change] = []  # every row changed, for the cache
            rest: list[Change] = []  # those not written in the entity's transaction
            # the diffs made in the transactions serve when no index is unique
            reuse = not together.unique
            known = together.diffs if reuse else {}
            # every row of an entity in `whole` was written in its transaction
            # (its diff in `known`, or in `written` for those that had no row)
            whole = together.whole if reuse else frozenset()
            if whole:
                changes += together.written(unwritten)
                for entity_id, diff in known.items():
                    if entity_id in whole and entity_id not in unwritten:
                        changes += diff
            for entity_id in filterfalse(whole.__contains__, last):
                if entity_id in unwritten:
                    continue
                mine = known.get(entity_id)
                if mine is None:
                    body = old_bodies.get(entity_id)
                    old = codec.decode(body) if body is not None else None
                    mine = Indexer.diff(
                        indexes,
                        new_rows[entity_id],
                        old,
                        entity_id,
                        self.buckets,
                        stamp=now,
                        old_stamp=stamps.get(entity_id),
                        made=made,
                    )
                changes += mine
                rest += together.rest(mine, entity_id)
            self.indexer.apply(rest, failpoint="put.after_index_delete")
            self.cache.rows_written(changes, claimed, self.registry())
        if True in fresh:
            for entity, entity_id, new in zip(entities, ids, fresh, strict=True):
                if new and entity_id not in unwritten:
                    entity["id"] = entity_id
        if unwritten:
            raise conflict(refused, [r.id for r in rows], "put")
        return ids

    def index_rows(
        self, indexes: list[Index], last: Mapping[bytes, tuple[int, bytes, dict[str, Any]]]
    ) -> dict[bytes, dict[str, set[IndexRow]]]:
        """``{id: {table: the entity's index rows}}``, an index at a time."""
        pairs = list(zip(last, map(_THIRD, last.values()), strict=True))
        if len(indexes) == 1:  # (the common case: one dict an entity, made at once)
            (index,) = indexes
            table = index.table
            made_all = index.rows_for_many(pairs, self.buckets)
            return {i: {table: m} for i, m in zip(last, made_all, strict=True)}
        out: dict[bytes, dict[str, set[IndexRow]]] = {i: {} for i in last}
        for index in indexes:
            table = index.table
            for (entity_id, _), made in zip(
                pairs, index.rows_for_many(pairs, self.buckets), strict=True
            ):
                out[entity_id][table] = made
        return out

    def _beside(self, bucket: int, other: int) -> bool:
        """Whether two buckets are on one shard (by this process's placement)."""
        shard_of = self.router.topology.shard_of_bucket
        return shard_of[bucket] == shard_of[other]

    def _undo(
        self,
        unwritten: set[bytes],
        claimed: list[Claim],
        recorded: Mapping[bytes, int],
        prior: Mapping[bytes, int],
    ) -> list[Claim]:
        """After a conditional put refused on some shards: give back the unique
        values its unwritten entities claimed and their lookup rows; return
        the claims of the entities written."""
        self.indexer.release([c for c in claimed if c.row.entity_id in unwritten])
        back = {i: prior[i] for i in recorded if i in unwritten and i in prior}
        self.placer.record(back)
        self.placer.forget([i for i in recorded if i in unwritten and i not in prior])
        return [c for c in claimed if c.row.entity_id not in unwritten]

    def versions_at(self, located: list[tuple[bytes, int]]) -> dict[bytes, int]:
        """``{id: version}`` of ``(id, bucket)`` entities found there, read with
        their rows locked (a write still committing is waited for)."""

        def work(backend: Backend, part: list[tuple[bytes, int]]) -> dict[bytes, Stored]:
            return backend.read_locked(self.kind, [i for i, _ in part], [b for _, b in part])

        out: dict[bytes, int] = {}
        for found in self.router.by_bucket(located, lambda item: item[1], work):
            out.update({i: s.version for i, s in found.items()})
        return out

    def delete(self, ids: list[bytes], expect: Mapping[bytes, int] | None = None) -> int:
        """Delete entities; with ``expect`` (``{id: version}``) only on the
        shards where every one has the version expected (``Conflict``)."""
        indexes = self.registry().maintained()
        where = {i: b for b, part in self.placer.group(ids).items() for i in part}
        versions: dict[bytes, int] = {}
        stamps: dict[bytes, int] = {}  # the deleted rows' `updated` (see put)
        refused: dict[bytes, int] = {}
        unwritten: set[bytes] = set()
        if expect is None:
            self.cache.before_write(list(where))
        else:  # an id found nowhere has no version
            refused.update({i: 0 for i, v in expect.items() if i not in where and v != 0})
        now = time.time_ns() // 1000  # this delete's stamp (see put's unique rows)
        together = Colocated(self.router, self.placer, self.kind, indexes)
        found = self.delete_at(
            list(where.items()),
            read_old=bool(indexes),
            versions=versions,
            stamps=stamps,
            expect=expect,
            refused=refused,
            unwritten=unwritten,
            together=together,
        )
        self.placer.forget([i for i in where if i not in unwritten])
        if found:
            testing.hit("delete.after_entity")
        self.cache.deletes_committed(versions)
        if indexes:
            changes: list[Change] = []
            rest: list[Change] = []
            for entity_id, body in found.items():
                old = codec.decode(body) if body is not None else None
                mine = Indexer.diff(
                    indexes,
                    {},
                    old,
                    entity_id,
                    self.buckets,
                    stamp=now,
                    old_stamp=stamps.get(entity_id),
                )
                changes += mine
                rest += together.rest(mine, entity_id)
            self.indexer.apply(rest)
            self.cache.rows_written(changes, (), self.registry())
        if refused:
            raise conflict(refused, list(found), "delete")
        return len(found)

    def delete_at(
        self,
        located: list[tuple[bytes, int]],
        *,
        read_old: bool,
        versions: dict[bytes, int] | None = None,
        stamps: dict[bytes, int] | None = None,
        record: bool = True,
        expect: Mapping[bytes, int] | None = None,
        refused: dict[bytes, int] | None = None,
        unwritten: set[bytes] | None = None,
        together: Colocated | None = None,
    ) -> dict[bytes, bytes | None]:
        """Delete ``(id, bucket)`` entities (fenced); ``{id: old body}`` of those found
        (and their versions into ``versions``, their ``updated`` into ``stamps``,
        if given).  With ``expect``: a shard where an id has another version
        deletes nothing (``refused`` gets ``{id: found}``, ``unwritten`` the
        shard's ids), and the cache's lease is taken only where the
        conditions held.  ``together``: the index rows on each entity's shard
        are deleted in its transaction (see :mod:`bagstore.colocated`).
        ``record=False``: no change in the change feed."""

        def work(backend: Backend, part: list[tuple[bytes, int]]) -> dict[bytes, bytes | None]:
            ids = [i for i, _ in part]
            lease = None if expect is None else lambda: self.cache.before_write(ids)
            within = None
            if together is not None:
                within = together.within(backend, ids, None, before=lease)
            elif lease is not None:
                within = lambda cur, old: lease()  # noqa: E731
            found = backend.delete_entities(
                self.kind,
                ids,
                [b for _, b in part],
                read_old=read_old,
                versions=versions,
                stamps=stamps,
                record=record,
                expect=None if expect is None else {i: expect[i] for i in ids if i in expect},
                refused=refused,
                within=within,
            )
            if expect is not None:
                assert refused is not None and unwritten is not None
                if any(i in refused for i in ids):
                    unwritten.update(ids)
            return found

        found: dict[bytes, bytes | None] = {}
        for part in self.router.by_bucket(located, lambda item: item[1], work):
            found.update(part)
        return found
