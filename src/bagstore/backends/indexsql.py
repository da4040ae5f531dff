"""SQL for index tables: create, insert, delete, and unique claims (scans: scansql).

An index table holds one key column per indexed property (the order-preserving
encoding of :mod:`bagstore.keys`, compared bytewise on every backend), the
``entity_id``, and ``bagstore_bucket`` (the bucket of the row's ``shard_on``
value, so that a bucket's rows can be found when it moves).  A unique index also
has ``claimed``: when its row was claimed, in microseconds.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Iterable, Sequence
from contextlib import AbstractContextManager
from itertools import chain
from operator import itemgetter
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, TypeVar

from bagstore.backends.pipeline import later as send_later
from bagstore.errors import DuplicateValue

if TYPE_CHECKING:
    from bagstore.backends.base import Dialect

__all__ = ["IndexOps", "IndexRow", "index_layout"]

ENTITY_ID = "entity_id"
BUCKET = "bagstore_bucket"
CLAIMED = "claimed"
RESERVED = frozenset({ENTITY_ID, BUCKET, CLAIMED})

T = TypeVar("T")


def index_layout(columns: Sequence[str], unique: bool) -> frozenset[str]:
    """The column names (lower case) of an index table with these properties."""
    extra = {ENTITY_ID, BUCKET} | ({CLAIMED} if unique else set())
    return frozenset(c.lower() for c in (*columns, *extra))


class IndexRow(NamedTuple):
    """One row of an index table: stored keys (one per property), entity id,
    bucket.  (A tuple: made and hashed for every row a write diffs, and a
    tuple's hash is C's where a frozen dataclass's runs in Python.)"""

    keys: tuple[bytes, ...]
    entity_id: bytes
    bucket: int


_KEYS, _ENTITY, _BUCKET = (itemgetter(k) for k in range(3))  # an IndexRow's fields


@functools.lru_cache(maxsize=1024)
def _delete_rows_text(
    d: Dialect, table: str, columns: tuple[str, ...], n: int, fenced: bool, bounded: bool = False
) -> str:
    """``DELETE`` of ``n`` index rows named by their keys and entity id; with
    ``fenced``, only rows of buckets this shard owns; with ``bounded`` (unique
    indexes), only rows whose ``claimed`` is not above each row's bound."""
    one = " AND ".join(f"{d.q(c)} = {d.param}" for c in (*columns, ENTITY_ID))
    if bounded:
        one += f" AND {CLAIMED} <= {d.param}"
    sql = f"DELETE FROM {d.q(table)} WHERE ({' OR '.join([f'({one})'] * n)})"
    if fenced:
        sql += (
            " AND EXISTS (SELECT 1 FROM bagstore_owned o "
            f"WHERE o.bucket = {d.q(table)}.{BUCKET} AND o.state = 0)"
        )
    return sql


class IndexOps:
    """Index-table operations; mixed into :class:`bagstore.backends.base.Backend`."""

    # Provided by Backend:
    dialect: Dialect
    name: str
    index_rows_per_statement: int
    bulk_rows_per_statement: int
    max_statement_bytes: int
    _sql_memo: dict[tuple[Any, ...], str]
    blob: ClassVar[type[bytes] | type[bytearray]]

    def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        raise NotImplementedError

    def sql(self, builder: str, *args: Any, **kwargs: Any) -> str:
        raise NotImplementedError

    def fetchall(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        raise NotImplementedError

    def _executescript(self, statements: Sequence[str]) -> None:
        raise NotImplementedError

    def run(self, work: Callable[..., T], *args: Any, attempts: int = 3) -> T:
        raise NotImplementedError

    def transaction(self, conn: Any) -> AbstractContextManager[Any]:
        raise NotImplementedError

    def _locked_read(
        self, cur: Any, kind: str, buckets: Sequence[int], ids: Sequence[bytes]
    ) -> list[tuple[Any, ...]]:
        raise NotImplementedError

    def check_owned(self, buckets: Sequence[int]) -> None:
        raise NotImplementedError

    def insert_ignore(
        self, table: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]
    ) -> None:
        raise NotImplementedError

    def table_columns(self, table: str) -> frozenset[str]:
        raise NotImplementedError

    def ensure_index_table(self, table: str, columns: Sequence[str], unique: bool) -> bool:
        """Create the index's table when missing.  False (and nothing created) if
        a table of that name exists with other columns: an entities table or
        any other table that is not this index's (see :mod:`bagstore.names`)."""
        layout = index_layout(columns, unique)
        if self.table_columns(table) not in (frozenset(), layout):
            return False
        statements = self.dialect.create_index_table_sql(table, columns, unique)
        self._executescript(statements[:1])
        if self.table_columns(table) != layout:  # another's table made meanwhile
            return False
        self._executescript(statements[1:])
        return True

    def drop_index_table(self, table: str, columns: Sequence[str], unique: bool) -> bool:
        """Drop the index's table if it has exactly the index's columns; a table
        of that name with other columns (a kind's entities, any other table) is
        never dropped.  True if dropped or absent, False if left alone."""
        found = self.table_columns(table)
        if not found:
            return True
        if found != index_layout(columns, unique):
            return False
        self._executescript([f"DROP TABLE IF EXISTS {self.dialect.q(table)}"])
        return True

    def _run_on(self, cur: Any, sql: str, params: Sequence[Any]) -> int:
        """One statement on ``cur`` (in its transaction), or on its own if None;
        its row count."""
        if cur is None:
            return self.execute(sql, params)
        cur.execute(sql, params)
        return int(cur.rowcount)

    def insert_index_rows(
        self,
        table: str,
        columns: Sequence[str],
        rows: Collection[IndexRow],
        *,
        claimed: int | None = None,
        fenced: bool = False,
        cur: Any = None,
        later: bool = False,
    ) -> int:
        """Insert rows, leaving existing ones alone; ``claimed`` (the time) for a
        unique index's rows.  With ``fenced``, only rows of buckets this shard
        owns are written, and StalePlacement / KeyMigrating is raised if any
        bucket is not owned.  ``cur``: run in that cursor's transaction (an
        entity write's, see ``Backend.put_entities``); with ``later`` (not
        fenced), sent with that transaction's next statement
        (:func:`bagstore.backends.pipeline.later`): 0 rows counted."""
        extra: tuple[int, ...]
        if claimed is None:
            cols, extra = (*columns, ENTITY_ID, BUCKET), ()
        else:
            cols, extra = (*columns, ENTITY_ID, BUCKET, CLAIMED), (claimed,)
        blob, memo = self.blob, self._sql_memo  # (ids and keys bound as entity writes bind theirs)
        written = 0
        # (a fenced insert is a compound SELECT a row, whose terms SQLite caps)
        step = self.index_rows_per_statement if fenced else self.bulk_rows_per_statement
        if len(rows) <= step:  # (a put's few rows, maybe a set: no slice, no range)
            chunks: Iterable[Collection[IndexRow]] = (rows,)
        else:
            listed = list(rows)
            chunks = [listed[start : start + step] for start in range(0, len(listed), step)]
        for chunk in chunks:
            if fenced:
                sql = self.sql("fenced_insert_sql", table, cols, len(chunk), ignore=True)
            else:
                key = ("insert_ignore_sql", table, cols, len(chunk))  # (self.sql's memo, inline)
                sql = memo.get(key) or self.sql(*key)
            again = fenced and self.dialect.fenced_by_key(len(chunk))  # the bucket once more
            plain = len(columns) == 1 and not extra and not again  # (key, id, bucket) a row
            params: list[Any]
            if plain and len(chunk) <= 8:  # (a put's few: a loop)
                params = []
                for r in chunk:
                    params += (blob(r[0][0]), blob(r[1]), r[2])
            elif plain:  # (a put_many's: flattened in C; a row's first key is its keys[0])
                keys = map(blob, map(_KEYS, map(_KEYS, chunk)))
                ids = map(blob, map(_ENTITY, chunk))
                params = list(chain.from_iterable(zip(keys, ids, map(_BUCKET, chunk), strict=True)))
            else:
                params = [
                    v
                    for r in chunk
                    for v in (
                        *map(blob, r.keys),
                        blob(r.entity_id),
                        r.bucket,
                        *extra,
                        *([r.bucket] * again),
                    )
                ]
            if later and cur is not None and not fenced:
                send_later(cur, sql, params)
                continue
            n = self._run_on(cur, sql, params)
            if fenced and n < len(chunk):  # duplicates, or buckets not owned here
                self.check_owned([r.bucket for r in chunk])
            written += n
        return written

    def bulk_insert_index_rows(
        self,
        table: str,
        columns: Sequence[str],
        rows: Sequence[IndexRow],
        *,
        claimed: int | None = None,
    ) -> int:
        """A flat-out backfill's insert: one transaction that share-locks the
        ownership rows of the rows' buckets (raising StalePlacement or
        KeyMigrating, nothing written, unless this shard owns them all), then
        inserts the rows, leaving existing ones alone, in multi-row statements
        as large as the driver's limits allow.  Fenced as
        :meth:`insert_index_rows` is, with one commit and plain ``VALUES``
        lists instead of a statement a few hundred rows long per commit."""
        if not rows:
            return 0
        cols = (*columns, ENTITY_ID, BUCKET) + ((CLAIMED,) if claimed is not None else ())
        extra = (claimed,) if claimed is not None else ()
        # (bytes of a row as sent: keys, id, bucket, claimed; escaped up to twice)
        size = 2 * (sum(map(len, rows[0].keys)) + 40) + 16 * len(cols)
        step = max(1, min(self.bulk_rows_per_statement, self.max_statement_bytes // size))
        buckets = sorted({r.bucket for r in rows})

        def work(conn: Any) -> int:
            written = 0
            with self.transaction(conn) as cur:
                self._locked_read(cur, table, buckets, [])
                for start in range(0, len(rows), step):
                    chunk = rows[start : start + step]
                    params = [v for r in chunk for v in (*r.keys, r.entity_id, r.bucket, *extra)]
                    cur.execute(self.sql("insert_ignore_sql", table, cols, len(chunk)), params)
                    written += max(0, int(cur.rowcount))
            return written

        return self.run(work)

    def delete_index_rows(
        self,
        table: str,
        columns: Sequence[str],
        rows: Sequence[IndexRow],
        *,
        fenced: bool = False,
        claimed_at_most: Sequence[int] | None = None,
        cur: Any = None,
    ) -> int:
        """Delete rows; with ``fenced``, only rows of buckets this shard owns, and
        StalePlacement / KeyMigrating is raised if a bucket is not owned (a writer
        with a stale placement must not delete on a shard that has let the bucket
        go: the owner would keep the row).  ``claimed_at_most`` (a unique index's
        rows, one bound per row): a row claimed after its bound stays (it was
        claimed again by a later writer of its entity).  ``cur``: as for
        :meth:`insert_index_rows`."""
        removed = 0
        bounded = claimed_at_most is not None
        for start in range(0, len(rows), 200):
            chunk = rows[start : start + 200]
            bounds = claimed_at_most[start : start + 200] if claimed_at_most is not None else ()
            sql = _delete_rows_text(
                self.dialect, table, tuple(columns), len(chunk), fenced, bounded
            )
            params = [
                v
                for k, r in enumerate(chunk)
                for v in (*r.keys, r.entity_id, *((bounds[k],) if bounded else ()))
            ]
            n = self._run_on(cur, sql, params)
            if fenced and n < len(chunk):  # gone already, or buckets not owned here
                self.check_owned([r.bucket for r in chunk])
            removed += n
        return removed

    # -- unique claims -----------------------------------------------------------
    def claim(
        self, table: str, columns: Sequence[str], row: IndexRow, now: int
    ) -> tuple[bytes, int] | None:
        """Try to claim a unique value for ``row.entity_id``.

        Returns None when the row was inserted (the value is newly ours), else
        ``(owner, claimed)`` of the row that holds it; when that owner is
        ``row.entity_id`` the value was ours already and ``claimed`` has been
        refreshed to ``now``.
        """
        d = self.dialect
        cols = (*columns, ENTITY_ID, BUCKET, CLAIMED)
        sql = self.sql("fenced_insert_sql", table, cols, 1, ignore=False)
        try:
            if self.execute(sql, [*row.keys, row.entity_id, row.bucket, now, row.bucket]) == 1:
                return None
            self.check_owned([row.bucket])  # raises: the bucket is not owned here
            raise AssertionError("fenced insert wrote nothing in an owned bucket")
        except DuplicateValue:
            pass
        match = " AND ".join(f"{d.q(c)} = {d.param}" for c in columns)
        found = self.fetchall(
            f"SELECT {ENTITY_ID}, {CLAIMED} FROM {d.q(table)} WHERE {match}", list(row.keys)
        )
        if not found:  # released meanwhile: try again
            return self.claim(table, columns, row, now)
        owner, claimed = bytes(found[0][0]), int(found[0][1])
        if owner == row.entity_id:
            self.execute(
                f"UPDATE {d.q(table)} SET {CLAIMED} = {d.param} WHERE {match}",
                [now, *row.keys],
            )
            return owner, now
        return owner, claimed

    def restamp_claims(
        self, table: str, columns: Sequence[str], rows: Sequence[IndexRow], now: int
    ) -> None:
        """Set ``claimed`` to ``now`` on unique rows still owned by their
        entity, and insert those that are gone (unless another entity holds the
        value meanwhile); only in buckets this shard owns (StalePlacement /
        KeyMigrating otherwise).  One statement per row, two for a row that is
        gone."""
        d = self.dialect
        match = " AND ".join(f"{d.q(c)} = {d.param}" for c in (*columns, ENTITY_ID))
        sql = (
            f"UPDATE {d.q(table)} SET {CLAIMED} = {d.param} WHERE {match} AND EXISTS "
            f"(SELECT 1 FROM bagstore_owned WHERE bucket = {d.param} AND state = 0)"
        )
        gone = [r for r in rows if self.execute(sql, [now, *r.keys, r.entity_id, r.bucket]) == 0]
        if gone:
            self.insert_index_rows(table, columns, gone, claimed=now, fenced=True)

    def take_over(
        self,
        table: str,
        columns: Sequence[str],
        row: IndexRow,
        owner: bytes,
        claimed: int,
        now: int,
    ) -> bool:
        """Move a claim from ``owner`` (seen with ``claimed``) to ``row.entity_id``;
        False if the row changed since it was seen."""
        d = self.dialect
        match = " AND ".join(f"{d.q(c)} = {d.param}" for c in columns)
        sql = (
            f"UPDATE {d.q(table)} SET {ENTITY_ID} = {d.param}, {BUCKET} = {d.param}, "
            f"{CLAIMED} = {d.param} WHERE {match} AND {ENTITY_ID} = {d.param} "
            f"AND {CLAIMED} = {d.param} AND EXISTS (SELECT 1 FROM bagstore_owned "
            f"WHERE bucket = {d.param} AND state = 0)"
        )
        params = [row.entity_id, row.bucket, now, *row.keys, owner, claimed, row.bucket]
        return self.execute(sql, params) == 1

    def rows_of_entities(
        self, table: str, columns: Sequence[str], ids: Sequence[bytes]
    ) -> list[IndexRow]:
        """Every row of the table that points at one of ``ids``."""
        return [row for row, _ in self._rows_pointing_at(table, columns, ids, claimed=False)]

    def claims_of_entities(
        self, table: str, columns: Sequence[str], ids: Sequence[bytes]
    ) -> list[tuple[IndexRow, int]]:
        """``(row, claimed)`` of every row of a unique index's table that points
        at one of ``ids``."""
        return self._rows_pointing_at(table, columns, ids, claimed=True)

    def _rows_pointing_at(
        self, table: str, columns: Sequence[str], ids: Sequence[bytes], *, claimed: bool
    ) -> list[tuple[IndexRow, int]]:
        """``(row, claimed)`` of the rows pointing at ``ids`` (``claimed`` 0
        unless asked for: only unique tables have the column)."""
        d = self.dialect
        cols = (*columns, ENTITY_ID, BUCKET, *((CLAIMED,) if claimed else ()))
        out: list[tuple[IndexRow, int]] = []
        n = len(columns)
        for start in range(0, len(ids), 500):
            part = list(ids[start : start + 500])
            rows = self.fetchall(
                f"SELECT {', '.join(d.q(c) for c in cols)} FROM {d.q(table)} "
                f"WHERE {ENTITY_ID} IN ({d.params(len(part))})",
                part,
            )
            out += [
                (
                    IndexRow(tuple(bytes(v) for v in r[:n]), bytes(r[n]), int(r[n + 1])),
                    int(r[n + 2]) if claimed else 0,
                )
                for r in rows
            ]
        return out

    def drop_claims(
        self, table: str, columns: Sequence[str], claims: Sequence[tuple[IndexRow, int]]
    ) -> int:
        """Delete unique rows that are still as seen (same entity, same
        ``claimed``) and whose bucket this shard owns and is not moving (a row
        claimed again meanwhile, or a copy that is not the owner's, stays);
        return how many went."""
        d = self.dialect
        match = " AND ".join(f"{d.q(c)} = {d.param}" for c in (*columns, ENTITY_ID, CLAIMED))
        sql = (
            f"DELETE FROM {d.q(table)} WHERE {match} AND EXISTS (SELECT 1 FROM "
            f"bagstore_owned o WHERE o.bucket = {d.q(table)}.{BUCKET} AND o.state = 0)"
        )
        return sum(
            self.execute(sql, [*row.keys, row.entity_id, claimed]) for row, claimed in claims
        )
