"""SQL for keyset-paged range scans of index tables (:class:`Scan`).

A scan reads one index table in index order, from a keyset position onwards,
optionally joined with the kind's entity tables (the bodies in the same
statement) and merged over several databases that one connection reaches.
The text of a scan of one shape is built once.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from bagstore.backends.indexsql import ENTITY_ID

if TYPE_CHECKING:
    from bagstore.backends.base import Dialect

__all__ = ["Scan", "ScanOps", "scan_sql"]


@dataclass
class Scan:
    """One keyset-paged range scan of an index table on one shard.

    ``eq`` gives, for each leading column, the stored keys it may equal (one
    value, or several for ``__in``); ``lower``/``upper`` bound the next column;
    ``after`` is the keyset position (the order columns then entity id) to
    continue strictly after.
    """

    table: str
    columns: tuple[str, ...]
    eq: list[list[bytes]] = field(default_factory=list)
    lower: tuple[bytes, bool] | None = None
    upper: tuple[bytes, bool] | None = None
    after: tuple[bytes, ...] | None = None
    desc: bool = False
    limit: int = 100
    #: Read entity bodies in the same statement: the kind whose entity tables
    #: each row is LEFT JOINed with, and those tables' databases (None: the
    #: scanned one).  Each row then ends, after the order columns, with
    #: ``which, bucket, body`` of the first of those tables (in ``join`` order)
    #: that holds the entity: its position, the copy's bucket, its body (three
    #: NULLs if none does).
    join_kind: str | None = None
    join: tuple[str | None, ...] = ()
    #: Scan the index tables of these databases as one (shards that one
    #: connection reaches): each part's own ordered, limited scan, merged in
    #: index order and limited again, in one statement.
    parts: tuple[str, ...] = ()

    @property
    def order_columns(self) -> tuple[str, ...]:
        return (*self.columns[len(self.eq) :], ENTITY_ID)

    @property
    def order_width(self) -> int:
        """``len(order_columns)``, without building them."""
        return len(self.columns) - len(self.eq) + 1


def scan_sql(d: Dialect, s: Scan, *, schema: str | None = None) -> tuple[str, list[Any]]:
    """``SELECT <order columns> FROM t WHERE ... ORDER BY ... LIMIT n``; with
    ``schema``, the table of that database (``s.parts``: of those databases,
    merged)."""
    params: list[Any] = []
    for values in s.eq:
        params.extend(values)
    if s.lower is not None:
        params.append(s.lower[0])
    if s.upper is not None:
        params.append(s.upper[0])
    if s.after is not None:
        after = s.after
        if len(after) != len(s.order_columns):
            raise ValueError("cursor does not match the index columns")
        params.append(after[0])
        for value in after[:-1]:
            params += (value, value)
        params.append(after[-1])
    if s.parts:
        params *= len(s.parts)
    sql = _scan_text(
        d,
        s.table,
        s.columns,
        tuple(len(v) for v in s.eq),
        None if s.lower is None else s.lower[1],
        None if s.upper is None else s.upper[1],
        s.after is not None,
        s.desc,
        int(s.limit),
        schema,
        s.join_kind,
        s.join,
        s.parts,
    )
    return sql, params


@functools.lru_cache(maxsize=4096)
def _scan_text(
    d: Dialect,
    table: str,
    columns: tuple[str, ...],
    eq_counts: tuple[int, ...],
    lower: bool | None,
    upper: bool | None,
    after: bool,
    desc: bool,
    limit: int,
    schema: str | None,
    join_kind: str | None = None,
    join: tuple[str | None, ...] = (),
    parts: tuple[str, ...] = (),
) -> str:
    """The text of :func:`scan_sql` for scans of one shape (built once)."""
    order = (*columns[len(eq_counts) :], ENTITY_ID)
    direction = " DESC" if desc else ""

    def select(alias: str, source: str, extra: str = "", sorted_: bool = True) -> str:
        """The scan of one index table (``source``), its columns named through
        ``alias``; ``extra``: more columns after the order columns; ``sorted_``:
        with its ORDER BY and LIMIT."""
        where: list[str] = []
        for name, count in zip(columns, eq_counts, strict=False):
            if count == 1:
                where.append(f"{alias}{d.q(name)} = {d.param}")
            else:
                where.append(f"{alias}{d.q(name)} IN ({d.params(count)})")
        if lower is not None:
            where.append(f"{alias}{d.q(order[0])} {'>=' if lower else '>'} {d.param}")
        if upper is not None:
            where.append(f"{alias}{d.q(order[0])} {'<=' if upper else '<'} {d.param}")
        if after:
            where.append(_keyset(d, tuple(alias + d.q(c) for c in order), "<" if desc else ">"))
        sql = f"SELECT {', '.join(alias + d.q(c) for c in order)}{extra} FROM {source}" + (
            f" WHERE {' AND '.join(where)}" if where else ""
        )
        if not sorted_:
            return sql
        by = ", ".join(alias + d.q(c) + direction for c in order)
        return f"{sql} ORDER BY {by} LIMIT {limit}"

    def in_db(db: str | None, name: str) -> str:
        return d.q(name) if db is None else f"{d.q(db)}.{d.q(name)}"

    # Parts: each database's scan, then the whole in index order.
    merged = ""
    if parts:
        each = d.limit_union_parts
        merged = d.union_all_sql([select("", in_db(db, table), "", each) for db in parts]) + (
            f" ORDER BY {', '.join(d.q(c) + direction for c in order)} LIMIT {limit}"
        )
    if join_kind is None:
        return merged or select("", in_db(schema, table))
    # Joined, every column of the index rows is named through the alias ``i``
    # (a property may share a name with a column of the entity tables).
    # Each table is looked in only while the tables before it have found no
    # copy: a NULL key matches nothing, and both SQLite and MariaDB skip the
    # lookup of a NULL key (a row's entity is in one table; the other lookups
    # found nothing at ~0.4 us each on SQLite, 60 of them for 20 rows over 4
    # files).  The columns below take the first copy found in any case.
    tables = range(len(join or (None,)))
    joins = ""
    entity_id = f"i.{d.q(ENTITY_ID)}"
    for n, db in zip(tables, join or (None,), strict=True):
        entities = in_db(db if db is not None else schema, join_kind)
        key = entity_id
        if n:
            found = ", ".join(f"e{m}.id" for m in range(n))
            found = f"COALESCE({found})" if n > 1 else found
            key = f"CASE WHEN {found} IS NULL THEN {entity_id} END"
        joins += f" LEFT JOIN {entities} AS e{n} ON e{n}.id = {key}"
    # One copy per row, three columns, however many tables are joined (a
    # driver in pure Python spends more on columns than the server does on
    # these): bucket and body are NOT NULL, so both COALESCEs stop at the
    # table that CASE names.
    which = " ".join(f"WHEN e{n}.id IS NOT NULL THEN {n}" for n in tables)
    buckets = ", ".join(f"e{n}.bucket" for n in tables)
    bodies = ", ".join(f"e{n}.body" for n in tables)
    if len(tables) > 1:  # (SQLite's COALESCE takes two or more)
        buckets, bodies = f"COALESCE({buckets})", f"COALESCE({bodies})"
    extra = f", CASE {which} END, {buckets}, {bodies}"
    if not merged:
        return select("i.", f"{in_db(schema, table)} AS i{joins}", extra)
    # The merged rows (a page at most) joined, then put back in index order.
    cols = ", ".join(f"i.{d.q(c)}" for c in order)
    return (
        f"SELECT {cols}{extra} FROM ({merged}) AS i{joins}"
        f" ORDER BY {', '.join(f'i.{d.q(c)}{direction}' for c in order)}"
    )


def _keyset(d: Dialect, cols: Sequence[str], op: str) -> str:
    """``(a, b, c) > (x, y, z)`` spelled so every optimiser uses the index:
    ``a >= x AND (a > x OR (a = x AND (b > y OR (b = y AND c > z))))``; the
    parameters are ``x, x, x, y, y, z`` (see :func:`scan_sql`).  ``cols`` are
    quoted (and qualified) already."""
    inner = f"{cols[-1]} {op} {d.param}"
    for c in reversed(cols[:-1]):
        inner = f"{c} {op} {d.param} OR ({c} = {d.param} AND ({inner}))"
    return f"{cols[0]} {op}= {d.param} AND ({inner})"


class ScanOps:
    """Index scans; mixed into :class:`bagstore.backends.base.Backend`."""

    # Provided by Backend:
    dialect: Dialect
    scans: int
    schema: str | None

    def fetchall(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        raise NotImplementedError

    def read_together(
        self, sql: str, params: Sequence[Any], reach: Sequence[Any]
    ) -> list[tuple[Any, ...]]:
        raise NotImplementedError

    def scan_index(self, scan: Scan, reach: Sequence[Any] = ()) -> list[tuple[bytes, ...]]:
        """One page of ``scan`` (tuples of bytes, as every driver gives them);
        ``reach``: the other shards whose tables ``scan.parts`` and
        ``scan.join`` name (those of the parts first)."""
        self.scans += 1
        for other in reach[: max(0, len(scan.parts) - 1)]:
            other.scans += 1
        if not reach:
            sql, params = scan_sql(self.dialect, scan)
            return self.fetchall(sql, params)
        sql, params = scan_sql(self.dialect, scan, schema=self.schema)
        return self.read_together(sql, params, [self, *reach])
