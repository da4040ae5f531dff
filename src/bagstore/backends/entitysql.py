"""The text of the statements on an entities table: :class:`EntitySQL`,
mixed into :class:`bagstore.backends.base.Dialect` (each dialect overrides
what its server spells otherwise); :class:`bagstore.backends.entities.EntityOps`
runs them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

__all__ = ["NOT_OWNED", "EntitySQL"]

#: The error text a statement signals when a bucket is not owned here (see
#: ``EntitySQL.put_one_sql``).
NOT_OWNED = "bagstore: bucket not owned here"


class EntitySQL:
    """SQL text of entities tables; mixed into :class:`bagstore.backends.base.Dialect`."""

    # Provided by Dialect:
    param: ClassVar[str]
    for_update: ClassVar[str]
    share_lock: ClassVar[str]
    #: the clause that turns an insert of entities into an upsert on ``id``
    upsert_on_id: ClassVar[str]
    #: the larger of two values
    greatest: ClassVar[str]
    #: Whether :meth:`conditional_update_sql` of a row that keeps its bucket
    #: checks the ownership of the row's own ``bucket`` column (no bucket
    #: bound): SQLite's, whose one writer at a time has no lock order to
    #: keep.  MariaDB's binds the bucket, its ownership row share-locked
    #: before the entity's row, as every other write of it locks them.
    fences_by_row: ClassVar[bool] = False
    #: Whether :meth:`locked_read_sql` sends its count of owned buckets only
    #: when it is short (``HAVING``; a put's count row is one row fewer for
    #: the driver to parse).  SQLite before 3.39 takes no ``HAVING`` without
    #: ``GROUP BY``.
    count_when_short: ClassVar[bool] = False
    #: The NULL of a locked read's ``version`` column in its rows of counts
    #: (MariaDB types a UNION of a bare NULL and ``BIGINT UNSIGNED`` DECIMAL,
    #: which the driver makes a ``Decimal`` of each version).
    null_version: ClassVar[str] = "NULL"

    def q(self, name: str) -> str:
        raise NotImplementedError

    def params(self, n: int) -> str:
        raise NotImplementedError

    def union_all_sql(self, parts: Sequence[str]) -> str:
        raise NotImplementedError

    def create_entities_sql(self, kind: str) -> list[str]:
        raise NotImplementedError

    def excluded(self, column: str) -> str:
        """The value an upsert's conflicting row was given for ``column``
        (``VALUES(c)``, ``excluded.c``)."""
        raise NotImplementedError

    def _entities_upsert(self, kind: str, rows: int, version: str, on_conflict: str) -> str:
        """Upsert ``rows`` rows ``(id, bucket, updated, <version>, body)`` of
        ``kind``; a row that exists takes the new bucket, updated and body, and
        ``on_conflict`` as its version."""
        p, x = self.param, self.excluded
        values = ", ".join([f"({p}, {p}, {p}, {version}, {p})"] * rows)
        return (
            f"INSERT INTO {self.q(kind)} (id, bucket, updated, version, body) VALUES {values} "
            f"{self.upsert_on_id} bucket = {x('bucket')}, updated = {x('updated')}, "
            f"version = {on_conflict}, body = {x('body')}"
        )

    def upsert_entities_sql(self, kind: str, rows: int) -> str:
        """Upsert rows ``(id, bucket, updated, body)``, counting ``version`` up
        by one (a hand-written writer's statement: the benchmarks' raw side)."""
        return self._entities_upsert(kind, rows, "1", "version + 1")

    def write_entities_sql(self, kind: str, rows: int) -> str:
        """Upsert rows ``(id, bucket, updated, version, body)``; a row that
        exists gets the larger of its version + 1 and the one given (bagstore's
        writes: see :mod:`bagstore.versions`)."""
        new = self.excluded("version")
        return self._entities_upsert(kind, rows, self.param, f"{self.greatest}(version + 1, {new})")

    def put_one_sql(self, kind: str, returning: bool = True) -> str | None:
        """One statement that upserts one entity (named parameters ``id,
        bucket, updated, body``) if this shard owns its bucket, its version
        from the clock read under the row's lock (see
        :mod:`bagstore.versions`).  It returns the new version as a row (a
        dialect may return no result without ``returning``); a bucket not
        owned here gives no row, or the error :data:`NOT_OWNED`.  None where
        no statement can (then a transaction does it)."""
        return None

    def conditional_update_sql(self, kind: str, moves: bool) -> str:
        """Replace one row's ``updated, version, body`` (and ``bucket`` first
        if ``moves``) only if its id has the version given and this shard owns
        the bucket (share-locked, as a fenced insert's): parameters ``[bucket,]
        updated, version, body, id, expected version, bucket``.  Where the
        dialect :attr:`fences_by_row` and the row keeps its bucket (not
        ``moves``), the bucket is the row's own column and is not bound:
        parameters ``updated, version, body, id, expected version``.  (An
        indexed column left out of the SET costs nothing.)"""
        p = self.param
        t = self.q(kind)
        owned = f"{t}.bucket" if self.fences_by_row and not moves else p
        return (
            f"UPDATE {t} SET {f'bucket = {p}, ' if moves else ''}updated = {p}, "
            f"version = {p}, body = {p} WHERE id = {p} AND version = {p} AND EXISTS "
            f"(SELECT 1 FROM bagstore_owned WHERE bucket = {owned} AND state = 0{self.share_lock})"
        )

    def widen_version_sql(self, kind: str) -> list[str]:
        return []

    def select_bodies_sql(
        self,
        kind: str,
        n: int,
        lock: bool = False,
        schema: str | None = None,
        stamps: bool = True,
        bodies: bool = True,
    ) -> str:
        """``SELECT id, body, version, updated`` of ``n`` ids (``id, body``
        without ``stamps``: a reader that needs only the bodies saves the
        driver two columns of every row; without ``bodies`` no body either:
        which ids exist)."""
        table = self.q(kind) if schema is None else f"{self.q(schema)}.{self.q(kind)}"
        columns = f"id{', body' if bodies else ''}{', version, updated' if stamps else ''}"
        sql = (
            f"SELECT {columns} FROM {table} WHERE id"
            f"{' = ' + self.param if n == 1 else ' IN (' + self.params(n) + ')'}"
        )
        return sql + self.for_update if lock else sql

    def locked_read_sql(self, kind: str, buckets: int, ids: int, bodies: bool = True) -> str:
        """For a write transaction, one statement: the rows of ``ids`` ids,
        locked for update, as ``(id, body, version, updated)`` (the body NULL
        unless ``bodies``); and how many of ``buckets`` buckets this shard
        owns and accepts writes in (their ownership rows share-locked until
        the transaction ends), as ``(NULL, NULL, NULL, count)``, a row that
        a dialect whose :attr:`count_when_short` is set sends only when the
        count is short.  Four columns, the fewest the rows need: a driver
        parses every column's descriptor of every locked read."""
        parts = []
        if buckets:
            count = (
                f"SELECT NULL, NULL, {self.null_version}, COUNT(*) FROM bagstore_owned "
                f"WHERE bucket IN ({self.params(buckets)}) AND state = 0"
            )
            if self.count_when_short:
                count += f" HAVING COUNT(*) <> {buckets}"
            parts.append(count + self.share_lock)
        if ids:
            parts.append(
                f"SELECT id, {'body' if bodies else 'NULL'}, version, updated "
                f"FROM {self.q(kind)} "
                f"WHERE id IN ({self.params(ids)})" + self.for_update
            )
        return self.union_all_sql(parts)

    def copy_entities_sql(self, kind: str, rows: int) -> str:
        """Upsert rows ``(id, bucket, updated, version, body)`` keeping their version."""
        return self._entities_upsert(kind, rows, self.param, self.excluded("version"))

    def delete_entities_sql(self, kind: str, n: int) -> str:
        cond = f" = {self.param}" if n == 1 else f" IN ({self.params(n)})"
        return f"DELETE FROM {self.q(kind)} WHERE id{cond}"

    def gated_read_sql(self, kind: str, ids: int, bodies: bool = True) -> str:
        """:meth:`locked_read_sql` with the shard's gate row share-locked in
        place of the buckets' ownership rows (see backends/gate.py), as
        ``(NULL, NULL, NULL, token)``."""
        gate = f"SELECT NULL, NULL, {self.null_version}, token FROM bagstore_gate WHERE one = 1"
        gate += self.share_lock
        if not ids:
            return gate
        return self.union_all_sql([gate, self.locked_read_sql(kind, 0, ids, bodies)])

    def locked_states_sql(self, buckets: int) -> str:
        """``(bucket, state)`` of the ownership rows of ``buckets`` buckets, share-locked."""
        return (
            f"SELECT bucket, state FROM bagstore_owned WHERE bucket IN ({self.params(buckets)})"
            + self.share_lock
        )
