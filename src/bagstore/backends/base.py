"""The storage backend: one shard's database, its connections, and all its SQL.

A :class:`Backend` owns the connections to one shard and runs every statement
bagstore sends there.  The SQL text is built by its :class:`Dialect` (data plus
small builder methods); ``sqlite.py`` and ``mysql.py`` subclass both.  Both
have parts mixed in from their own modules: the entities tables' statements
(``entities.py``), the index tables' (``indexsql.py``), index scans
(``scansql.py``) and bucket ownership (``buckets.py``).  Nothing outside
``backends/`` writes SQL or asks which database it talks to.

Identifiers are checked against ``^[A-Za-z_][A-Za-z0-9_]{0,63}$`` and quoted;
values are always bound parameters.  Driver exceptions are translated into the
bagstore error tree in exactly one place, :func:`translate_errors`.
"""

from __future__ import annotations

import itertools
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar, TypeVar

from bagstore.backends.buckets import BucketOps
from bagstore.backends.changesql import ensure_change_tables
from bagstore.backends.chunks import by_size, row_bytes
from bagstore.backends.entities import (
    ENTITY_COLUMNS,
    EntityOps,
    EntityRow,
    EntitySQL,
    Stored,
    Within,
)
from bagstore.backends.gate import GatedReads, ensure_gate
from bagstore.backends.indexsql import BUCKET, CLAIMED, ENTITY_ID, IndexOps
from bagstore.backends.pipeline import Pipeline, later, transact
from bagstore.backends.scansql import ScanOps
from bagstore.errors import (
    BackendError,
    BagstoreError,
    ConfigurationError,
    ShardTimeout,
    ShardUnavailable,
)

__all__ = [
    "ENTITY_COLUMNS",
    "IDENTIFIER",
    "Backend",
    "Dialect",
    "EntityRow",
    "Stored",
    "Within",
    "check_identifier",
    "translate_errors",
]

IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")

T = TypeVar("T")

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


class Dialect(EntitySQL):
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


class Backend(GatedReads, EntityOps, BucketOps, IndexOps, ScanOps):
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
        #: reads can share one statement (see :func:`bagstore.reads.read_bodies_together`).
        self.together: tuple[Any, ...] | None = None
        #: This shard's database name, qualifying its tables in such a statement.
        self.schema: str | None = None
        #: At most this many shards' tables in one such statement (None: no limit).
        self.max_together: int | None = None
        #: Whether reads of several such shards are worth one ``UNION ALL``
        #: (they save round trips to a server; an embedded database has none to
        #: save, and only a scan joined with the entity tables gains there).
        self.union_reads = True
        #: Whether the driver parses each column of a row in Python (PyMySQL:
        #: ~0.4 us a column): reads of many rows are worth fewer columns.
        self.parses_in_python = False
        self._schema_lock = threading.Lock()
        self._ready_kinds: set[str] = set()
        #: Index scans sent to this shard (tests count them to see routing).
        self.scans = 0
        self._sql_memo: dict[tuple[Any, ...], str] = {}
        #: ``select_bodies_sql(kind, 1, stamps=False)`` by kind: a point read's
        #: statement, found with one lookup (see ``get_body``)
        self._point_sql: dict[str, str] = {}
        #: ``versioned_read_sql(kind)`` by kind (see ``get_versioned``)
        self._versioned_sql: dict[str, str] = {}

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
        (lost connection, deadlock victim)."""
        return False

    #: How many times a deadlock victim is run in all, whatever ``attempts``
    #: a caller gives :meth:`run` (a busy table's writers meet often; each
    #: try after a longer random pause, see :meth:`retry_pause`).
    deadlock_tries = 12

    def _tries(self, exc: BaseException, attempts: int) -> int:
        return max(attempts, self.deadlock_tries) if self.connection_survives(exc) else attempts

    def outcome_unknown(self, exc: BaseException) -> bool:
        """True if a statement failing with the retryable ``exc`` may have
        been applied all the same: its connection was lost, and with it the
        answer to a commit the server may have made."""
        return False

    def connection_survives(self, exc: BaseException) -> bool:
        """True if a connection on which a retryable ``exc`` happened is
        still sound once rolled back (a deadlock victim's), so that it goes
        back to the pool instead of being replaced by a new one."""
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

    def retry_pause(self, exc: BaseException, attempt: int) -> float:
        """Seconds to wait before trying again after ``attempt`` failed with
        the retryable ``exc`` (0: at once)."""
        return 0.0

    def run(self, work: Callable[..., T], *args: Any, attempts: int = 5, replay: bool = True) -> T:
        """Run ``work(connection, *args)``; retry (on a fresh connection unless
        the old one survived, see :meth:`connection_survives`) when the failure
        was a dropped connection or a deadlock (``work`` must be idempotent,
        which every bagstore unit of work is: a transaction that did not
        commit, or a read).

        ``replay=False``: ``work`` is a conditional write, which is not run
        again after a lost connection (:meth:`outcome_unknown`): if its commit
        was made, running it again would find its own new version and call
        that a conflict.  It raises :class:`ShardTimeout` instead, the error
        whose outcome is unknown; a deadlock victim is still run again.

        The same contract as :meth:`connection`, written out without context
        managers: this is every statement's path, and a point read on SQLite
        costs only a few microseconds in all.
        """
        for attempt in itertools.count(1):
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
                if not replay and cause is not None and self.outcome_unknown(cause):
                    raise ShardTimeout(
                        f"shard {self.name}: the connection was lost during a conditional "
                        "write, which may or may not have been applied: read the entity "
                        f"back before writing it again ({cause})",
                        shard=self.name,
                    ) from exc
                if (
                    isinstance(error, BackendError)
                    and cause is not None
                    and self.is_retryable(cause)
                    and attempt < self._tries(cause, attempts)
                ):
                    pause = self.retry_pause(cause, attempt)
                    log.info("%s; trying again in %.3f s", error, pause)
                    if pause:
                        time.sleep(pause)
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
        if isinstance(error, ShardUnavailable) or (
            cause is not None and self.is_retryable(cause) and not self.connection_survives(cause)
        ):
            self._discard(conn)
            return error
        try:
            self._rollback_quietly(conn)
        except self.driver_errors as rollback_exc:  # the connection is gone too
            return self.translated(rollback_exc)
        self._release(conn)
        return error

    def _begin(self, cur: Any) -> None:
        later(cur, self.dialect.begin_write)

    def _write_cursor(self, conn: Any) -> Any:
        """The cursor of a write transaction on ``conn`` (a :class:`Pipeline`
        where the connection can send several statements at once)."""
        return conn.cursor()

    @contextmanager
    def transaction(self, conn: Any) -> Iterator[Any]:
        """A write transaction on ``conn``; yields a cursor; commits at the end.
        Statements run on it with :func:`bagstore.backends.pipeline.later`
        may be sent only with the next one whose result is read, or the
        commit (statements held back are dropped by a rollback)."""
        cur = self._write_cursor(conn)
        try:
            self._begin(cur)
            yield cur
            if isinstance(cur, Pipeline):
                cur.commit()
            else:
                conn.commit()
        except BaseException:
            self._rollback_quietly(conn)
            raise
        finally:
            cur.close()

    def write(self, work: Callable[..., T], *args: Any, replay: bool = True) -> T:
        """``work(cursor, *args)`` in one write transaction on this shard (see
        :meth:`transaction`), run again as :meth:`run` runs its work (``replay``
        as for :meth:`run`); its result.  (A backend may run it on a connection
        and cursor it keeps: ``work`` uses the cursor only while it runs.)"""
        result: T = self.run(self._transact, work, *args, replay=replay)
        return result

    def _transact(self, conn: Any, work: Callable[..., T], *args: Any) -> T:
        return transact(self, conn, work, args)  # (:meth:`transaction`, written out)

    def execute(self, sql: str, params: Sequence[Any] = (), *, replay: bool = True) -> int:
        """Run one statement in autocommit mode; return its row count
        (``replay`` as for :meth:`run`)."""

        def work(conn: Any) -> int:
            cur = conn.cursor()
            try:
                cur.execute(sql, params)
                return int(cur.rowcount)
            finally:
                cur.close()

        return self.run(work, replay=replay)

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
        """Insert rows, leaving alone any whose key exists (chunked statements)."""
        for chunk in by_size(rows, list(map(row_bytes, rows)), self.max_statement_bytes, 500):
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
        self.gated = ensure_gate(self)
        self.insert_ignore(
            "bagstore_shard", ("one", "store", "shard_no"), [(1, store_id, shard_no)]
        )
        store, no = self.select_all("bagstore_shard", ("store", "shard_no"))[0]
        return str(store), int(no)

    def table_columns(self, table: str) -> frozenset[str]:
        """The column names of ``table`` on this shard (empty if it does not exist)."""
        check_identifier(table, "table name")
        rows = self.fetchall(self.dialect.columns_sql(), [table])
        return frozenset(
            (r[0].decode() if isinstance(r[0], bytes) else str(r[0])).lower() for r in rows
        )

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


@contextmanager
def translate_errors(backend: Backend) -> Iterator[None]:
    """Turn a driver exception into the bagstore error tree (``raise ... from``)."""
    try:
        yield
    except BagstoreError:
        raise
    except backend.driver_errors as exc:
        raise backend.translated(exc) from exc
