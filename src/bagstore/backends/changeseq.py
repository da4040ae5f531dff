"""SQLite: the change feed's rows kept in the order they committed.

A SQLite shard is one file written by one transaction at a time, so a
number taken inside the write's transaction numbers its changes in commit
order with no horizon to wait for.  ``bagstore_changes`` on SQLite is stored
by that number: its primary key is ``(kind, seq)``, a change's ``seq`` one
past the highest of its kind's rows and of its floor in
``bagstore_change_seq`` (one row a kind, raised to the highest number before
any row is deleted, so that no number is ever given twice), and a unique
index keeps ``(kind, bucket, pos)``.  A reader of every bucket
(:mod:`bagstore.feedstream`) reads a shard's rows as they lie, one range of
the key, with no merge of its buckets; a bucket's rows are read through the
index (a bucket move, retention, a reader of a few buckets).

Rows a bucket move copies here take new numbers, after every row here, in
position order (:func:`copy_rows`): a bucket's rows are in position order
by ``seq`` on every shard.  A store made before this layout is converted
when a shard is opened (:func:`convert`).

MariaDB keeps its rows by ``(kind, bucket, pos)``: InnoDB hands out an
``AUTO_INCREMENT`` at insert, not at commit, so no such number is commit
order there (see :mod:`bagstore.backends.changesql`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bagstore.backends.base import Backend

__all__ = [
    "FLOOR",
    "convert",
    "copy_rows",
    "first_after",
    "raise_floor",
    "read_after",
    "record_sql",
    "sequenced",
    "tables_sql",
    "tops",
]

log = logging.getLogger("bagstore.changes")

CHANGES = "bagstore_changes"
FLOOR = "bagstore_change_seq"
_INDEX = "bagstore_changes_at"
#: the names bagstore gives the triggers that record changes (changesql)
_TRIGGER = re.compile(r"bagstore_chg_[0-9a-f]{16}_[iud]")
_COLUMNS = "kind, seq, bucket, pos, id, op, version, updated, body"
_TABLE = (
    "(kind VARCHAR(64) NOT NULL, seq INTEGER NOT NULL, bucket INTEGER NOT NULL, "
    "pos BIGINT NOT NULL, id BLOB NOT NULL, op INTEGER NOT NULL, version BIGINT NOT NULL, "
    "updated BIGINT NOT NULL, body BLOB NULL, PRIMARY KEY (kind, seq)) WITHOUT ROWID"
)
#: What a reader asks of a range of the sequence: the columns every reader
#: reads, then the number.
_READ = (
    f"SELECT bucket, pos, id, op, version, updated, body FROM {CHANGES} "
    "WHERE kind = ? AND seq > ? ORDER BY seq LIMIT ?"
)
#: the number of a bucket's position (to go on after the last row read:
#: one index search a statement rather than a column a row)
_SEQ_AT = f"SELECT seq FROM {CHANGES} WHERE kind = ? AND bucket = ? AND pos = ?"


def sequenced(backend: Backend) -> bool:
    """Whether this shard keeps its change rows in commit order (SQLite)."""
    return backend.dialect.name == "sqlite"


def tables_sql() -> list[str]:
    """SQLite's change table, its index by bucket and the kinds' floors."""
    return [
        f"CREATE TABLE IF NOT EXISTS {CHANGES} {_TABLE}",
        f"CREATE UNIQUE INDEX IF NOT EXISTS {_INDEX} ON {CHANGES} (kind, bucket, pos)",
        f"CREATE TABLE IF NOT EXISTS {FLOOR} (kind VARCHAR(64) NOT NULL PRIMARY KEY, "
        "seq BIGINT NOT NULL) WITHOUT ROWID",
    ]


def _next(k: str) -> str:
    """The next number of kind literal (or parameter) ``k``: past its highest
    row's and its floor."""
    return (
        f"MAX(COALESCE((SELECT MAX(seq) FROM {CHANGES} WHERE kind = {k}), 0), "
        f"COALESCE((SELECT seq FROM {FLOOR} WHERE kind = {k}), 0)) + 1"
    )


def record_sql(k: str, bucket: str, values: str, positions: str) -> str:
    """A trigger's statement that numbers and inserts one change of kind
    literal ``k``: ``values`` the columns after the position, read from the
    ``positions`` row of ``bucket``.  The number is read, not written: one
    past the highest row's and the kind's floor (raised before rows are
    deleted, :func:`raise_floor`), so that a write adds no page to its
    commit (measured, a feed-on put's transaction by hand: a counter row
    updated at every write cost ~15% more)."""
    return (
        f"INSERT INTO {CHANGES} ({_COLUMNS}) SELECT {k}, {_next(k)}, {bucket}, pos, {values} "
        f"FROM {positions} WHERE kind = {k} AND bucket = {bucket};"
    )


def raise_floor(backend: Backend, kind: str) -> None:
    """Before change rows of ``kind`` are deleted on this shard (retention, a
    bucket moved away): the kind's floor raised to its highest number, so
    that no later change takes the number of one deleted (a reader past it
    would not read it).  Every path that deletes change rows calls it."""
    if sequenced(backend):
        backend.execute(
            f"INSERT INTO {FLOOR} (kind, seq) SELECT ?, COALESCE(MAX(seq), 0) FROM {CHANGES} "
            "WHERE kind = ? ON CONFLICT (kind) DO UPDATE SET seq = MAX(seq, excluded.seq)",
            [kind, kind],
        )


def convert(backend: Backend) -> bool:
    """Convert this shard's change table from the layout by ``(kind, bucket,
    pos)`` (stores made before this one) to the one by ``seq``, in one
    transaction: each kind's rows numbered in the order a reader merged them
    (by the running maximum of their time along each bucket, then bucket and
    position), the triggers that write them made again.  Whether it did."""
    columns = [str(r[1]) for r in backend.fetchall(f"PRAGMA table_info({CHANGES})")]
    if not columns or "seq" in columns:
        return False
    triggers = [
        (str(name), str(table), str(text))
        for name, table, text in backend.fetchall(
            "SELECT name, tbl_name, sql FROM sqlite_master WHERE type = 'trigger' "
            "AND name LIKE 'bagstore_chg_%'"
        )
        if _TRIGGER.fullmatch(str(name))  # (its name goes into the DROP)
    ]
    from bagstore.backends.changesql import triggers_sql  # (it imports this module)

    def work(conn: Any) -> int:
        with backend.transaction(conn) as cur:
            cur.execute(f"PRAGMA table_info({CHANGES})")
            if "seq" in [str(r[1]) for r in cur.fetchall()]:
                return -1  # another process converted it meanwhile
            for name, _, _ in triggers:
                cur.execute(f"DROP TRIGGER IF EXISTS {name}")
            cur.execute(f"CREATE TABLE bagstore_changes_new {_TABLE}")
            cur.execute(
                f"INSERT INTO bagstore_changes_new ({_COLUMNS}) SELECT kind, "
                "ROW_NUMBER() OVER (PARTITION BY kind ORDER BY m, bucket, pos), "
                "bucket, pos, id, op, version, updated, body FROM (SELECT *, "
                "MAX(updated) OVER (PARTITION BY kind, bucket ORDER BY pos) AS m "
                f"FROM {CHANGES})"
            )
            moved = cur.rowcount
            cur.execute(f"DROP TABLE {CHANGES}")
            cur.execute(f"ALTER TABLE bagstore_changes_new RENAME TO {CHANGES}")
            for sql in tables_sql():
                cur.execute(sql)
            for name, table, text in triggers:
                if name.endswith("_i"):  # one set of three a kind
                    for sql in triggers_sql(backend.dialect, table, "NEW.body" in text):
                        cur.execute(sql)
            return int(moved)

    moved = backend.run(work)
    if moved >= 0:
        where = getattr(backend, "path", "a shard")
        log.info("%s: %d change rows converted to the layout in commit order", where, moved)
    return moved >= 0


def copy_rows(backend: Backend, kind: str, rows: Sequence[Sequence[Any]]) -> None:
    """Insert one kind's change rows ``(kind, bucket, pos, id, op, version,
    updated, body)`` as read elsewhere, numbered after every row here in the
    order given (a bucket's, in position order); rows present are kept, one
    transaction."""

    def work(conn: Any) -> None:
        with backend.transaction(conn) as cur:
            cur.execute(f"SELECT {_next('?')}", [kind, kind])
            first = int(cur.fetchone()[0])
            cur.executemany(
                f"INSERT INTO {CHANGES} ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (kind, bucket, pos) DO NOTHING",
                [(r[0], first + i, *r[1:]) for i, r in enumerate(rows)],
            )

    if rows:
        backend.run(work)


def tops(backend: Backend, kind: str) -> int:
    """The last number this shard handed out to ``kind``'s changes (0: none)."""
    return int(backend.fetchall(f"SELECT {_next('?')} - 1", [kind, kind])[0][0])


def first_after(backend: Backend, kind: str, after: Sequence[tuple[int, int]]) -> int | None:
    """The least number of the rows after position ``p`` of each ``(bucket,
    p)`` (each bucket's first such row: a bucket's numbers grow with its
    positions), None when none has any; one index search a bucket."""
    best: int | None = None
    for start in range(0, len(after), 400):
        part = after[start : start + 400]
        values = ",".join(["(?,?)"] * len(part))
        sql = (
            f"SELECT MIN((SELECT c.seq FROM {CHANGES} AS c WHERE c.kind = ? "
            "AND c.bucket = r.column1 AND c.pos > r.column2 ORDER BY c.pos LIMIT 1)) "
            f"FROM (VALUES {values}) AS r"
        )
        got = backend.fetchall(sql, [kind, *(x for pair in part for x in pair)])[0][0]
        if got is not None and (best is None or int(got) < best):
            best = int(got)
    return best


def read_after(
    backend: Backend, kind: str, seq: int, limit: int
) -> tuple[list[tuple[Any, ...]], int]:
    """The next ``limit`` change rows of ``kind`` after number ``seq``, in
    commit order, ``(bucket, pos, id, op, version, updated, body)``, and the
    number of the last (``seq`` when none)."""

    def work(conn: Any) -> tuple[list[tuple[Any, ...]], int]:
        cur = conn.cursor()
        try:
            cur.execute("BEGIN")  # one read transaction: both statements see one state
            try:
                rows = cur.execute(_READ, [kind, seq, limit]).fetchall()
                if not rows:
                    return rows, seq
                last = cur.execute(_SEQ_AT, [kind, rows[-1][0], rows[-1][1]]).fetchone()
                return rows, int(last[0])
            finally:
                cur.execute("COMMIT")
        finally:
            cur.close()

    return backend.run(work)
