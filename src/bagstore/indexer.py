"""Keeping index rows in step with entities (the write path's step 2).

After an entity's transaction commits, the rows for values that went away are
deleted and rows for new values inserted, grouped per shard, shards in
parallel.  These writes are not atomic with the entity: a crash between them
leaves rows missing or stale, which reads tolerate (they re-check) and the
Cleaner repairs.

Unique indexes are claimed *before* the entity is written: inserting the row is
the claim; a row held by another entity is taken over only when that entity no
longer has the value and was written after it claimed it (so a claim of a put
still in flight is never stolen), or when the claim is older than the lease.
A second owner gets ``DuplicateValue`` and nothing of it is stored.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from bagstore import codec, testing
from bagstore.backends.indexsql import IndexRow
from bagstore.errors import DuplicateValue

if TYPE_CHECKING:
    from bagstore.backends import Backend
    from bagstore.datastore import Datastore
    from bagstore.index import Index

__all__ = ["Change", "Claim", "Indexer"]


@dataclass
class Change:
    """Index rows to delete and to insert for one index."""

    index: Index
    delete: set[IndexRow]
    insert: set[IndexRow]


@dataclass(frozen=True)
class Claim:
    index: Index
    row: IndexRow


class Indexer:
    """Index-row writes for one datastore."""

    def __init__(self, ds: Datastore, lease: float) -> None:
        self.ds = ds
        self.lease_us = int(lease * 1_000_000)

    @property
    def buckets(self) -> int:
        return self.ds.placement.buckets

    @staticmethod
    def diff(
        indexes: Sequence[Index],
        new_rows: Mapping[str, set[IndexRow]],
        old: Mapping[str, Any] | None,
        entity_id: bytes,
        buckets: int,
    ) -> list[Change]:
        """Rows to delete (old values gone) and insert (new values) per index.
        Unique rows to insert are left out: their claims inserted them."""
        changes = []
        for index in indexes:
            before = index.rows_or_none(old, entity_id, buckets)
            after = new_rows.get(index.table, set())
            insert = set() if index.unique else after - before
            delete = before - after
            if insert or delete:
                changes.append(Change(index, delete, insert))
        return changes

    # -- unique claims -------------------------------------------------------------
    def claim_all(self, wanted: Sequence[Claim]) -> list[Claim]:
        """Claim every unique row; return the claims this call newly made.

        On ``DuplicateValue`` the claims made so far are released first.
        """
        made: list[Claim] = []
        try:
            for c in wanted:
                if self._claim(c):
                    made.append(c)
        except Exception:
            self.release(made)
            raise
        return made

    def _claim(self, c: Claim) -> bool:
        """True if newly claimed, False if it was this entity's already."""
        return self.ds._fenced(lambda: self._claim_on(c, self.ds._backends[self._shard_no(c.row)]))

    def _shard_no(self, row: IndexRow) -> int:
        return self.ds._shard_of_bucket[row.bucket]

    def _claim_on(self, c: Claim, backend: Backend) -> bool:
        cols = c.index.properties
        for _ in range(10):
            now = time.time_ns() // 1000
            seen = backend.claim(c.index.table, cols, c.row, now)
            if seen is None:
                return True
            owner, claimed = seen
            if owner == c.row.entity_id:
                return False
            stored = self.ds._fetch_stored(owner)
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
                return True
        raise DuplicateValue(
            f"unique index {c.index.table!r}: the value kept changing owner; try again",
            shard=backend.name,
        )

    def release_unheld(self, claims: Sequence[Claim]) -> None:
        """Release the claims whose entity does not (now) hold the value."""
        if not claims:
            return
        bodies = self.ds._fetch_many({c.row.entity_id for c in claims})
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
        """Give back claims (rows still owned by their entity only)."""
        self._run([(c.index, c.row) for c in claims], "delete")

    # -- applying changes ----------------------------------------------------------
    def apply(self, changes: Sequence[Change], *, failpoint: str | None = None) -> None:
        """Delete stale rows, then insert new ones; shards in parallel."""
        self._run([(ch.index, r) for ch in changes for r in ch.delete], "delete")
        if failpoint is not None:
            testing.hit(failpoint)
        self._run([(ch.index, r) for ch in changes for r in ch.insert], "insert")

    def _run(self, items: list[tuple[Index, IndexRow]], op: str) -> None:
        """Insert (fenced by bucket ownership) or delete rows, grouped per shard
        and per index."""
        if not items:
            return

        def on_shard(backend: Backend, part: list[tuple[Index, IndexRow]]) -> None:
            per_index: dict[str, tuple[Index, list[IndexRow]]] = {}
            for index, row in part:
                per_index.setdefault(index.table, (index, []))[1].append(row)
            for index, rows in per_index.values():
                if op == "insert":
                    backend.insert_index_rows(index.table, index.properties, rows, fenced=True)
                else:
                    backend.delete_index_rows(index.table, index.properties, rows, fenced=True)

        self.ds._route(items, lambda item: item[1].bucket, on_shard)
