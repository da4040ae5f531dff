"""The storage backend: one shard's database, its connections, and all its SQL.

A :class:`Backend` owns the connections to one shard and runs every statement
bagstore sends there.  The SQL text is built by its :class:`Dialect` (data plus
small builder methods); ``sqlite.py`` and ``mysql.py`` subclass both.  Nothing
outside ``backends/`` writes SQL or asks which database it talks to.

Identifiers are checked against ``^[A-Za-z_][A-Za-z0-9_]{0,63}$`` and quoted;
values are always bound parameters.  Driver exceptions are translated into the
bagstore error tree in exactly one place, :func:`translate_errors`.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, TypeVar

from bagstore.backends.buckets import BucketOps, ownership_error
from bagstore.backends.changesql import ensure_change_tables, skip_sql
from bagstore.backends.indexsql import BUCKET, CLAIMED, ENTITY_ID, IndexOps
from bagstore.errors import BackendError, BagstoreError, ConfigurationError, ShardUnavailable
from bagstore.versions import clock, next_version

__all__ = [
    "ENTITY_COLUMNS",
    "IDENTIFIER",
    "TOGETHER_MAX_IDS",
    "Backend",
    "Dialect",
    "EntityRow",
    "Stored",
    "Within",
    "check_identifier",
    "read_bodies_together",
    "translate_errors",
]

IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")

#: The columns every entities table has (see ``Dialect.create_entities_sql``).
ENTITY_COLUMNS = frozenset({"added_id", "id", "bucket", "updated", "version", "body"})

T = TypeVar("T")

#: ``within(cursor, {id: old body or None})``: work run inside an entity
#: write's transaction (see :meth:`Backend.put_entities`).
Within = Callable[[Any, "dict[bytes, bytes | None]"], None]

log = logging.getLogger(__name__)


def check_identifier(name: object, what: str = "name") -> str:
    """Return ``name`` if it is a plain identifier, else raise ``ConfigurationError``.

    >>> check_identifier("index_user_id")
    'index_user_id'
    """
    if not isinstance(name, str) or IDENTIFIER.fullmatch(name) is None:
        raise ConfigurationError(
            f"{what} {name!r} is not a plain identifier "
            "(letters, digits and _, not starting with a digit, at most 64 characters)"
        )
    return name


@dataclass(frozen=True, slots=True)
class EntityRow:
    """One row of an entities table as bagstore writes it."""

    id: bytes
    bucket: int
    updated: int  # microseconds since the Unix epoch, UTC
    body: bytes


class Stored(NamedTuple):
    """An entity row as read back: encoded body, version, updated (µs)."""

    body: bytes
    version: int
    updated: int


class Dialect:
    """SQL text for one database family.  Subclasses override what differs."""

    name: ClassVar[str] = "generic"
    param: ClassVar[str] = "?"
    quote_char: ClassVar[str] = '"'
    for_update: ClassVar[str] = ""
    share_lock: ClassVar[str] = ""
    begin_write: ClassVar[str] = "BEGIN"
    key_type: ClassVar[str] = "BLOB"
    id_type: ClassVar[str] = "BLOB"
    int_type: ClassVar[str] = "INTEGER"
    bigint_type: ClassVar[str] = "INTEGER"

    def q(self, name: str) -> str:
        """Validate and quote an identifier."""
        check_identifier(name)
        return f"{self.quote_char}{name}{self.quote_char}"

    def params(self, n: int) -> str:
        return ", ".join([self.param] * n)

    # -- catalog -------------------------------------------------------------
    def create_catalog_sql(self) -> list[str]:
        raise NotImplementedError

    def insert_ignore_sql(self, table: str, columns: Sequence[str], rows: int = 1) -> str:
        raise NotImplementedError

    def upsert_sql(self, table: str, key: Sequence[str], values: Sequence[str]) -> str:
        raise NotImplementedError

    def create_stamp_sql(self) -> list[str]:
        return [
            "CREATE TABLE IF NOT EXISTS bagstore_shard (one INTEGER NOT NULL PRIMARY KEY, "
            "store VARCHAR(64) NOT NULL, shard_no INTEGER NOT NULL)",
            "CREATE TABLE IF NOT EXISTS bagstore_owned (bucket INTEGER NOT NULL PRIMARY KEY, "
            "state INTEGER NOT NULL)",
            # id -> bucket of entities of kinds placed by a shard key; a row lives
            # on the bucket of its id's hash (bagstore_bucket).
            f"CREATE TABLE IF NOT EXISTS bagstore_ids (kind VARCHAR(64) NOT NULL, "
            f"entity_id {self.id_type} NOT NULL, bagstore_bucket INTEGER NOT NULL, "
            "entity_bucket INTEGER NOT NULL, PRIMARY KEY (kind, entity_id))",
            *self.create_secondary_sql("bagstore_ids", "bagstore_ids_bucket", ["bagstore_bucket"]),
        ]

    def create_secondary_sql(self, table: str, name: str, columns: Sequence[str]) -> list[str]:
        """A secondary index created with its table (SQLite) or after it."""
        raise NotImplementedError

    def locked_read_sql(self, kind: str, buckets: int, ids: int, bodies: bool = True) -> str:
        """For a write transaction, one statement: the ownership rows of
        ``buckets`` buckets, share-locked until the transaction ends, as
        ``(bucket, state, NULL, NULL, NULL, NULL)``; then the rows of ``ids``
        ids, locked for update, as ``(NULL, NULL, id, body, version, updated)``
        (the body NULL unless ``bodies``)."""
        parts = []
        if buckets:
            parts.append(
                "SELECT bucket, state, NULL, NULL, NULL, NULL FROM bagstore_owned "
                f"WHERE bucket IN ({self.params(buckets)})" + self.share_lock
            )
        if ids:
            parts.append(
                f"SELECT NULL, NULL, id, {'body' if bodies else 'NULL'}, version, updated "
                f"FROM {self.q(kind)} "
                f"WHERE id IN ({self.params(ids)})" + self.for_update
            )
        return self.union_all_sql(parts)

    def fenced_insert_sql(
        self, table: str, columns: Sequence[str], rows: int, *, ignore: bool
    ) -> str:
        """Insert rows whose ``bagstore_bucket`` this shard owns (others are
        dropped); with ``ignore``, rows already present are left alone.  The
        parameters are each row's values, followed by its bucket once more when
        ``fenced_by_key(rows)``."""
        raise NotImplementedError

    @staticmethod
    def fenced_by_key(rows: int) -> bool:
        """Whether a fenced insert of ``rows`` rows reads each row's ownership row
        by key (its parameters then repeat each row's bucket)."""
        return rows <= FENCED_ROWS_READ_BY_KEY

    def _fenced_select(self, columns: Sequence[str], rows: int) -> str:
        """The rows whose bucket this shard owns, from parameters.  A few rows:
        ``SELECT <values> FROM bagstore_owned WHERE bucket = ? AND state = 0``
        per row, each row's bucket passed once more (the ownership row read by
        key, no derived table to build); more: one derived table of all rows
        joined with ``bagstore_owned`` on the bucket column (MariaDB runs a large
        UNION of reads by key at half the rate of the join)."""
        if self.fenced_by_key(rows):
            one = (
                f"SELECT {self.params(len(columns))} FROM bagstore_owned "
                f"WHERE bucket = {self.param} AND state = 0"
            )
            return " UNION ALL ".join([one] * rows)
        aliases = [f"k{i}" for i in range(len(columns))]
        first = "SELECT " + ", ".join(f"{self.param} AS {a}" for a in aliases)
        more = " UNION ALL SELECT " + self.params(len(columns))
        bucket = aliases[columns.index(BUCKET)]
        return (
            f"SELECT {', '.join('v.' + a for a in aliases)} FROM ({first}{more * (rows - 1)}) v "
            f"JOIN bagstore_owned o ON o.bucket = v.{bucket} AND o.state = 0"
        )

    def copy_entities_sql(self, kind: str, rows: int) -> str:
        """Upsert rows ``(id, bucket, updated, version, body)`` keeping their version."""
        raise NotImplementedError

    # -- entities ------------------------------------------------------------
    def create_entities_sql(self, kind: str) -> list[str]:
        raise NotImplementedError

    def upsert_entities_sql(self, kind: str, rows: int) -> str:
        """Upsert rows ``(id, bucket, updated, body)``, counting ``version`` up
        by one (a hand-written writer's statement: the benchmarks' raw side)."""
        raise NotImplementedError

    def write_entities_sql(self, kind: str, rows: int) -> str:
        """Upsert rows ``(id, bucket, updated, version, body)``; a row that
        exists gets the larger of its version + 1 and the one given (bagstore's
        writes: see :mod:`bagstore.versions`)."""
        raise NotImplementedError

    def put_one_sql(self, kind: str) -> str | None:
        """One statement that upserts one entity ``(id, bucket, updated, body)``
        if this shard owns its bucket (parameters: those, then the bucket) and
        returns its new version, the clock read under the row's lock (see
        :mod:`bagstore.versions`); None where no statement can (then a
        transaction does it)."""
        return None

    def conditional_update_sql(self, kind: str, moves: bool) -> str:
        """Replace one row's ``updated, version, body`` (and ``bucket`` first
        if ``moves``) only if its id has the version given and this shard owns
        the bucket (share-locked, as a fenced insert's): parameters ``[bucket,]
        updated, version, body, id, expected version, bucket``.  (An indexed
        column left out of the SET costs nothing.)"""
        p = self.param
        return (
            f"UPDATE {self.q(kind)} SET {f'bucket = {p}, ' if moves else ''}updated = {p}, "
            f"version = {p}, body = {p} WHERE id = {p} AND version = {p} AND EXISTS "
            f"(SELECT 1 FROM bagstore_owned WHERE bucket = {p} AND state = 0{self.share_lock})"
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
    ) -> str:
        """``SELECT id, body, version, updated`` of ``n`` ids (``id, body``
        without ``stamps``: a reader that needs only the bodies saves the
        driver two columns of every row)."""
        table = self.q(kind) if schema is None else f"{self.q(schema)}.{self.q(kind)}"
        sql = (
            f"SELECT id, body{', version, updated' if stamps else ''} FROM {table} WHERE id"
            f"{' = ' + self.param if n == 1 else ' IN (' + self.params(n) + ')'}"
        )
        return sql + self.for_update if lock else sql

    def union_all_sql(self, parts: Sequence[str]) -> str:
        """One statement returning the rows of every part (parts with their own
        ORDER BY, LIMIT or lock clause only where the dialect allows them)."""
        return " UNION ALL ".join(parts)

    #: Whether each index scan in a :meth:`union_all_sql` followed by the ORDER
    #: BY and LIMIT of the whole needs its own ORDER BY and LIMIT (else the
    #: server may read every row each part matches).  Without them (SQLite),
    #: the compound's ORDER BY merges parts that each read an index in that
    #: order, a row at a time, and stops at its LIMIT.
    limit_union_parts = False

    def delete_entities_sql(self, kind: str, n: int) -> str:
        cond = f" = {self.param}" if n == 1 else f" IN ({self.params(n)})"
        return f"DELETE FROM {self.q(kind)} WHERE id{cond}"

    def create_index_table_sql(self, table: str, columns: Sequence[str], unique: bool) -> list[str]:
        raise NotImplementedError

    def _index_table_parts(self, columns: Sequence[str], unique: bool) -> tuple[str, str]:
        """Column definitions and primary key of an index table."""
        defs = [f"{self.q(c)} {self.key_type} NOT NULL" for c in columns]
        defs.append(f"{ENTITY_ID} {self.id_type} NOT NULL")
        defs.append(f"{BUCKET} {self.int_type} NOT NULL")
        if unique:
            defs.append(f"{CLAIMED} {self.bigint_type} NOT NULL")
        key = [self.q(c) for c in columns] + ([] if unique else [ENTITY_ID])
        return ", ".join(defs), f"PRIMARY KEY ({', '.join(key)})"

    def count_sql(self, table: str) -> str:
        return f"SELECT COUNT(*) FROM {self.q(table)}"

    def columns_sql(self) -> str:
        """The column names of the table named by the one parameter (no rows if
        there is no such table)."""
        raise NotImplementedError


class Backend(BucketOps, IndexOps):
    """One shard: a database reached through a pool of DB-API connections.

    Subclasses provide ``_acquire``/``_release``/``_discard`` (connection
    handling), ``classify`` (driver error -> bagstore error class) and
    ``driver_errors`` (the driver's exception base classes).
    """

    dialect: Dialect
    driver_errors: tuple[type[BaseException], ...] = ()
    #: Largest encoded body a row may hold on this backend.
    max_body_bytes: int = 16 * 1024 * 1024 - 1
    #: Largest statement (bytes of bound values) one multi-row INSERT may carry.
    max_statement_bytes: int = 8 * 1024 * 1024
    #: Most rows one multi-row statement may carry (bound-variable limits).
    max_statement_rows: int = 1000
    #: Index rows per fenced multi-row insert (SQLite caps a compound SELECT at 500).
    index_rows_per_statement: int = 200
    #: Index rows per statement of a flat-out backfill's inserts (a ``VALUES``
    #: list; see ``IndexOps.bulk_insert_index_rows``), within ``max_statement_bytes``.
    bulk_rows_per_statement: int = 1000

    def __init__(self, name: str, server: str | None = None) -> None:
        self.name = name
        #: The database server this shard lives on (``host:port``), or None for
        #: an embedded database: statements to shards on different servers are
        #: worth sending from parallel threads, the others are not.
        self.server = server
        #: Shards with the same (not None) ``together`` key are databases that one
        #: connection of any of them can read (same server, same login): their
        #: reads can share one statement (see :func:`read_bodies_together`).
        self.together: tuple[Any, ...] | None = None
        #: This shard's database name, qualifying its tables in such a statement.
        self.schema: str | None = None
        #: At most this many shards' tables in one such statement (None: no limit).
        self.max_together: int | None = None
        #: Whether reads of several such shards are worth one ``UNION ALL``
        #: (they save round trips to a server; an embedded database has none to
        #: save, and only a scan joined with the entity tables gains there).
        self.union_reads = True
        self._schema_lock = threading.Lock()
        self._ready_kinds: set[str] = set()
        #: Index scans sent to this shard (tests count them to see routing).
        self.scans = 0
        self._sql_memo: dict[tuple[Any, ...], str] = {}

    def sql(self, builder: str, *args: Any, **kwargs: Any) -> str:
        """``self.dialect.<builder>(*args, **kwargs)``, built once per process:
        the hot statements' text is the same for every call with the same shape."""
        key = (builder, *args, *kwargs.items()) if kwargs else (builder, *args)
        text = self._sql_memo.get(key)
        if text is None:
            text = self._sql_memo[key] = getattr(self.dialect, builder)(*args, **kwargs)
        return text

    # -- connections ---------------------------------------------------------
    def _acquire(self) -> Any:
        raise NotImplementedError

    def _release(self, conn: Any) -> None:
        raise NotImplementedError

    def _discard(self, conn: Any) -> None:
        raise NotImplementedError

    def classify(self, exc: BaseException) -> type[BackendError]:
        """The bagstore error class for a driver exception."""
        return BackendError

    def translated(self, exc: BaseException) -> BackendError:
        """A driver exception as the bagstore error to raise (``__cause__`` set)."""
        error = self.classify(exc)(f"shard {self.name}: {exc}", shard=self.name)
        error.__cause__ = exc
        if isinstance(error, ShardUnavailable):
            log.info("shard %s unavailable: %s", self.name, exc)
        return error

    def is_retryable(self, exc: BaseException) -> bool:
        """True if a statement failing with ``exc`` may simply be run again
        on a fresh connection (lost connection, deadlock victim)."""
        return False

    def close(self) -> None:
        raise NotImplementedError

    @contextmanager
    def connection(self) -> Iterator[Any]:
        """A connection for one unit of work; a broken one is discarded."""
        with translate_errors(self):
            conn = self._acquire()
        try:
            yield conn
        except BaseException as exc:
            error = self._settle(conn, exc)
            if error is exc:
                raise
            raise error from exc
        else:
            self._release(conn)

    def _rollback_quietly(self, conn: Any) -> None:
        try:
            conn.rollback()
        except self.driver_errors:
            self._discard(conn)
            raise

    def run(self, work: Callable[..., T], *args: Any, attempts: int = 3) -> T:
        """Run ``work(connection, *args)``; retry on a fresh connection when the failure
        was a dropped connection or a deadlock (``work`` must be idempotent,
        which every bagstore unit of work is: a transaction that did not
        commit, or a read).

        The same contract as :meth:`connection`, written out without context
        managers: this is every statement's path, and a point read on SQLite
        costs only a few microseconds in all.
        """
        for attempt in range(1, attempts + 1):
            try:
                conn = self._acquire()
            except BagstoreError:
                raise
            except self.driver_errors as exc:
                raise self.translated(exc) from exc
            try:
                result = work(conn, *args)
            except BaseException as exc:
                error = self._settle(conn, exc)
                cause = error.__cause__
                if (
                    attempt < attempts
                    and isinstance(error, BackendError)
                    and cause is not None
                    and self.is_retryable(cause)
                ):
                    log.info("%s; trying again on a new connection", error)
                    continue
                if error is exc:
                    raise
                raise error from exc
            self._release(conn)
            return result
        raise AssertionError("unreachable")

    def _settle(self, conn: Any, exc: BaseException) -> BaseException:
        """After ``exc`` ended a unit of work on ``conn``: discard the connection
        if it is broken, else roll back and give it back; return the error to
        raise (a driver error translated, anything else as it is)."""
        error: BaseException = exc
        if isinstance(exc, self.driver_errors) and not isinstance(exc, BagstoreError):
            error = self.translated(exc)
        cause = error.__cause__ if isinstance(error, BackendError) else error
        if isinstance(error, ShardUnavailable) or (cause is not None and self.is_retryable(cause)):
            self._discard(conn)
            return error
        try:
            self._rollback_quietly(conn)
        except self.driver_errors as rollback_exc:  # the connection is gone too
            return self.translated(rollback_exc)
        self._release(conn)
        return error

    def _begin(self, cur: Any) -> None:
        cur.execute(self.dialect.begin_write)

    @contextmanager
    def transaction(self, conn: Any) -> Iterator[Any]:
        """A write transaction on ``conn``; yields a cursor; commits at the end."""
        cur = conn.cursor()
        try:
            self._begin(cur)
            yield cur
            conn.commit()
        except BaseException:
            self._rollback_quietly(conn)
            raise
        finally:
            cur.close()

    def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        """Run one statement in autocommit mode; return its row count."""

        def work(conn: Any) -> int:
            cur = conn.cursor()
            try:
                cur.execute(sql, params)
                return int(cur.rowcount)
            finally:
                cur.close()

        return self.run(work)

    def fetchall(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        def work(conn: Any) -> list[tuple[Any, ...]]:
            cur = conn.cursor()
            try:
                cur.execute(sql, params)
                return list(cur.fetchall())
            finally:
                cur.close()

        return self.run(work)

    def read_together(
        self, sql: str, params: Sequence[Any], reach: Sequence[Backend]
    ) -> list[tuple[Any, ...]]:
        """Run a read whose tables are qualified by the ``schema`` of the shards
        ``reach`` (this one among them; all of one ``together`` key).  Here, on
        this shard's own connection, which reaches the others already."""
        return self.fetchall(sql, params)

    def _executescript(self, statements: Sequence[str]) -> None:
        def work(conn: Any) -> None:
            cur = conn.cursor()
            try:
                for sql in statements:
                    cur.execute(sql)
            finally:
                cur.close()

        self.run(work)

    # -- catalog -------------------------------------------------------------
    def create_catalog(self) -> None:
        self._executescript(self.dialect.create_catalog_sql())

    def insert_ignore(
        self, table: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]
    ) -> None:
        """Insert rows, leaving alone any whose key exists (one statement per chunk)."""
        for start in range(0, len(rows), 500):
            chunk = rows[start : start + 500]
            sql = self.dialect.insert_ignore_sql(table, columns, len(chunk))
            self.execute(sql, [v for row in chunk for v in row])

    def select_all(
        self, table: str, columns: Sequence[str], where: dict[str, Any] | None = None
    ) -> list[tuple[Any, ...]]:
        d = self.dialect
        cols = ", ".join(d.q(c) for c in columns)
        cond = " AND ".join(f"{d.q(k)} = {d.param}" for k in where or {})
        sql = f"SELECT {cols} FROM {d.q(table)}" + (f" WHERE {cond}" if cond else "")
        return self.fetchall(sql, list((where or {}).values()))

    def int_column(self, table: str, key: str, value: str) -> list[int] | None:
        """``value`` of every row in ``key`` order, if the integer ``key``s are
        exactly 0, 1, 2, ...; None if they are not (a row missing)."""
        rows = sorted(self.select_all(table, (key, value)))
        if any(int(r[0]) != i for i, r in enumerate(rows)):
            return None
        return [int(r[1]) for r in rows]

    def upsert(self, table: str, key: dict[str, Any], values: dict[str, Any]) -> None:
        """Insert the row, or update ``values`` where ``key`` exists: one statement."""
        sql = self.dialect.upsert_sql(table, list(key), list(values))
        self.execute(sql, [*key.values(), *values.values()])

    def update(self, table: str, values: dict[str, Any], where: dict[str, Any]) -> int:
        """``UPDATE table SET values WHERE where``; the number of rows changed."""
        d = self.dialect
        sets = ", ".join(f"{d.q(k)} = {d.param}" for k in values)
        cond = " AND ".join(f"{d.q(k)} = {d.param}" for k in where)
        return self.execute(
            f"UPDATE {d.q(table)} SET {sets} WHERE {cond}", [*values.values(), *where.values()]
        )

    def delete_where(self, table: str, where: dict[str, Any]) -> int:
        d = self.dialect
        cond = " AND ".join(f"{d.q(k)} = {d.param}" for k in where)
        return self.execute(f"DELETE FROM {d.q(table)} WHERE {cond}", list(where.values()))

    def has_rows(self, table: str) -> bool:
        """Whether a table holds any row (cheap even on huge tables)."""
        return bool(self.fetchall(f"SELECT 1 FROM {self.dialect.q(table)} LIMIT 1"))

    def stamp(self, store_id: str, shard_no: int) -> tuple[str, int]:
        """Mark this database as shard ``shard_no`` of store ``store_id`` unless it
        is marked already; return the mark it holds."""
        self._executescript(self.dialect.create_stamp_sql())
        ensure_change_tables(self)  # (change feed) every shard has its tables
        self.insert_ignore(
            "bagstore_shard", ("one", "store", "shard_no"), [(1, store_id, shard_no)]
        )
        store, no = self.select_all("bagstore_shard", ("store", "shard_no"))[0]
        return str(store), int(no)

    # -- entities ------------------------------------------------------------
    def table_columns(self, table: str) -> frozenset[str]:
        """The column names of ``table`` on this shard (empty if it does not exist)."""
        check_identifier(table, "table name")
        rows = self.fetchall(self.dialect.columns_sql(), [table])
        return frozenset(
            (r[0].decode() if isinstance(r[0], bytes) else str(r[0])).lower() for r in rows
        )

    def ensure_kind(self, kind: str) -> None:
        """Create the entities table of ``kind`` when missing (once per process).

        Raises ``ConfigurationError`` if a table of that name exists that is not
        an entities table (an index's, bagstore's own or another program's): the
        kind would write into it."""
        if kind in self._ready_kinds:
            return
        with self._schema_lock:
            if kind not in self._ready_kinds:
                self._check_entities_table(kind)
                self._executescript(self.dialect.create_entities_sql(kind))
                self._check_entities_table(kind)
                self._widen_version(kind)
                self._ready_kinds.add(kind)

    def _widen_version(self, kind: str) -> None:
        """Give a table made by an older bagstore a ``version`` column wide
        enough for :mod:`bagstore.versions` (MySQL's INT to BIGINT); nothing to
        do where every integer column is wide (SQLite)."""

    def _check_entities_table(self, kind: str) -> None:
        columns = self.table_columns(kind)
        if columns and not columns >= ENTITY_COLUMNS:
            raise ConfigurationError(
                f"kind {kind!r}: shard {self.name} holds a table {kind!r} that is not an "
                f"entities table (columns {sorted(columns)}): a kind cannot share its name with "
                "an index table or any other table (see 'Names' in docs/cleaner.md)"
            )

    def get_body(self, kind: str, entity_id: bytes) -> bytes | None:
        """One entity's encoded body on this shard, or None: one statement."""
        sql = self.sql("select_bodies_sql", kind, 1, False, None, False)
        row = self.run(_fetchone, sql, (entity_id,))
        return None if row is None else bytes(row[1])

    def get_bodies(self, kind: str, ids: Sequence[bytes]) -> dict[bytes, Stored]:
        """``{id: Stored(body, version, updated)}`` of the ids present on this shard."""
        return {r[0]: Stored(r[1], r[2], r[3]) for r in self.read_bodies(kind, ids, stamps=True)}

    def read_bodies(
        self, kind: str, ids: Sequence[bytes], *, stamps: bool
    ) -> list[tuple[Any, ...]]:
        """Rows ``(id, body, version, updated)`` (``(id, body)`` without
        ``stamps``) of the ids present on this shard, as the driver returns them:
        bytes and ints."""
        if not ids:
            return []
        sql = self.sql("select_bodies_sql", kind, len(ids), False, None, stamps)
        return self.fetchall(sql, ids)

    def _chunks(self, rows: Sequence[EntityRow]) -> Iterator[Sequence[EntityRow]]:
        """Split rows so that one statement stays under ``max_statement_bytes``."""
        start, size = 0, 0
        for i, row in enumerate(rows):
            size += len(row.body) + 64
            if i > start and (
                size > self.max_statement_bytes or i - start >= self.max_statement_rows
            ):
                yield rows[start:i]
                start, size = i, len(row.body) + 64
        if start < len(rows):
            yield rows[start:]

    def put_entities(
        self,
        kind: str,
        rows: Sequence[EntityRow],
        *,
        read_old: bool,
        versions: dict[bytes, int] | None = None,
        stamps: dict[bytes, int] | None = None,
        expect: Mapping[bytes, int] | None = None,
        carried: Mapping[bytes, int] | None = None,
        refused: dict[bytes, int] | None = None,
        within: Within | None = None,
    ) -> dict[bytes, bytes]:
        """Upsert rows in one transaction; with ``read_old`` return the bodies
        they replaced (read in the same transaction, rows locked).
        ``versions`` (if given) is filled with each row's new version
        (:func:`bagstore.versions.next_version` of the one read under the
        row's lock), and ``stamps`` (if given) with the ``updated`` of each
        row replaced.

        Conditional writes: ``expect`` maps ids to the version each must have
        (0: no row); ``carried`` the version of an entity's copy in another
        bucket (a put that moves it there), taken as found when this shard has
        no row of the id.  If any row's condition fails, nothing is written:
        ``refused`` (required with ``expect``) gets ``{id: version found}`` of
        the rows that failed and ``{}`` is returned.  ``within(cursor, old)``,
        if given, runs in the transaction after the upsert (``old``: ``{id:
        replaced body or None}``, the bodies only with ``read_old``)."""

        one = rows[0] if len(rows) == 1 else None
        alone = one is not None and not (read_old or expect or carried or within)
        if alone and self._put_one(kind, rows[0], versions):
            return {}
        if (
            one is not None
            and expect
            and expect.get(one.id, 0) > 0
            and not (read_old or carried or within)
            and self.update_if(kind, one, expect[one.id], versions)
        ):
            return {}  # one statement did it (else: the transaction finds out why not)

        def work(conn: Any) -> dict[bytes, bytes]:
            old: dict[bytes, bytes] = {}
            found: dict[bytes, int] = {}
            with self.transaction(conn) as cur:
                ids = [r.id for r in rows]
                for r in self._locked_read(cur, kind, [r.bucket for r in rows], ids, read_old):
                    found[r[0]] = r[2]
                    if read_old:
                        old[r[0]] = r[1]
                    if stamps is not None:
                        stamps[r[0]] = r[3]
                if carried:
                    found = {**{i: v for i, v in carried.items() if i in ids}, **found}
                if expect:
                    failed = {i: found.get(i, 0) for i, v in expect.items() if found.get(i, 0) != v}
                    if failed:
                        assert refused is not None, "expect needs refused"
                        refused.update(failed)
                        return {}
                # The clock is read with the rows locked (bagstore.versions).
                new = {r.id: next_version(found.get(r.id)) for r in rows}
                for chunk in self._chunks(rows):
                    cur.execute(
                        self.sql("write_entities_sql", kind, len(chunk)), _flatten(chunk, new)
                    )
                if within is not None:
                    within(cur, {i: old.get(i) for i in ids})
            if versions is not None:
                versions.update(new)
            return old

        return self.run(work)

    def _put_one(self, kind: str, row: EntityRow, versions: dict[bytes, int] | None) -> bool:
        """One entity in one statement, where the dialect has one; False if it
        has none (or the bucket came back to this shard meanwhile)."""
        sql = self.sql("put_one_sql", kind)
        if sql is None:
            return False

        def work(conn: Any) -> Any:
            cur = conn.cursor()
            try:
                cur.execute(sql, [row.id, row.bucket, row.updated, row.body, row.bucket])
                return cur.fetchone()
            finally:
                cur.close()

        found = self.run(work)
        if found is None:  # the bucket is not owned here (or is frozen)
            self.check_owned([row.bucket])
            return False
        if versions is not None:
            versions[row.id] = int(found[0])
        return True

    def update_if(
        self,
        kind: str,
        row: EntityRow,
        expected: int,
        versions: dict[bytes, int] | None,
        *,
        moves: bool = True,
    ) -> bool:
        """A conditional write of one existing row that needs nothing else in
        its transaction: one ``UPDATE ... WHERE version = expected`` (its new
        version above the one it replaces, whatever the clock says).  False if
        it changed nothing (another version, no row, or a bucket not owned).
        ``moves=False``: the row's bucket is the one it has (placed by its id)."""
        new = max(expected + 1, clock())
        params = [row.updated, new, row.body, row.id, expected, row.bucket]
        if moves:
            params.insert(0, row.bucket)
        if self.execute(self.sql("conditional_update_sql", kind, moves), params) != 1:
            return False
        if versions is not None:
            versions[row.id] = new
        return True

    def _locked_read(
        self,
        cur: Any,
        kind: str,
        buckets: Sequence[int],
        ids: Sequence[bytes],
        bodies: bool = True,
    ) -> list[tuple[Any, ...]]:
        """Inside a write transaction: lock the buckets' ownership rows (shared)
        and raise unless this shard owns them all; lock the rows of ``ids`` and
        return them as ``(id, body, version, updated)`` (the body None unless
        ``bodies``).  One statement for up to 1,000 buckets and 1,000 ids."""
        wanted = sorted(set(buckets))
        states: dict[int, int] = {}
        found: list[tuple[Any, ...]] = []
        for start in range(0, max(len(wanted), len(ids)), 1000):
            some = wanted[start : start + 1000]
            part = ids[start : start + 1000]
            sql = self.sql("locked_read_sql", kind, len(some), len(part), bodies)
            cur.execute(sql, [*some, *part])
            # int(): a UNION of NULL and an integer column may come back as
            # DECIMAL (MariaDB does so for INT UNSIGNED).
            for r in cur.fetchall():
                if r[0] is not None:
                    states[int(r[0])] = int(r[1])
                else:
                    found.append((r[2], r[3], int(r[4]), int(r[5])))
        error = ownership_error(self.name, wanted, states)
        if error is not None:
            raise error
        return found

    def delete_entities(
        self,
        kind: str,
        ids: Sequence[bytes],
        buckets: Sequence[int],
        *,
        read_old: bool,
        versions: dict[bytes, int] | None = None,
        stamps: dict[bytes, int] | None = None,
        record: bool = True,
        expect: Mapping[bytes, int] | None = None,
        refused: dict[bytes, int] | None = None,
        within: Within | None = None,
    ) -> dict[bytes, bytes | None]:
        """Delete ids (of ``buckets``, which this shard must own); return ``{id:
        old body}`` of those that existed (the body is ``None`` unless ``read_old``).
        ``versions`` (if given) is filled with the deleted rows' versions, and
        ``stamps`` (if given) with their ``updated``.  ``expect``, ``refused``
        and ``within`` as for :meth:`put_entities` (a failed condition deletes
        nothing on this shard).  Without ``record``, the deletes leave no
        change in the kind's change feed (an entity moved to another bucket:
        its put is the change; see backends/changesql.py)."""

        def work(conn: Any) -> dict[bytes, bytes | None]:
            with self.transaction(conn) as cur:
                found: dict[bytes, bytes | None] = {}
                seen: dict[bytes, tuple[int, int]] = {}
                for r in self._locked_read(cur, kind, buckets, ids, read_old):
                    found[r[0]] = r[1] if read_old else None
                    seen[r[0]] = (r[2], r[3])
                if expect:
                    failed = {
                        i: seen[i][0] if i in seen else 0
                        for i, v in expect.items()
                        if (seen[i][0] if i in seen else 0) != v
                    }
                    if failed:
                        assert refused is not None, "expect needs refused"
                        refused.update(failed)
                        return {}
                present = list(found)
                for start in range(0, len(present), 1000):
                    part = present[start : start + 1000]
                    if not record:  # (change feed) marked unrecorded, see changesql
                        cur.execute(skip_sql(self.dialect, len(part), insert=True),
                                    [v for i in part for v in (kind, i)])  # fmt: skip
                    cur.execute(self.sql("delete_entities_sql", kind, len(part)), part)
                    if not record:
                        cur.execute(skip_sql(self.dialect, len(part), insert=False), [kind, *part])
                if within is not None:
                    within(cur, found)
            if versions is not None:
                versions.update({i: v for i, (v, _) in seen.items()})
            if stamps is not None:
                stamps.update({i: u for i, (_, u) in seen.items()})
            return found

        if not ids:
            return {}
        return self.run(work)

    def read_locked(
        self, kind: str, ids: Sequence[bytes], buckets: Sequence[int]
    ) -> dict[bytes, Stored]:
        """``{id: Stored}`` of the ids present, read in a write transaction with
        their rows locked (of ``buckets``, which this shard must own): a write
        still committing is waited for, never missed."""

        def work(conn: Any) -> dict[bytes, Stored]:
            with self.transaction(conn) as cur:
                rows = self._locked_read(cur, kind, buckets, ids)
            return {r[0]: Stored(bytes(r[1]), r[2], r[3]) for r in rows}

        return self.run(work) if ids else {}

    def scan_entities(
        self, kind: str, after_added_id: int, limit: int
    ) -> list[tuple[int, bytes, bytes, int]]:
        """``(added_id, id, body, updated)`` of the next rows after ``after_added_id``."""
        d = self.dialect
        sql = (
            f"SELECT added_id, id, body, updated FROM {d.q(kind)} WHERE added_id > {d.param} "
            f"ORDER BY added_id LIMIT {int(limit)}"
        )
        return [
            (int(r[0]), bytes(r[1]), bytes(r[2]), int(r[3]))
            for r in self.fetchall(sql, [after_added_id])
        ]

    def scan_recent(
        self, kind: str, before: tuple[int, int] | None, since: int | None, limit: int
    ) -> list[tuple[int, bytes, bytes, int]]:
        """``(added_id, id, body, updated)``, most recently updated first, strictly
        before the ``(updated, added_id)`` position, not older than ``since``."""
        d, p = self.dialect, self.dialect.param
        where, params = [], []
        if before is not None:
            where.append(f"(updated < {p} OR (updated = {p} AND added_id < {p}))")
            params += [before[0], before[0], before[1]]
        if since is not None:
            where.append(f"updated >= {p}")
            params.append(since)
        sql = (
            f"SELECT added_id, id, body, updated FROM {d.q(kind)}"
            + (f" WHERE {' AND '.join(where)}" if where else "")
            + f" ORDER BY updated DESC, added_id DESC LIMIT {int(limit)}"
        )
        return [
            (int(r[0]), bytes(r[1]), bytes(r[2]), int(r[3])) for r in self.fetchall(sql, params)
        ]

    def scan_bodies(
        self, kind: str, after_added_id: int, limit: int, *, packed: bool = False
    ) -> tuple[list[tuple[bytes, bytes]], str]:
        """A backfill's read: ``(id, body)`` of the next rows after
        ``after_added_id`` (in ``added_id`` order), and the same rows' stamps,
        read at the same moment, as :meth:`stamps_text` spells them.
        ``packed``: the server may work more to send less (a backend whose
        driver spends more per column than the server does: a flat-out
        backfill's choice, not a paced one's)."""
        rows = self.scan_entities(kind, after_added_id, limit)
        return [(r[1], r[2]) for r in rows], ",".join([f"{r[0]}:{r[3]}:{r[1].hex()}" for r in rows])

    def stamps_text(self, kind: str, after: int, last: int, *, packed: bool = False) -> str:
        """The rows with ``after < added_id <= last`` as one string,
        ``added_id:updated:id in hex`` joined by commas in ``added_id`` order:
        the same text as :meth:`scan_bodies` gave for them exactly when none of
        them changed, went or came since (``packed``: as for
        :meth:`scan_bodies`, the server may build it)."""
        d = self.dialect
        sql = (
            f"SELECT added_id, updated, id FROM {d.q(kind)} "
            f"WHERE added_id > {d.param} AND added_id <= {d.param} ORDER BY added_id"
        )
        rows = self.fetchall(sql, [after, last])
        return ",".join([f"{int(a)}:{int(u)}:{bytes(i).hex()}" for a, u, i in rows])

    def versions(self, kind: str, ids: Sequence[bytes]) -> dict[bytes, tuple[int, int]]:
        """``{id: (version, updated)}`` of the ids present."""
        if not ids:
            return {}
        d = self.dialect
        sql = f"SELECT id, version, updated FROM {d.q(kind)} WHERE id IN ({d.params(len(ids))})"
        return {bytes(r[0]): (int(r[1]), int(r[2])) for r in self.fetchall(sql, list(ids))}

    def max_added_id(self, kind: str) -> int:
        rows = self.fetchall(f"SELECT MAX(added_id) FROM {self.dialect.q(kind)}")
        return int(rows[0][0] or 0)

    def count(self, table: str) -> int:
        return int(self.fetchall(self.dialect.count_sql(table))[0][0])

    def after_bulk_step(self) -> None:
        """Called by bulk work (a backfill batch, a step of a bucket move) after
        each step, from its own thread: take on upkeep that the step's writes
        would otherwise leave to the next live write.  Nothing by default."""

    def server_advice(self) -> list[str]:
        """Settings of this shard's server that let bulk work (a bucket move, a
        backfill) stall live writes, as sentences for people.  None by default."""
        return []


#: Fenced inserts of up to this many rows read each row's ownership row by key;
#: larger ones join a derived table (see ``Dialect._fenced_select``).
FENCED_ROWS_READ_BY_KEY = 16

#: At most this many ids go into one statement over several shards.
TOGETHER_MAX_IDS = 2000


def read_bodies_together(
    kind: str, parts: Sequence[tuple[Backend, Sequence[bytes]]], *, stamps: bool
) -> list[tuple[Any, ...]]:
    """:meth:`Backend.read_bodies` of ids on several shards with one ``together``
    key, in one statement on the first shard's connection (one round trip
    instead of one per shard); each part reads only its own database."""
    lead = parts[0][0]
    selects: list[str] = []
    params: list[Any] = []
    for backend, ids in parts:
        selects.append(lead.sql("select_bodies_sql", kind, len(ids), False, backend.schema, stamps))
        params.extend(ids)
    sql = lead.dialect.union_all_sql(selects)
    return lead.read_together(sql, params, [backend for backend, _ in parts])


def _fetchone(conn: Any, sql: str, params: Sequence[Any]) -> Any:
    cur = conn.cursor()
    try:
        cur.execute(sql, params)
        return cur.fetchone()
    finally:
        cur.close()


def _flatten(rows: Sequence[EntityRow], versions: Mapping[bytes, int]) -> list[Any]:
    out: list[Any] = []
    for r in rows:
        out += (r.id, r.bucket, r.updated, versions[r.id], r.body)
    return out


@contextmanager
def translate_errors(backend: Backend) -> Iterator[None]:
    """Turn a driver exception into the bagstore error tree (``raise ... from``)."""
    try:
        yield
    except BagstoreError:
        raise
    except backend.driver_errors as exc:
        raise backend.translated(exc) from exc
