"""Reading the change feed's rows by ranges of positions, many ranges a
statement (:mod:`bagstore.feedread` asks them; the tables are
:mod:`bagstore.backends.changesql`'s)."""

from __future__ import annotations

import functools
import struct
from bisect import bisect_left
from collections.abc import Sequence
from itertools import chain, pairwise
from operator import add, itemgetter
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bagstore.backends.base import Backend

__all__ = ["CHANGES", "Known", "ranges_together", "read_ranges", "rows_per_range", "table_of"]

CHANGES = "bagstore_changes"


def _mysql(backend: Backend) -> bool:
    return backend.dialect.name == "mysql"


def rows_per_range(backend: Backend) -> int:
    """The least bound on the rows a reader asks of one bucket at a time
    (bagstore.feedread.next_rows raises it with the page: up to sixteen
    times a bucket's first read, within the reader's memory budget):
    MariaDB spends ~30 us on each range of an ``OR`` beyond its rows
    (measured: 200 ranges of 4 rows 20 ms, one range of 800 rows 8 ms), so
    it is asked for longer ones; on SQLite a range costs ~8k instructions
    beyond its rows (the search, the Python around it), half a row's
    reading: 16 rows keep that to ~1/16 of a row's cost."""
    return 32 if _mysql(backend) else 16


#: Ranges per statement of :func:`read_ranges`.
_RANGES_PER_STATEMENT = 200
_READ = "SELECT bucket, pos, id, op, version, updated, body FROM "
#: MariaDB through a driver that parses each column of a row in Python
#: (PyMySQL, ~0.4 us a column): the row's five integers and its id packed
#: by the server into one binary value of fixed widths, big-endian (a
#: bucket is below 65,536, an op below 256; HEX of a negative BIGINT is its
#: 64-bit two's complement), unpacked in C loops (:func:`_rows`).
#: Measured, 20,000 rows of 4 shards: 82 ms as seven columns, 46 ms packed,
#: the server's packing included; through mysqlclient (a C parser) 31 ms
#: against 40 ms, so it is not packed there.
_PACKED_READ = (
    "SELECT CONCAT(UNHEX(LPAD(HEX(bucket), 4, '0')), UNHEX(LPAD(HEX(pos), 16, '0')), id, "
    "UNHEX(LPAD(HEX(op), 2, '0')), UNHEX(LPAD(HEX(version), 16, '0')), "
    "UNHEX(LPAD(HEX(updated), 16, '0'))), body FROM "
)
#: A read without bodies (a reader short of memory, see
#: bagstore.feedread): each body's length in bytes in its place, NULL where
#: there is none.
_LENGTH = "LENGTH(body) FROM "
_PACKED = struct.Struct(">Hq16sBqq")
_FIRST, _SECOND = itemgetter(0), itemgetter(1)
#: SQLite: the sizes of the ``VALUES`` lists of ranges a read is padded to
#: (each ~1.4 times the last): a few statement texts, each compiled once per
#: connection (its statement cache), a padding range costing ~half a range.
_SIZES = (1, 2, 3, 4, 6, 8, 11, 16, 23, 32, 45, 64, 90, 128, 160, _RANGES_PER_STATEMENT)
_PAD = (-1, 1, 0)  # a range that holds nothing (no bucket -1, and lo > hi)
#: MariaDB: rows a span read may pass over (read and dropped by the server)
#: for each range it saves: a range of an ``OR`` costs ~17-30 us beyond its
#: rows, a row the scan reads and drops ~1 us (measured, 200 buckets of ~20
#: rows: 200 one-row ranges 3.6 ms, one span dropping all but those 3.7 ms).
_DROPPED_PER_RANGE = 16
#: MariaDB: buckets without a range at most between two ranges of a span.
_SPAN_GAP = 8
#: What a reader knows of the rows between ranges: ``({bucket: (last
#: position, last pruned, shard)}, the shard read)`` (see :func:`_spans`).
Known = tuple[dict[int, tuple[int, int, int]], int]


@functools.cache
def _values_sql(table: str, size: int, bodies: bool = True) -> str:
    """SQLite: the change rows of ``size`` ranges bound as ``VALUES (bucket, lo,
    hi), ...`` and then the kind; CROSS JOIN keeps the ranges the outer loop,
    each a primary-key search, in the order given (``bodies`` False: each
    body's length in its place)."""
    values = ",".join(["(?,?,?)"] * size)
    body = "c.body" if bodies else "LENGTH(c.body)"
    return (
        f"SELECT c.bucket, c.pos, c.id, c.op, c.version, c.updated, {body} "
        f"FROM (VALUES {values}) AS r CROSS JOIN {table} AS c WHERE c.kind = ? "
        "AND c.bucket = r.column1 AND c.pos >= r.column2 AND c.pos <= r.column3"
    )


def _spans(ranges: Sequence[tuple[int, int, int]], known: Known | None) -> list[int]:
    """MariaDB: the ``ranges`` (sorted, of one shard) cut into runs of buckets
    close together whose rows not asked are few (a run read as one span of
    buckets, the rows not asked dropped by the server): the length of each
    run.  A bucket's rows here are counted from ``known`` (its last position
    less its last pruned; rows written since or left by a bucket move are not
    known and not counted: a cost, never a row returned that was not
    asked); a run's rows not asked are at most :data:`_DROPPED_PER_RANGE`
    for each range it saves; a run holds one range a bucket."""
    if known is None or len(ranges) < 2:
        return [1] * len(ranges)
    ends, shard = known

    def here(b: int) -> int:
        end = ends.get(b)
        return end[0] - end[1] if end is not None and end[2] == shard else 0

    def dropped(r: tuple[int, int, int]) -> int:  # of a range's own bucket
        b, lo, hi = r
        end = ends.get(b)
        if end is None or end[2] != shard:
            return 0
        return max(0, lo - 1 - end[1]) + max(0, end[0] - hi)

    runs: list[int] = []
    n, waste = 1, dropped(ranges[0])
    for prev, r in pairwise(ranges):
        if 0 <= r[0] - prev[0] - 1 <= _SPAN_GAP:  # (a bucket's second range: another run)
            more = dropped(r) + sum(map(here, range(prev[0] + 1, r[0])))
            if waste + more <= _DROPPED_PER_RANGE * n:
                n, waste = n + 1, waste + more
                continue
        runs.append(n)
        n, waste = 1, dropped(r)
    runs.append(n)
    return runs


def _mysql_ranges(
    p: str, ranges: Sequence[tuple[int, int, int]], known: Known | None
) -> tuple[str, list[Any]]:
    """MariaDB: the condition on ``(bucket, pos)`` of ``ranges`` (see
    :func:`_ranges_sql`) and its parameters: an ``OR`` of one primary-key
    range a range, or of a run of ranges (:func:`_spans`), one range of
    buckets ``bucket >= first AND bucket <= last`` whose ``pos`` is kept
    between the ``ELT`` of its bucket's bounds (a bucket of the span without
    a range: ``1`` and ``0``, nothing kept), which InnoDB reads as one range
    of the key and filters as it goes."""
    parts: list[str] = []
    params: list[Any] = []
    at = 0
    for n in _spans(ranges, known):
        run = ranges[at : at + n]
        at += n
        if n == 1:
            parts.append(f"(bucket = {p} AND pos >= {p} AND pos <= {p})")
            params += run[0]
            continue
        first, last = run[0][0], run[-1][0]
        los, his = [1] * (last - first + 1), [0] * (last - first + 1)
        for b, lo, hi in run:
            los[b - first], his[b - first] = lo, hi
        elt = ", ".join([p] * len(los))
        parts.append(
            f"(bucket >= {p} AND bucket <= {p} AND pos >= ELT(bucket - {p}, {elt}) "
            f"AND pos <= ELT(bucket - {p}, {elt}))"
        )
        params += [first, last, first - 1, *los, first - 1, *his]
    return " OR ".join(parts), params


def _ranges_sql(
    backend: Backend,
    kind: str,
    ranges: Sequence[tuple[int, int, int]],
    qualified: bool,
    known: Known | None = None,
    bodies: bool = True,
) -> tuple[str, list[Any]]:
    """One ``SELECT`` of the change rows in ``ranges`` (at most
    :data:`_RANGES_PER_STATEMENT`) of one shard, and its parameters.
    MariaDB: one ``OR`` of the primary-key ranges, which InnoDB reads as one
    range scan in key order (a ``UNION ALL`` of them costs it a temporary
    table: 10-50% slower a row, measured), runs of ranges of buckets close
    together read as spans of buckets (:func:`_mysql_ranges`, given
    ``known``: what the reader knows of the rows between them).  SQLite: the ranges bound as a
    ``VALUES`` list joined to the table (a primary-key search a range, in the
    order given), padded to one of a few sizes (:data:`_SIZES`) with ranges
    that hold nothing, so that SQLite compiles each text once per connection
    (a ``UNION ALL`` of one ``SELECT`` a range was compiled at every read:
    ~1.5 M instructions for 200 ranges; it reads an ``OR`` with a temporary
    b-tree).  Measured (callgrind, 200 ranges of 5 rows): 10.6 M instructions
    a statement, against 12.5 M for the ranges as one JSON parameter
    (``json_each``, formatted and parsed a range).  ``bodies`` False: each
    body's length in its place (NULL where there is none)."""
    p = backend.dialect.param
    table = table_of(backend, CHANGES, qualified)
    params: list[Any] = []
    if _mysql(backend):
        where, params = _mysql_ranges(p, ranges, known)
        read = _PACKED_READ if backend.parses_in_python else _READ
        if not bodies:
            read = read.replace("body FROM ", _LENGTH)
        return f"{read}{table} WHERE kind = {p} AND ({where})", [kind, *params]
    n = len(ranges)
    size = _SIZES[bisect_left(_SIZES, n)]
    params = list(chain.from_iterable(ranges))
    if size > n:
        params += _PAD * (size - n)
    params.append(kind)
    return _values_sql(table, size, bodies), params


def read_ranges(
    backend: Backend,
    kind: str,
    ranges: Sequence[tuple[int, int, int]],
    known: Known | None = None,
    bodies: bool = True,
) -> list[tuple[Any, ...]]:
    """The change rows of ``kind`` with ``lo <= pos <= hi`` in each ``(bucket,
    lo, hi)`` (sorted), one statement per 200 ranges (see :func:`_ranges_sql`;
    ``known``: the reader's ``({bucket: (last position, last pruned, shard)},
    this shard)``, for MariaDB to read runs of them as spans of buckets);
    rows ``(bucket, pos, id, op, version, updated, body)`` as the driver
    returns them, normally in the order of ``ranges`` and positions (callers
    check); ``bodies`` False: each body's length (an int, or None) in its
    place."""
    out: list[tuple[Any, ...]] = []
    for start in range(0, len(ranges), _RANGES_PER_STATEMENT):
        sql, params = _ranges_sql(
            backend, kind, ranges[start : start + _RANGES_PER_STATEMENT], False, known, bodies
        )
        out += _rows(backend, backend.fetchall(sql, params))
    return out


def _rows(backend: Backend, rows: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """Change rows as :func:`_ranges_sql` read them from ``backend``, as
    ``(bucket, pos, id, op, version, updated, body)`` tuples: those read
    packed (:data:`_PACKED_READ`) unpacked, in C loops."""
    if not rows or not backend.parses_in_python:  # (True of MariaDB's only)
        return rows
    ints = _PACKED.iter_unpack(b"".join(map(_FIRST, rows)))
    return list(map(add, ints, zip(map(_SECOND, rows))))


def table_of(backend: Backend, table: str, qualified: bool) -> str:
    """``table``, qualified by the backend's schema with ``qualified``."""
    return f"{backend.dialect.q(backend.schema)}.{table}" if qualified and backend.schema else table


def ranges_together(
    kind: str,
    parts: Sequence[tuple[Backend, Sequence[tuple[int, int, int]], Known | None]],
    bodies: bool = True,
) -> list[tuple[Any, ...]]:
    """:func:`read_ranges` of several shards of one ``together`` key (each
    with what the reader knows of its rows, or None): a ``UNION ALL`` of one
    ``SELECT`` a shard (:func:`_ranges_sql`) on the first's connection, 200
    ranges per statement, rows in the order asked."""
    lead = parts[0][0]
    out: list[tuple[Any, ...]] = []
    chunk: list[tuple[Backend, Sequence[tuple[int, int, int]], Known | None]] = []
    size = 0

    def flush() -> None:
        selects: list[str] = []
        params: list[Any] = []
        for backend, ranges, known in chunk:
            sql, more = _ranges_sql(backend, kind, ranges, True, known, bodies)
            selects.append(sql)
            params += more
        reach = list({id(b): b for b, _, _ in chunk}.values())
        rows = lead.read_together(lead.dialect.union_all_sql(selects), params, reach)
        out.extend(_rows(lead, rows))

    for backend, ranges, known in parts:
        for start in range(0, len(ranges), _RANGES_PER_STATEMENT):
            part = ranges[start : start + _RANGES_PER_STATEMENT]
            if size + len(part) > _RANGES_PER_STATEMENT and chunk:
                flush()
                chunk, size = [], 0
            chunk.append((backend, part, known))
            size += len(part)
    if chunk:
        flush()
    return out
