"""SQL of the change feed: change rows, per-bucket positions, and the triggers
that write them in the same statement as the entity.

Every shard holds

``bagstore_changes``, one row per committed write of a kind whose feed is on:
``(kind, bucket, pos)`` is the primary key; ``id``, ``op`` (0 put, 1 delete),
``version`` (after a put, the row's new version; after a delete, the version
deleted), ``updated`` (µs) and ``body`` (NULL unless the kind records bodies).

``bagstore_change_pos``, one row per ``(kind, bucket)``: ``pos``, the last
position handed out, and ``pruned``, the last position deleted by retention.

Triggers on a kind's entities table (``AFTER INSERT``, ``AFTER UPDATE`` of the
version, ``AFTER DELETE``) advance the bucket's position row and insert the
change row.  They run inside the statement that writes the entity, so a
committed write always has its change and a rolled-back one never.  The
position row is locked (written) until the transaction ends, so writers of one
bucket take positions in commit order, one after the other: a reader that has
seen position ``p`` of a bucket has seen every position below it.

Only writes to a bucket this shard ``OWNED`` record a change: a bucket move's
copies (into an ``INCOMING`` bucket) and deletes (after the source let go of
the bucket) do not; the move copies the change rows themselves.  A delete of an
entity whose row is named in ``bagstore_change_skip`` (in the same transaction)
records nothing: a put that moved an entity to another bucket deletes the old
copy that way, and records only the put.

Nothing here decides which shard to ask: that is :mod:`bagstore.changes`.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from operator import itemgetter
from typing import TYPE_CHECKING, Any, NamedTuple, cast

from bagstore.backends import changeseq
from bagstore.backends.changerange import (
    CHANGES,
    ranges_together,
    read_ranges,
    rows_per_range,
    table_of,
)
from bagstore.errors import ConfigurationError

if TYPE_CHECKING:
    from bagstore.backends.base import Backend, Dialect

__all__ = [
    "CHANGES",
    "DELETE",
    "POSITIONS",
    "PUT",
    "SKIP",
    "ChangeRow",
    "Positions",
    "Sums",
    "bucket_change_rows",
    "bucket_change_tops",
    "bucket_positions",
    "clear_bucket_changes",
    "copy_change_rows",
    "ensure_change_tables",
    "first_updated",
    "has_triggers",
    "positions",
    "positions_together",
    "prune",
    "ranges_together",
    "read_ranges",
    "rows_per_range",
    "set_positions",
    "set_triggers",
    "skip_sql",
]

POSITIONS = "bagstore_change_pos"
SKIP = "bagstore_change_skip"
PUT, DELETE = 0, 1
_COLUMNS = "kind, bucket, pos, id, op, version, updated, body"


class ChangeRow(NamedTuple):
    """One row of ``bagstore_changes`` as read."""

    kind: str
    bucket: int
    pos: int
    id: bytes
    op: int
    version: int
    updated: int
    body: bytes | None


def _literal(kind: str) -> str:
    """A kind's name as an SQL string literal (a plain identifier, checked:
    trigger bodies cannot take parameters)."""
    if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,63}", kind) is None:
        raise ConfigurationError(f"kind {kind!r} is not a plain identifier")
    return f"'{kind}'"


def _mysql(d: Dialect) -> bool:
    return d.name == "mysql"


def _suffix(d: Dialect) -> str:
    return " ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin" if _mysql(d) else ""


def _no_rowid(d: Dialect) -> str:
    return "" if _mysql(d) else " WITHOUT ROWID"


def _body_type(d: Dialect) -> str:
    return "MEDIUMBLOB" if _mysql(d) else "BLOB"


def _tables_sql(d: Dialect) -> list[str]:
    if not _mysql(d):  # kept in commit order (bagstore.backends.changeseq)
        changes = changeseq.tables_sql()
    else:
        changes = [
            f"CREATE TABLE IF NOT EXISTS {CHANGES} (kind VARCHAR(64) NOT NULL, "
            "bucket INTEGER NOT NULL, pos BIGINT NOT NULL, "
            f"id {d.id_type} NOT NULL, op INTEGER NOT NULL, version BIGINT NOT NULL, "
            f"updated BIGINT NOT NULL, body {_body_type(d)} NULL, "
            f"PRIMARY KEY (kind, bucket, pos)){_suffix(d)}",
        ]
    return [
        *changes,
        f"CREATE TABLE IF NOT EXISTS {POSITIONS} (kind VARCHAR(64) NOT NULL, "
        "bucket INTEGER NOT NULL, pos BIGINT NOT NULL, pruned BIGINT NOT NULL, "
        f"PRIMARY KEY (kind, bucket)){_no_rowid(d)}{_suffix(d)}",
        f"CREATE TABLE IF NOT EXISTS {SKIP} (kind VARCHAR(64) NOT NULL, "
        f"id {d.id_type} NOT NULL, PRIMARY KEY (kind, id)){_no_rowid(d)}{_suffix(d)}",
    ]


def ensure_change_tables(backend: Backend) -> None:
    """The change tables on one shard (created when missing; on SQLite, a
    store's made before they were kept in commit order converted)."""
    if not _mysql(backend.dialect):
        changeseq.convert(backend)
    backend._executescript(_tables_sql(backend.dialect))


def _trigger_names(kind: str) -> tuple[str, str, str]:
    digest = hashlib.blake2b(kind.encode(), digest_size=8).hexdigest()
    return (f"bagstore_chg_{digest}_i", f"bagstore_chg_{digest}_u", f"bagstore_chg_{digest}_d")


def _record(d: Dialect, kind: str, row: str, op: int, body: str) -> str:
    """The two statements that record one change of ``row`` (NEW or OLD)."""
    k = _literal(kind)
    if _mysql(d):
        bump = (
            f"INSERT INTO {POSITIONS} (kind, bucket, pos, pruned) VALUES ({k}, {row}.bucket, 1, 0) "
            "ON DUPLICATE KEY UPDATE pos = pos + 1"
        )
        now = "CAST(UNIX_TIMESTAMP(NOW(6)) * 1000000 AS SIGNED)"
    else:
        bump = (
            f"INSERT INTO {POSITIONS} (kind, bucket, pos, pruned) VALUES ({k}, {row}.bucket, 1, 0) "
            "ON CONFLICT (kind, bucket) DO UPDATE SET pos = pos + 1"
        )
        now = "CAST((julianday('now') - 2440587.5) * 86400000000 AS INTEGER)"
    updated = f"{row}.updated" if op == PUT else now
    if not _mysql(d):
        values = f"{row}.id, {op}, {row}.version, {updated}, {body}"
        return f"{bump}; {changeseq.record_sql(k, f'{row}.bucket', values, POSITIONS)}"
    insert = (
        f"INSERT INTO {CHANGES} ({_COLUMNS}) SELECT {k}, {row}.bucket, pos, {row}.id, {op}, "
        f"{row}.version, {updated}, {body} FROM {POSITIONS} "
        f"WHERE kind = {k} AND bucket = {row}.bucket"
    )
    return f"{bump}; {insert};"


def triggers_sql(d: Dialect, kind: str, bodies: bool) -> list[str]:
    t = d.q(kind)
    ins, upd, dele = _trigger_names(kind)
    k = _literal(kind)

    def owned(row: str) -> str:
        return f"(SELECT state FROM bagstore_owned WHERE bucket = {row}.bucket) = 0"

    body = "NEW.body" if bodies else "NULL"
    skip = f"NOT EXISTS (SELECT 1 FROM {SKIP} WHERE kind = {k} AND id = OLD.id)"
    parts = [
        (ins, "INSERT", owned("NEW"), _record(d, kind, "NEW", PUT, body)),
        (upd, "UPDATE", f"NEW.version <> OLD.version AND {owned('NEW')}",
         _record(d, kind, "NEW", PUT, body)),
        (dele, "DELETE", f"{owned('OLD')} AND {skip}", _record(d, kind, "OLD", DELETE, "NULL")),
    ]  # fmt: skip
    if _mysql(d):
        return [
            f"CREATE OR REPLACE TRIGGER {name} AFTER {event} ON {t} FOR EACH ROW "
            f"BEGIN IF {when} THEN {record} END IF; END"
            for name, event, when, record in parts
        ]
    return [
        f"CREATE TRIGGER {name} AFTER {event} ON {t} FOR EACH ROW WHEN {when} BEGIN {record} END"
        for name, event, when, record in parts
    ]


def set_triggers(backend: Backend, kind: str, *, on: bool, bodies: bool = False) -> None:
    """Create (``on``, with or without bodies) or drop the triggers that record
    ``kind``'s changes on one shard: replaced in one step, so that no write
    goes unrecorded while the body setting changes."""
    d = backend.dialect
    drops = [f"DROP TRIGGER IF EXISTS {name}" for name in _trigger_names(kind)]
    if on:
        ensure_change_tables(backend)
        backend.ensure_kind(kind)
    if _mysql(d):
        statements = triggers_sql(d, kind, bodies) if on else drops
        backend._executescript(statements)
        return
    statements = drops + (triggers_sql(d, kind, bodies) if on else [])

    def work(conn: Any) -> None:
        with backend.transaction(conn) as cur:  # SQLite's DDL is transactional
            for sql in statements:
                cur.execute(sql)

    backend.run(work)


def has_triggers(backend: Backend, kind: str) -> bool:
    """Whether every trigger recording ``kind``'s changes is on this shard."""
    names = list(_trigger_names(kind))
    d = backend.dialect
    if _mysql(d):
        sql = (
            "SELECT trigger_name FROM information_schema.triggers "
            f"WHERE trigger_schema = DATABASE() AND trigger_name IN ({d.params(3)})"
        )
    else:
        sql = f"SELECT name FROM sqlite_master WHERE type = 'trigger' AND name IN ({d.params(3)})"
    return len(backend.fetchall(sql, names)) == 3


def skip_sql(d: Dialect, n: int, *, insert: bool) -> str:
    """Mark (``insert``) or unmark ``n`` ids of one kind whose delete records
    nothing; parameters: the kind, then the ids."""
    if insert:
        values = ", ".join([f"({d.param}, {d.param})"] * n)
        return f"INSERT INTO {SKIP} (kind, id) VALUES {values}"
    return f"DELETE FROM {SKIP} WHERE kind = {d.param} AND id IN ({d.params(n)})"


#: What a shard's positions of a kind add up to, read with them: (rows, sum
#: of the buckets, of the last positions, of the last pruned).  Positions and
#: pruned positions only grow, and a bucket's row goes only when a move has
#: taken the bucket away: between two reads with no row gone, equal sums mean
#: equal positions.
Sums = tuple[int, int, int, int]
#: ``(what they add up to, {bucket: (last position, last pruned)} or None
#: when they add up to what the reader knew)``
Positions = tuple[Sums, "dict[int, tuple[int, int]] | None"]
_NONE_KNOWN = (-1, -1, -1, -1)


def positions(backend: Backend, kind: str, unless: Sums | None = None) -> Positions:
    """``{bucket: (last position, last pruned)}`` of ``kind`` on this shard,
    and what they add up to; None for the positions when they add up to
    ``unless`` (what the positions the reader read last added up to: one
    row, not one a bucket, for a reader polling the feed's end)."""
    if _mysql(backend.dialect):
        sql, params = _positions_sql(backend, 0, kind, False, unless)
        row = backend.fetchall(sql, params)[0]
        return _read_positions(backend, kind, False, row[1:], unless)
    # SQLite: the sums, then the rows if they moved (two statements cost no
    # round trip here; its text of them is slower to make and read than rows:
    # 256 buckets 350 us, rows 180 us, sums 40 us, measured)
    if unless is not None:
        row = backend.fetchall(
            f"SELECT COUNT(*), SUM(bucket), SUM(pos), SUM(pruned) FROM {POSITIONS} "
            f"WHERE kind = {backend.dialect.param}",
            [kind],
        )[0]
        sums = cast("Sums", tuple(int(x or 0) for x in row))
        if sums == unless:
            return sums, None
    return _as_rows(backend, kind, False)


def _read_positions(
    backend: Backend, kind: str, qualified: bool, row: Sequence[Any], unless: Sums | None
) -> Positions:
    """MariaDB: the positions of one row of :func:`_positions_sql` (sums,
    then text), read as rows when its text was cut short."""
    sums = cast("Sums", tuple(int(x or 0) for x in row[:4]))
    if sums == unless:
        return sums, None
    found = _concatenated(sums, row[4])
    if found is not None:
        return sums, found
    return _as_rows(backend, kind, qualified)


def _as_rows(backend: Backend, kind: str, qualified: bool) -> Positions:
    """A shard's positions of ``kind`` read as rows, and their sums."""
    rows = backend.fetchall(
        f"SELECT bucket, pos, pruned FROM {table_of(backend, POSITIONS, qualified)} "
        f"WHERE kind = {backend.dialect.param}",
        [kind],
    )
    if _mysql(backend.dialect):
        found = {int(b): (int(p), int(q)) for b, p, q in rows}
    else:  # SQLite's integer columns read as ints: C loops, no bytecode a row
        found = dict(zip(map(_TOP, rows), map(_REST, rows), strict=True))
    tops, pruned = map(_TOP, found.values()), map(_PRUNED, found.values())
    return (len(found), sum(found), sum(tops), sum(pruned)), found


_TOP, _PRUNED, _REST = itemgetter(0), itemgetter(1), itemgetter(1, 2)


def _positions_sql(
    backend: Backend, no: int, kind: str, qualified: bool, unless: Sums | None
) -> tuple[str, list[Any]]:
    """MariaDB: a shard's positions of ``kind`` as one row ``(no, count, sum
    of buckets, of positions, of pruned, text)``, the text
    ``bucket,pos,pruned,...``, or NULL when the sums are ``unless``: one row
    for the driver to parse where there were one a bucket (PyMySQL parses a
    row in Python: 1,024 positions of 4 shards read in ~5 ms as rows, ~2 ms
    so, measured).  The session's ``group_concat_max_len`` (see
    ``INIT_COMMAND``) holds a store's 65,536 buckets; :func:`_concatenated`
    checks the text whole anyway."""
    p = backend.dialect.param
    return (
        f"SELECT {int(no)}, COUNT(*), SUM(bucket), SUM(pos), SUM(pruned), "
        f"CASE WHEN COUNT(*) = {p} AND SUM(bucket) = {p} AND SUM(pos) = {p} "
        f"AND SUM(pruned) = {p} THEN NULL "
        "ELSE GROUP_CONCAT(bucket, ',', pos, ',', pruned SEPARATOR ',') END "
        f"FROM {table_of(backend, POSITIONS, qualified)} WHERE kind = {p}",
        [*(unless or _NONE_KNOWN), kind],
    )


def _concatenated(sums: Sums, text: Any) -> dict[int, tuple[int, int]] | None:
    """The positions of a text of :func:`_positions_sql`, or None unless it
    holds ``sums[0]`` of them adding up to the sums (a text cut short, even
    within its last number: read them as rows)."""
    count = sums[0]
    if not count:
        return {}
    if isinstance(text, bytes | bytearray):
        text = text.decode("ascii")
    if not isinstance(text, str):
        return None
    try:
        flat = list(map(int, text.split(",")))
    except ValueError:  # cut after a comma
        return None
    if len(flat) != 3 * count or (sum(flat[0::3]), sum(flat[1::3]), sum(flat[2::3])) != sums[1:]:
        return None
    return dict(zip(flat[0::3], zip(flat[1::3], flat[2::3], strict=True), strict=True))


def _row(r: Sequence[Any]) -> ChangeRow:
    return ChangeRow(
        str(r[0]),
        int(r[1]),
        int(r[2]),
        bytes(r[3]),
        int(r[4]),
        int(r[5]),
        int(r[6]),
        None if r[7] is None else bytes(r[7]),
    )


def positions_together(
    kind: str, shards: Sequence[tuple[int, Backend, Sums | None]]
) -> dict[int, Positions]:
    """:func:`positions` of several shards of one ``together`` key in one
    statement (on the first's connection): ``(shard, backend, unless)`` each;
    ``{shard: (sums, positions or None)}``."""
    lead = shards[0][1]
    if not _mysql(lead.dialect):
        return {no: positions(b, kind, unless) for no, b, unless in shards}
    reach = [b for _, b, _ in shards]
    parts = [_positions_sql(b, no, kind, True, unless) for no, b, unless in shards]
    params = [x for _, more in parts for x in more]
    rows = lead.read_together(lead.dialect.union_all_sql([q for q, _ in parts]), params, reach)
    by_no = {int(r[0]): r[1:] for r in rows}
    return {no: _read_positions(b, kind, True, by_no[no], unless) for no, b, unless in shards}


def first_updated(backend: Backend, kind: str, at: Sequence[tuple[int, int]]) -> dict[int, int]:
    """``{bucket: updated}`` of the change at each ``(bucket, pos)`` present."""
    if not at:
        return {}
    rows = read_ranges(backend, kind, [(b, pos, pos) for b, pos in at])
    return {int(r[0]): int(r[5]) for r in rows}


# -- bucket moves ------------------------------------------------------------------
def bucket_positions(backend: Backend, bucket: int) -> dict[str, tuple[int, int]]:
    """``{kind: (pos, pruned)}`` of one bucket on this shard."""
    d = backend.dialect
    rows = backend.fetchall(
        f"SELECT kind, pos, pruned FROM {POSITIONS} WHERE bucket = {d.param}", [bucket]
    )
    return {str(k): (int(p), int(q)) for k, p, q in rows}


def bucket_change_tops(backend: Backend, bucket: int) -> dict[str, int]:
    """``{kind: highest position held}`` of one bucket's change rows here."""
    d = backend.dialect
    rows = backend.fetchall(
        f"SELECT kind, MAX(pos) FROM {CHANGES} WHERE bucket = {d.param} GROUP BY kind", [bucket]
    )
    return {str(k): int(p) for k, p in rows}


def bucket_change_rows(
    backend: Backend, kind: str, bucket: int, after: int, limit: int
) -> list[ChangeRow]:
    """The next ``limit`` change rows of a bucket after position ``after``."""
    _d, p = backend.dialect, backend.dialect.param
    sql = (
        f"SELECT {_COLUMNS} FROM {CHANGES} WHERE kind = {p} AND bucket = {p} AND pos > {p} "
        f"ORDER BY pos LIMIT {int(limit)}"
    )
    return [_row(r) for r in backend.fetchall(sql, [kind, bucket, after])]


def copy_change_rows(backend: Backend, rows: Sequence[ChangeRow]) -> None:
    """Insert one kind's change rows as read elsewhere, in position order
    (rows present are kept; on SQLite numbered after every row here)."""
    if rows and not _mysql(backend.dialect):
        changeseq.copy_rows(backend, rows[0].kind, rows)
    elif rows:
        backend.insert_ignore(CHANGES, _COLUMNS.split(", "), [tuple(r) for r in rows])


def set_positions(backend: Backend, bucket: int, tops: dict[str, tuple[int, int]]) -> None:
    """Set a bucket's position rows (``{kind: (pos, pruned)}``)."""
    for kind, (pos, pruned) in tops.items():
        backend.upsert(POSITIONS, {"kind": kind, "bucket": bucket}, {"pos": pos, "pruned": pruned})


def clear_bucket_changes(backend: Backend, bucket: int, step: int = 1000) -> int:
    """Delete a bucket's change rows and position rows on this shard (the
    rows in steps of ``step`` positions); the number of change rows deleted."""
    p = backend.dialect.param
    # positions first: a reader never takes this shard for the bucket's holder
    # while its rows are going
    backend.execute(f"DELETE FROM {POSITIONS} WHERE bucket = {p}", [bucket])
    deleted = 0
    spans = backend.fetchall(
        f"SELECT kind, MIN(pos), MAX(pos) FROM {CHANGES} WHERE bucket = {p} GROUP BY kind",
        [bucket],
    )
    for kind, low, high in spans:
        changeseq.raise_floor(backend, kind)
        for start in range(int(low), int(high) + 1, step):
            deleted += backend.execute(
                f"DELETE FROM {CHANGES} WHERE kind = {p} AND bucket = {p} "
                f"AND pos >= {p} AND pos < {p}",
                [kind, bucket, start, start + step],
            )
    return deleted


# -- retention ----------------------------------------------------------------------
def prune(
    backend: Backend, kind: str, bucket: int, upto: int, older_than: int | None, batch: int
) -> tuple[int, int]:
    """Delete change rows of a bucket with ``pos <= upto`` (and, with
    ``older_than``, only the prefix of them older than that many µs), ``batch``
    rows per statement; record the last position deleted.  Returns ``(rows
    deleted, new pruned position)``."""
    low, upto = mark_pruned(backend, kind, bucket, upto, older_than)
    return delete_pruned(backend, kind, bucket, low, upto, batch), upto


def mark_pruned(
    backend: Backend, kind: str, bucket: int, upto: int, older_than: int | None
) -> tuple[int, int]:
    """What :func:`prune` deletes, marked (``pruned`` set) before any row goes:
    ``(the last position pruned before, the new)`` (the same when none)."""
    p = backend.dialect.param
    if older_than is not None:
        rows = backend.fetchall(
            f"SELECT MIN(pos) FROM {CHANGES} WHERE kind = {p} AND bucket = {p} "
            f"AND pos <= {p} AND updated >= {p}",
            [kind, bucket, upto, older_than],
        )
        if rows and rows[0][0] is not None:
            upto = int(rows[0][0]) - 1
    current = backend.fetchall(
        f"SELECT pruned FROM {POSITIONS} WHERE kind = {p} AND bucket = {p}", [kind, bucket]
    )
    low = int(current[0][0]) if current else 0
    if not current or low >= upto:
        return low, low
    changeseq.raise_floor(backend, kind)
    # Marked before the rows go: a reader that finds a row missing below the
    # mark knows why (see bagstore.changes).
    backend.update(POSITIONS, {"pruned": upto}, {"kind": kind, "bucket": bucket})
    return low, upto


def lower_mark(backend: Backend, kind: str, bucket: int, marked: int, to: int) -> bool:
    """Set a bucket's ``pruned`` mark back from ``marked`` (its rows not
    deleted yet) to ``to``; False if it is no longer ``marked``."""
    where = {"kind": kind, "bucket": bucket, "pruned": marked}
    return bool(backend.update(POSITIONS, {"pruned": to}, where))


def delete_marked(backend: Backend, kind: str, bucket: int, pruned: int, batch: int) -> int:
    """Delete a bucket's change rows at or below its mark ``pruned`` that are
    here still (copied by a bucket move before a pass marked them); how many."""
    p = backend.dialect.param
    rows = backend.fetchall(
        f"SELECT MIN(pos) FROM {CHANGES} WHERE kind = {p} AND bucket = {p} AND pos <= {p}",
        [kind, bucket, pruned],
    )
    if not rows or rows[0][0] is None:
        return 0
    changeseq.raise_floor(backend, kind)
    return delete_pruned(backend, kind, bucket, int(rows[0][0]) - 1, pruned, batch)


def delete_pruned(backend: Backend, kind: str, bucket: int, low: int, upto: int, batch: int) -> int:
    """Delete a bucket's change rows after ``low`` up to its mark ``upto``,
    ``batch`` rows a statement; how many."""
    p = backend.dialect.param
    deleted = 0
    while low < upto:
        high = min(upto, low + batch)
        deleted += backend.execute(
            f"DELETE FROM {CHANGES} WHERE kind = {p} AND bucket = {p} AND pos > {p} AND pos <= {p}",
            [kind, bucket, low, high],
        )
        low = high
    return deleted
