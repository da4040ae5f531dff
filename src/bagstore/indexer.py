"""Keeping index rows in step with entities (the write path's step 2).

Rows of indexes that are not unique and that live on the entity's own shard
are written in the entity's transaction (:meth:`Indexer.write_in`, called by
:mod:`bagstore.colocated`).  The others: after an entity's transaction
commits, the rows for values that went away are deleted and rows for new
values inserted, grouped per shard, shards in parallel.  These writes are not
atomic with the entity: a crash between them leaves rows missing or stale,
which reads tolerate (they re-check) and the Cleaner repairs.  So do two
writers of one entity when the first one's index changes land after the
second one's: nothing orders them (docs/consistency.md,
"Writers of the same entity at once").  Except on unique indexes: a writer
deletes a unique row only if it was not claimed after its own stamp (nor after
the replaced body's), and a writer that regains a value, another writer of the
entity having come between its claim and its commit, re-stamps the row after
that commit, so that the earlier writer's late delete leaves it alone.

Unique indexes are claimed *before* the entity is written: inserting the row is
the claim; a row held by another entity is taken over only when that entity no
longer has the value and was written after it claimed it (so a claim of a put
still in flight is never stolen), or when the claim is older than the lease.
A second owner gets ``DuplicateValue`` and nothing of it is stored.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from operator import itemgetter
from typing import TYPE_CHECKING, Any

from bagstore import codec, testing
from bagstore.backends.indexsql import IndexRow
from bagstore.errors import DuplicateValue
from bagstore.owners import unfinished_moves
from bagstore.throttle import check_seconds

if TYPE_CHECKING:
    from bagstore.backends import Backend
    from bagstore.backends.base import Stored
    from bagstore.index import Index
    from bagstore.sharding.router import Router

__all__ = ["Change", "Claim", "Indexer"]

_BUCKET = itemgetter(2)  # an IndexRow's bucket


@dataclass(slots=True)  # (no __dict__ to make: one per index a put changes)
class Change:
    """Index rows to delete and to insert for one index."""

    index: Index
    delete: set[IndexRow]
    insert: set[IndexRow]
    #: Unique indexes: delete only rows claimed at or before this time (µs:
    #: the later of the writer's stamp and the replaced body's; None:
    #: whatever their claim).
    bound: int | None = None


@dataclass(frozen=True)
class Claim:
    """A unique row to claim; ``at``: when it was claimed (µs, 0 until then)."""

    index: Index
    row: IndexRow
    at: int = 0


class Indexer:
    """Index-row writes for one datastore."""

    def __init__(
        self,
        router: Router,
        lease: float,
        fetch_many: Callable[[Iterable[bytes]], dict[bytes, Stored]],
    ) -> None:
        self.router = router
        self.lease_us = int(check_seconds("unique_lease", lease, 0.001) * 1_000_000)
        #: rows as their shards hold them now (past every cache level)
        self.fetch_many = fetch_many

    @property
    def buckets(self) -> int:
        return self.router.placement.buckets

    @staticmethod
    def diff(
        indexes: Sequence[Index],
        new_rows: Mapping[str, set[IndexRow]],
        old: Mapping[str, Any] | None,
        entity_id: bytes,
        buckets: int,
        *,
        stamp: int | None = None,
        old_stamp: int | None = None,
        made: Mapping[IndexRow, int] | None = None,
    ) -> list[Change]:
        """Rows to delete (old values gone) and insert (new values) per index.

        ``stamp``: this write's stamp, taken before its commit; ``old_stamp``:
        the ``updated`` of ``old``; ``made``: the unique rows this write newly
        claimed, with their claim times.  On a unique index the rows to delete
        carry the later of the two stamps as their bound (see :class:`Change`),
        and the rows to insert are those to re-stamp (their claims wrote them
        before the entity; see :meth:`apply`): the values gained over ``old``
        whose claims show that another writer of the entity may have come
        between this write's claim and its commit — the claim found the row
        already the entity's, or ``old`` was stamped at or after the claim.  A
        value gained without a race is not re-stamped (a put that changes no
        unique value, or gains one alone, costs nothing more)."""
        changes = []
        for index in indexes:
            if old is None and not index.unique:  # (no old body: its rows, all new)
                gained = new_rows.get(index.table)
                if gained:  # (a change's sets are never changed: shared, not copied)
                    changes.append(Change(index, set(), gained))
                continue
            before = index.rows_or_none(old, entity_id, buckets)
            after = new_rows.get(index.table, set())
            insert = after - before
            bound = None
            if index.unique:
                if made:
                    insert = {
                        r
                        for r in insert
                        if r not in made or (old_stamp is not None and old_stamp >= made[r])
                    }
                if stamp is None or old_stamp is None:
                    bound = old_stamp if stamp is None else stamp
                else:
                    bound = max(stamp, old_stamp)
            delete = before - after
            if insert or delete:
                changes.append(Change(index, delete, insert, bound))
        return changes

    # -- unique claims -------------------------------------------------------------
    def claim_all(self, wanted: Sequence[Claim]) -> list[Claim]:
        """Claim every unique row; return the claims this call newly made (with
        their ``at``), not those that were their entity's already.

        On ``DuplicateValue`` the claims made so far are released first.
        """
        made: list[Claim] = []
        try:
            for c in wanted:
                at = self._claim(c)
                if at is not None:
                    made.append(replace(c, at=at))
        except Exception:
            self.release(made)
            raise
        return made

    def _claim(self, c: Claim) -> int | None:
        """The claim's time if newly claimed, None if it was this entity's already."""
        return self.router.on_bucket(c.row.bucket, lambda backend: self._claim_on(c, backend))

    def _claim_on(self, c: Claim, backend: Backend) -> int | None:
        cols = c.index.properties
        for _ in range(10):
            now = time.time_ns() // 1000
            seen = backend.claim(c.index.table, cols, c.row, now)
            if seen is None:
                return now
            owner, claimed = seen
            if owner == c.row.entity_id:
                return None
            # Read the owner where its bucket is now: a killed move leaves an
            # old copy where a placement read before the switch still looks.
            unfinished_moves(self.router)
            stored = self.fetch_many([owner]).get(owner)
            owner_has_it = False
            if stored is not None:
                body = codec.decode(stored.body)
                owner_has_it = any(
                    r.keys == c.row.keys for r in c.index.rows_or_none(body, owner, self.buckets)
                )
            in_flight = (
                stored is None or claimed > stored.updated
            ) and now - claimed < self.lease_us
            if owner_has_it or in_flight:
                raise DuplicateValue(
                    f"unique index {c.index.table!r} already holds this value for entity "
                    f"{owner.hex()}"
                    + ("" if owner_has_it else " (its write is still in progress)"),
                    shard=backend.name,
                )
            if backend.take_over(c.index.table, cols, c.row, owner, claimed, now):
                return now
        raise DuplicateValue(
            f"unique index {c.index.table!r}: the value kept changing owner; try again",
            shard=backend.name,
        )

    def release_unheld(self, claims: Sequence[Claim]) -> None:
        """Release the claims whose entity does not (now) hold the value."""
        if not claims:
            return
        bodies = self.fetch_many({c.row.entity_id for c in claims})
        unheld = []
        for c in claims:
            stored = bodies.get(c.row.entity_id)
            rows = (
                c.index.rows_or_none(codec.decode(stored.body), c.row.entity_id, self.buckets)
                if stored is not None
                else set()
            )
            if c.row not in rows:
                unheld.append(c)
        self.release(unheld)

    def release(self, claims: Sequence[Claim]) -> None:
        """Give back claims: rows still owned by their entity and not claimed
        again since (by another writer of the same entity, whose claim counts
        on the row)."""
        self._run([(c.index, c.row, c.at or None) for c in claims], "delete")

    # -- applying changes ----------------------------------------------------------
    def apply(self, changes: Sequence[Change], *, failpoint: str | None = None) -> None:
        """Delete stale rows, then insert new ones; shards in parallel.

        Called after the entity's commit.  On a unique index a row is deleted
        only if claimed at or before its change's ``bound``, and a row to
        insert is re-stamped instead (``claimed`` set to now, after the commit;
        inserted again if gone): the bound of a writer of the same entity that
        committed before this one is a stamp taken before that commit, so its
        late delete of the row leaves it alone."""
        self._run([(ch.index, r, ch.bound) for ch in changes for r in ch.delete], "delete")
        if failpoint is not None:
            testing.hit(failpoint)
        self._run([(ch.index, r, None) for ch in changes for r in ch.insert], "insert")

    @staticmethod
    def write_in(
        backend: Backend, cur: Any, changes: Sequence[Change], locked: Collection[int] = ()
    ) -> None:
        """Delete, then insert, the rows of ``changes`` (of indexes that are not
        unique) in the transaction of ``cur`` on ``backend``: an entity write's,
        when the rows live on the entity's shard.  Fenced like :meth:`apply`,
        except the inserts into ``locked`` buckets, whose ownership the
        transaction holds already (share-locked by its locked read)."""
        groups: Iterable[tuple[Index, Collection[IndexRow], Collection[IndexRow]]]
        if len(changes) == 1:  # (one index's change, a put's: nothing to group)
            ch = changes[0]
            groups = ((ch.index, ch.delete, ch.insert),)
        else:  # one statement per index and chunk, not per entity
            per_index: dict[str, tuple[Index, list[IndexRow], list[IndexRow]]] = {}
            for ch in changes:
                entry = per_index.setdefault(ch.index.table, (ch.index, [], []))
                entry[1].extend(ch.delete)
                entry[2].extend(ch.insert)
            groups = per_index.values()
        for index, delete, _ in groups:
            if delete:
                backend.delete_index_rows(
                    index.table, index.properties, list(delete), fenced=True, cur=cur
                )
        for index, _, insert in groups:
            held = insert  # (one shard: every row's bucket is locked)
            for r in insert:
                if r.bucket not in locked:
                    held = [r for r in insert if r.bucket in locked]
                    break
            if held:
                backend.insert_index_rows(index.table, index.properties, held, cur=cur, later=True)
            if len(held) < len(insert):
                rest = [r for r in insert if r.bucket not in locked]
                backend.insert_index_rows(index.table, index.properties, rest, fenced=True, cur=cur)

    def _run(self, items: list[tuple[Index, IndexRow, int | None]], op: str) -> None:
        """Insert (fenced by bucket ownership; unique rows re-stamped) or delete
        rows (unique rows with a bound: see :meth:`apply`), grouped per shard
        and per index."""
        if not items:
            return

        def on_shard(backend: Backend, part: list[tuple[Index, IndexRow, int | None]]) -> None:
            per_index: dict[tuple[str, bool], tuple[Index, list[IndexRow], list[int]]] = {}
            for index, row, bound in part:
                key = (index.table, bound is not None)
                entry = per_index.setdefault(key, (index, [], []))
                entry[1].append(row)
                if bound is not None:
                    entry[2].append(bound)
            for (table, bounded), (index, rows, bounds) in per_index.items():
                cols = index.properties
                if op == "insert" and index.unique:
                    backend.restamp_claims(table, cols, rows, time.time_ns() // 1000)
                elif op == "insert":
                    backend.insert_index_rows(table, cols, rows, fenced=True)
                else:
                    backend.delete_index_rows(
                        table, cols, rows, fenced=True, claimed_at_most=bounds if bounded else None
                    )

        self.router.by_bucket(items, lambda item: item[1].bucket, on_shard)
