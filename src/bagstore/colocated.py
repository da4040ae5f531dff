"""One commit when the rows live together: index rows and lookup rows written
in the entity's own transaction.

An entity's index rows live on the shard that owns the bucket of their
``shard_on`` value, and a kind placed by a shard key keeps an ``id -> bucket``
lookup row on the bucket of the id's hash.  When such a row lives on the same
shard as the entity (every row of a one-shard store; every row of an index
whose ``shard_on`` is the property the kind is placed by, since both are the
key's bucket), the write path writes it inside the transaction that writes
the entity (:meth:`bagstore.backends.Backend.put_entities`' ``within``): the
entity and those rows commit together or not at all.  Rows on other shards
are written as before, after the commit (docs/consistency.md).  Unique
indexes keep their claims (made before the entity) and are never written
here.

    >>> import bagstore, tempfile
    >>> by_user = bagstore.Index(table="posts_by_user", properties=["user_id"])
    >>> ds = bagstore.open(tempfile.mkdtemp(), kind="posts", shard_key="user_id",
    ...                    indexes=[by_user])
    >>> ds.status()["index_writes"]["posts_by_user"]
    'atomic'
    >>> ds.close()
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from operator import itemgetter
from typing import TYPE_CHECKING, Any

from bagstore import codec
from bagstore.indexer import Change, Indexer

if TYPE_CHECKING:
    from bagstore.backends import Backend
    from bagstore.backends.indexsql import IndexRow
    from bagstore.index import Index
    from bagstore.sharding.placer import Placer
    from bagstore.sharding.router import Router

__all__ = ["AFTER", "ATOMIC", "PARTLY", "Colocated", "atomicity"]

_BUCKET = itemgetter(2)  # an IndexRow's bucket

#: How an index's rows are written relative to their entity (``status()``).
ATOMIC = "atomic"
PARTLY = "atomic where a row's bucket is on the entity's shard, else after the entity"
AFTER = "after the entity"


def atomicity(indexes: Sequence[Index], shard_key: str | None, one_shard: bool) -> dict[str, str]:
    """``{table: ATOMIC | PARTLY | AFTER}``: which indexes are written in their
    entity's transaction."""
    out: dict[str, str] = {}
    for index in indexes:
        if index.unique:
            out[index.table] = AFTER + " (unique: claimed before the entity)"
        elif one_shard or (shard_key is not None and index.shard_on == shard_key):
            out[index.table] = ATOMIC
        else:
            out[index.table] = PARTLY
    return out


class Colocated:
    """The part of one put's (or delete's) rows written in its entities'
    transactions, shard by shard; what was written there is kept so that the
    rest can be applied after the commits."""

    def __init__(self, router: Router, placer: Placer, kind: str, plain: Sequence[Index]) -> None:
        self.router = router
        self.placer = placer
        self.kind = kind
        #: the indexes written here: those that are not unique
        self.plain = [i for i in plain if not i.unique]
        #: whether the writer maintains unique indexes as well (see ``fresh``)
        self.unique = len(self.plain) != len(plain)
        #: ``{entity id: index rows written in its transaction}`` (for those
        #: in ``whole``: every row of its ``diffs``)
        self.inside: dict[bytes, set[IndexRow]] = {}
        #: ``{entity id: its changes of the indexes written here}``, wherever
        #: the rows live (the whole diff, computed from the body read in the
        #: transaction, for the caller to reuse); not those in ``fresh``
        self.diffs: dict[bytes, list[Change]] = {}
        #: ids whose every change of those indexes was written in its
        #: transaction (a one-shard store's)
        self.whole: set[bytes] = set()
        #: a one-shard store's put of entities that had no row, when no index
        #: is unique: per transaction, ``(its ids, the changes of those
        #: entities' rows, one per index)``, their ids in ``whole`` but not in
        #: ``diffs`` (their diff is their new rows: see :meth:`written`)
        self.fresh: list[tuple[Sequence[bytes], list[Change]]] = []
        #: lookup rows written in a transaction, and those left for after
        self.recorded: dict[bytes, int] = {}
        self.late: dict[bytes, int] = {}

    def within(
        self,
        backend: Backend,
        ids: Sequence[bytes],
        new_rows: Mapping[bytes, Mapping[str, set[IndexRow]]] | None,
        *,
        skip: frozenset[bytes] = frozenset(),
        lookups: Mapping[bytes, int] | None = None,
        before: Callable[[], None] | None = None,
        locked: frozenset[int] = frozenset(),
    ) -> Callable[[Any, Mapping[bytes, bytes | None]], None] | None:
        """The ``within`` of the transaction writing ``ids`` on ``backend``:
        ``new_rows`` their new index rows (None: a delete), ``skip`` ids whose
        old body is not in this transaction (moved from another shard),
        ``lookups`` the lookup rows ``{id: entity bucket}`` to write,
        ``before`` run first (the cache's lease of a conditional write),
        ``locked`` the buckets whose ownership the transaction holds already
        (:meth:`fence`).  None when there is nothing to do there."""
        if not self.plain and before is None and not (lookups and any(i in lookups for i in ids)):
            return None

        def run(cur: Any, old: Mapping[bytes, bytes | None]) -> None:
            if before is not None:
                before()
            topology = self.router.topology
            shard_of, backends = topology.shard_of_bucket, topology.backends

            def here(bucket: int) -> bool:
                return backends[shard_of[bucket]] is backend

            if self.recorded or self.late:  # a transaction run again (retried, or elsewhere)
                for i in ids:
                    self.recorded.pop(i, None)
                    self.late.pop(i, None)
            if lookups:
                rows = [(i, self.placer.id_bucket(i), lookups[i]) for i in ids if i in lookups]
                mine = [r for r in rows if here(r[1])]
                if mine:
                    backend.record_ids(self.kind, mine, cur=cur)
                self.recorded.update({r[0]: r[2] for r in mine})
                self.late.update({r[0]: r[2] for r in rows if not here(r[1])})
            if not self.plain:
                return
            changes: list[Change] = []
            buckets = topology.buckets
            if all(b is backend for b in backends):  # one shard: every row is here
                self._all_here(ids, old, new_rows, skip, changes, buckets, batch)
                self.whole.update([i for i in ids if i not in skip] if skip else ids)
                Indexer.write_in(backend, cur, changes, locked)
                return
            for i in ids:
                written: set[IndexRow] = set()
                self.whole.discard(i)
                if i not in skip:
                    body = old.get(i)
                    prev = codec.decode(body) if body is not None else None
                    new = new_rows[i] if new_rows is not None else {}
                    diff = self.diffs[i] = Indexer.diff(self.plain, new, prev, i, buckets)
                    for ch in diff:
                        delete = {r for r in ch.delete if here(r.bucket)}
                        insert = {r for r in ch.insert if here(r.bucket)}
                        if delete or insert:
                            changes.append(Change(ch.index, delete, insert))
                            written |= delete | insert
                self.inside[i] = written
            Indexer.write_in(backend, cur, changes, locked)

        batch: list[Change] = []  # this transaction's changes of its entities without a row
        if self.plain and not self.unique and new_rows is not None:
            self.fresh.append((ids, batch))
        return run

    def _all_here(
        self,
        ids: Sequence[bytes],
        old: Mapping[bytes, bytes | None],
        new_rows: Mapping[bytes, Mapping[str, set[IndexRow]]] | None,
        skip: frozenset[bytes],
        changes: list[Change],
        buckets: int,
        batch: list[Change],
    ) -> None:
        """``within``'s work when every row is on the entity's shard: each
        entity's whole diff goes into ``changes`` (its rows written in the
        transaction are its diff's: see :meth:`rest`).  The entities of a put
        that had no row, when no index is unique: their rows, one change per
        index for them all, into ``batch`` (see ``fresh``) as well."""
        diff_of, decode, plain, diffs = Indexer.diff, codec.decode, self.plain, self.diffs
        none: Mapping[str, set[IndexRow]] = {}
        batched = new_rows is not None and not self.unique
        added: list[Mapping[str, set[IndexRow]]] = []  # (batched) the new rows of those
        batch.clear()  # (a transaction run again)
        if batched and not skip and not any(map(old.get, ids)):  # none had a row: at once
            assert new_rows is not None
            added = list(map(new_rows.__getitem__, ids))
            if diffs:
                for i in ids:
                    diffs.pop(i, None)
            ids = ()  # (nothing left for the loop)
        for i in ids:
            if i in skip:
                self.whole.discard(i)
                self.inside[i] = set()
                continue
            body = old.get(i)
            if body is None and batched:
                assert new_rows is not None
                added.append(new_rows[i])
                diffs.pop(i, None)
                continue
            prev = decode(body) if body is not None else None
            new = new_rows[i] if new_rows is not None else none
            diff = diffs[i] = diff_of(plain, new, prev, i, buckets)
            changes += diff
        for index in plain if added else ():
            table = index.table
            rows: set[IndexRow] = set().union(*[new.get(table, ()) for new in added])
            if rows:
                batch.append(Change(index, set(), rows))
        changes += batch

    def written(self, unwritten: Collection[bytes] = ()) -> list[Change]:
        """The changes of the entities in ``fresh``, but those of the
        transactions whose ids are ``unwritten`` (a conditional put refused
        on their shard)."""
        return [
            ch
            for ids, batch in self.fresh
            if not (unwritten and any(i in unwritten for i in ids))
            for ch in batch
        ]

    def fence(
        self,
        backend: Backend,
        ids: Sequence[bytes],
        new_rows: Mapping[bytes, Mapping[str, set[IndexRow]]],
    ) -> frozenset[int]:
        """The buckets of ``ids``' new index rows on ``backend`` (by this
        process's placement): a transaction that checks and share-locks their
        ownership with its entities' (``put_entities``' ``fence``) writes
        those rows with no fence of their own."""
        if not self.plain:
            return frozenset()
        topology = self.router.topology
        shard_of, backends = topology.shard_of_bucket, topology.backends
        tables = [index.table for index in self.plain]
        if all(b is backend for b in backends):  # one shard: every row is here
            rows: set[IndexRow] = set()
            for t in tables:
                rows = rows.union(*[new_rows[i].get(t, ()) for i in ids])
            return frozenset(map(_BUCKET, rows))
        return frozenset(
            r.bucket
            for i in ids
            for index in self.plain
            for r in new_rows[i].get(index.table, ())
            if backends[shard_of[r.bucket]] is backend
        )

    def rest(self, changes: Sequence[Change], entity_id: bytes) -> list[Change]:
        """``changes`` of one entity without the rows written in its transaction."""
        if entity_id in self.whole:
            if all(not ch.index.unique for ch in changes):
                return []
            done = {r for ch in self.diffs[entity_id] for r in (*ch.delete, *ch.insert)}
        else:
            done = self.inside.get(entity_id, set())
        if not done:
            return list(changes)
        out = []
        for ch in changes:
            left = Change(ch.index, ch.delete - done, ch.insert - done, ch.bound)
            if left.delete or left.insert:
                out.append(left)
        return out
