"""SQLite: every shard a file, in WAL mode, shared safely by threads and processes.

Each thread keeps its own connection to each shard file (SQLite connections are
cheap and this costs nothing per operation), handed back when the thread ends
for the next new thread to take (:mod:`bagstore.backends.spares`): not left
open until the store closes, nor opened again by every short-lived thread
(~0.4 ms of its first statement).  A write transaction starts with
``BEGIN IMMEDIATE`` so that concurrent writers queue for the write lock instead
of failing to upgrade a read lock.  A writer that finds the file locked waits
in SQLite's own busy handler (``PRAGMA busy_timeout``), which sleeps 1, 2, 5,
10 ms... between tries with the GIL released: threads that have other work
run meanwhile, and the one that holds the lock finishes sooner.  Measured
against the two ways bagstore waited before, a lock of its own per file
(the GIL released) in front of ``BEGIN IMMEDIATE`` and polling ``SQLITE_BUSY``
every 50 µs to 0.5 ms: 8 writers of one process 0.53x -> 0.77x raw SQL's 8
threads, 4 contending ``update(fn)`` 9,000 -> 13,500 updates/s.  The lock
holder needed the GIL back after each statement to go on and, in the end, to
let the next one in, while the threads waiting for it kept waking up for it.
A ``SQLITE_BUSY`` that the handler does not cover (SQLite returns some at
once, such as a WAL read snapshot that went stale) runs the unit of work
again after 50 µs, doubling up to 0.5 ms; ``busy_timeout`` seconds after the
first refusal, the error is raised.

An index scan joined with every shard's entity table (a query that scans one
shard, see ``Datastore.scan_streams``) goes through one more connection per
thread: an in-memory database with the shard files ``ATTACH``ed under names
of their own, so that one statement reads them all, as one statement reads
the databases of a MariaDB server.  Never used to write: ``BEGIN IMMEDIATE``
on it would lock every attached file.  Other reads of several files go to
each file on its own: with no round trip to save, a ``UNION ALL`` of them was
no faster.

``synchronous=NORMAL`` by default: in WAL mode a crash of the process loses
nothing, a power cut may lose the last transactions (``synchronous="FULL"``
makes every commit durable).
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, TypeVar

from bagstore.backends.base import Backend, Dialect
from bagstore.backends.seqsql import SequenceSQL, SQLiteSequenceSQL
from bagstore.backends.spares import Spares
from bagstore.backends.sqlitelib import has_wal_reset_bug, sqlite_library, wal_reset_advice
from bagstore.errors import (
    BackendError,
    ConfigurationError,
    DuplicateValue,
    ShardTimeout,
    ShardUnavailable,
)
from bagstore.versions import clock

__all__ = [
    "SQLiteBackend",
    "SQLiteDialect",
    "has_wal_reset_bug",
    "sqlite_library",
    "wal_reset_advice",
]

T = TypeVar("T")

#: Waits between tries of a unit of work that found the database locked.
_BUSY_FIRST_WAIT = 0.00005
_BUSY_MAX_WAIT = 0.0005

_SYNCHRONOUS = ("OFF", "NORMAL", "FULL", "EXTRA")

#: Files one reading connection attaches at most (SQLite's default limit).
_MAX_ATTACHED = 10


class SQLiteDialect(Dialect):
    #: Statement builders for id sequences (backends/seqsql.py).
    sequences: ClassVar[SequenceSQL] = SQLiteSequenceSQL()
    name: ClassVar[str] = "sqlite"
    param: ClassVar[str] = "?"
    quote_char: ClassVar[str] = '"'
    for_update: ClassVar[str] = ""  # BEGIN IMMEDIATE already holds the write lock
    upsert_on_id: ClassVar[str] = "ON CONFLICT(id) DO UPDATE SET"
    greatest: ClassVar[str] = "MAX"
    begin_write: ClassVar[str] = "BEGIN IMMEDIATE"
    fences_by_row: ClassVar[bool] = True  # (a conditional update binds no bucket)

    def locked_read_sql(self, kind: str, buckets: int, ids: int, bodies: bool = True) -> str:
        # A few buckets (a put's own and its index rows'): one primary-key
        # search a bucket, summed, costs SQLite half of COUNT(*) over an IN
        # list, which it reads through a temporary table built per run.
        if not 0 < buckets <= 4:
            return super().locked_read_sql(kind, buckets, ids, bodies)
        one = "IFNULL((SELECT state = 0 FROM bagstore_owned WHERE bucket = ?), 0)"
        head = f"SELECT NULL, NULL, NULL, {' + '.join([one] * buckets)}"
        if not ids:
            return head
        return self.union_all_sql([head, super().locked_read_sql(kind, 0, ids, bodies)])

    def create_catalog_sql(self) -> list[str]:
        return [
            "CREATE TABLE IF NOT EXISTS bagstore_meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)",
            "CREATE TABLE IF NOT EXISTS bagstore_shards "
            "(shard_no INTEGER PRIMARY KEY, name TEXT NOT NULL)",
            "CREATE TABLE IF NOT EXISTS bagstore_buckets "
            "(bucket INTEGER PRIMARY KEY, shard_no INTEGER NOT NULL)",
            "CREATE TABLE IF NOT EXISTS bagstore_indexes (name TEXT PRIMARY KEY, "
            "kind TEXT NOT NULL, definition TEXT NOT NULL, state TEXT NOT NULL, "
            "changed INTEGER NOT NULL)",
            "CREATE TABLE IF NOT EXISTS bagstore_checkpoints "
            "(name TEXT PRIMARY KEY, value INTEGER NOT NULL)",
            "CREATE TABLE IF NOT EXISTS bagstore_kinds (kind TEXT PRIMARY KEY, "
            "shard_key TEXT NOT NULL, shard_map TEXT NOT NULL)",
            "CREATE TABLE IF NOT EXISTS bagstore_moves (bucket INTEGER PRIMARY KEY, "
            "source INTEGER NOT NULL, target INTEGER NOT NULL, phase TEXT NOT NULL)",
            "CREATE TABLE IF NOT EXISTS bagstore_directory (kind TEXT NOT NULL, "
            "skey BLOB NOT NULL, bucket INTEGER NOT NULL, state INTEGER NOT NULL, "
            "PRIMARY KEY (kind, skey))",
            "CREATE TABLE IF NOT EXISTS bagstore_bucket_keys (kind TEXT NOT NULL, "
            "bucket INTEGER NOT NULL, n INTEGER NOT NULL, PRIMARY KEY (kind, bucket))",
        ]

    def insert_ignore_sql(self, table: str, columns: Sequence[str], rows: int = 1) -> str:
        cols = ", ".join(self.q(c) for c in columns)
        values = ", ".join([f"({self.params(len(columns))})"] * rows)
        return f"INSERT OR IGNORE INTO {self.q(table)} ({cols}) VALUES {values}"

    def create_secondary_sql(self, table: str, name: str, columns: Sequence[str]) -> list[str]:
        cols = ", ".join(self.q(c) for c in columns)
        return [f"CREATE INDEX IF NOT EXISTS {self.q(name)} ON {self.q(table)} ({cols})"]

    def upsert_sql(self, table: str, key: Sequence[str], values: Sequence[str]) -> str:
        cols = [*key, *values]
        sets = ", ".join(f"{self.q(c)} = excluded.{self.q(c)}" for c in values)
        return (
            f"INSERT INTO {self.q(table)} ({', '.join(self.q(c) for c in cols)}) "
            f"VALUES ({self.params(len(cols))}) "
            f"ON CONFLICT({', '.join(self.q(c) for c in key)}) DO UPDATE SET {sets}"
        )

    def create_entities_sql(self, kind: str) -> list[str]:
        t = self.q(kind)
        return [
            f"CREATE TABLE IF NOT EXISTS {t} ("
            " added_id INTEGER PRIMARY KEY AUTOINCREMENT,"
            " id BLOB NOT NULL UNIQUE,"
            " bucket INTEGER NOT NULL,"
            " updated INTEGER NOT NULL,"
            " version INTEGER NOT NULL DEFAULT 1,"
            " body BLOB NOT NULL)",
            f"CREATE INDEX IF NOT EXISTS {self.q(kind + '__bucket')} ON {t} (bucket, added_id)",
            f"CREATE INDEX IF NOT EXISTS {self.q(kind + '__updated')} ON {t} (updated)",
        ]

    def create_index_table_sql(self, table: str, columns: Sequence[str], unique: bool) -> list[str]:
        defs, key = self._index_table_parts(columns, unique)
        return [
            f"CREATE TABLE IF NOT EXISTS {self.q(table)} ({defs}, {key}) WITHOUT ROWID",
            f"CREATE INDEX IF NOT EXISTS {self.q(table + '__bucket')} "
            f"ON {self.q(table)} (bagstore_bucket)",
            f"CREATE INDEX IF NOT EXISTS {self.q(table + '__entity_id')} "
            f"ON {self.q(table)} (entity_id)",
        ]

    def columns_sql(self) -> str:
        return "SELECT name FROM pragma_table_info(?)"

    def fenced_insert_sql(
        self, table: str, columns: Sequence[str], rows: int, *, ignore: bool
    ) -> str:
        cols = ", ".join(self.q(c) for c in columns)
        verb = "INSERT OR IGNORE" if ignore else "INSERT"
        return f"{verb} INTO {self.q(table)} ({cols}) {self._fenced_select(columns, rows)}"

    def excluded(self, column: str) -> str:
        return f"excluded.{column}"

    def put_one_sql(self, kind: str, returning: bool = True) -> str | None:
        # The version's clock is read inside the statement, under the file's
        # write lock (taken before anything is evaluated): after every write
        # and delete of the id that came before (bagstore.versions).
        if sqlite3.sqlite_version_info < (3, 35, 0):  # no RETURNING
            return None
        return (
            f"INSERT INTO {self.q(kind)} (id, bucket, updated, version, body) "
            "SELECT :id, :bucket, :updated, bagstore_clock(), :body FROM bagstore_owned "
            "WHERE bucket = :bucket AND state = 0 "
            "ON CONFLICT(id) DO UPDATE SET bucket = excluded.bucket, updated = excluded.updated, "
            "version = MAX(version + 1, excluded.version), body = excluded.body RETURNING version"
        )


class SQLiteBackend(Backend):
    """One SQLite file."""

    dialect = SQLiteDialect()
    driver_errors = (sqlite3.Error,)
    max_statement_rows = 1000
    #: The ids and bodies of entity reads and writes are bound as bytearrays: the
    #: sqlite3 module binds ints, floats, strs and bytearrays as they are but
    #: looks for an adapter of any other parameter, bytes too (two failed
    #: attribute lookups, whose errors are made and cleared), ~3.5k
    #: instructions a parameter against ~1k for the copy; a bytearray is
    #: bound as the same BLOB.
    blob = bytearray

    def __init__(self, path: str, *, synchronous: str = "NORMAL", busy_timeout: float = 30.0):
        super().__init__(f"sqlite:///{path}")
        if not isinstance(synchronous, str) or synchronous.upper() not in _SYNCHRONOUS:
            raise ConfigurationError(
                f"synchronous must be one of {_SYNCHRONOUS}, not {synchronous!r}"
            )
        self.path = path
        self._synchronous = synchronous.upper()
        self._busy_timeout = busy_timeout
        self._busy_ms = max(0, round(busy_timeout * 1000))
        self._local = threading.local()
        self._all: list[sqlite3.Connection] = []
        # Re-entrant: a spare's token hands its connection back (taking this lock)
        # when freed, which the garbage collector may do while this thread holds it.
        self._lock = threading.RLock()
        if path != ":memory:":
            # Files of one process can be read together (see the module's text),
            # each under a name derived from its path.
            digest = hashlib.blake2b(os.path.abspath(path).encode(), digest_size=8).hexdigest()
            self.together = ("sqlite",)
            self.schema = f"bagstore_{digest}"
            self.max_together = _MAX_ATTACHED
            # Measured: 4 files' bodies in one UNION ALL 89 us, one by one 81.
            self.union_reads = False
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._readers = threading.local()  # this thread's connection for read_together
        # The connections of threads that ended, for new threads (see spares.py;
        # a private in-memory database goes with its thread).
        self._spares: Spares[tuple[sqlite3.Connection, sqlite3.Cursor]] = Spares(
            lambda item: path != ":memory:" and self._idle(item[0]),
            lambda item: self._close(item[0]),
        )
        self._spare_readers: Spares[tuple[sqlite3.Connection, dict[str, str]]] = Spares(
            lambda item: self._idle(item[0]), lambda item: self._close(item[0])
        )

    # Reads in autocommit mode have nothing to roll back or retry: on the
    # thread's own idle connection they skip the generic ``run``, whose few
    # microseconds are a good part of a point read on SQLite.
    def get_body(self, kind: str, entity_id: bytes) -> bytes | None:
        """One entity's encoded body, or None: on the thread's idle connection,
        through its cursor kept for point reads (a cursor made and dropped
        per read costs ~0.5 us of a ~6 us read).  A lookup by primary key
        leaves no statement open: ``fetchone`` steps past the only row, which
        resets it."""
        sql = self._point_sql.get(kind) or self.point_read_sql(kind)
        params = (bytearray(entity_id),)  # see blob
        local = self._local
        cur: sqlite3.Cursor | None = getattr(local, "cur", None)
        if cur is None:  # first use, or inside a unit of work
            row = self._read(sql, params, one=True)
        else:
            try:
                row = cur.execute(sql, params).fetchone()
            except sqlite3.Error as exc:
                row = self._read_failed(local.conn, exc, sql, params, True)
        if row is None:
            return None
        body = row[1]  # (a BLOB comes as bytes: no copy to make, nor a call)
        return body if type(body) is bytes else bytes(body)

    def get_versioned(self, kind: str, entity_id: bytes) -> tuple[bytes, int] | None:
        """``(body, version)`` of one entity, or None: read as :meth:`get_body`
        reads, the driver's row as it is (a point read of bytes and an int)."""
        sql = self._versioned_sql.get(kind) or self.versioned_read_sql(kind)
        params = (bytearray(entity_id),)  # see blob
        local = self._local
        cur: sqlite3.Cursor | None = getattr(local, "cur", None)
        if cur is None:  # first use, or inside a unit of work
            row: tuple[bytes, int] | None = self._read(sql, params, one=True)
            return row
        try:
            row = cur.execute(sql, params).fetchone()
        except sqlite3.Error as exc:
            row = self._read_failed(local.conn, exc, sql, params, True)
        return row

    def fetchall(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        rows: list[tuple[Any, ...]] = self._read(sql, params, one=False)
        return rows

    def execute(self, sql: str, params: Sequence[Any] = (), *, replay: bool = True) -> int:
        """One statement in autocommit mode, its row count: on the thread's
        idle connection, through its kept cursor, as reads go (the generic
        path's unit of work, a cursor made and closed, were a fifth of a
        one-statement conditional update's ~45 us).  A statement refused
        because the file is locked changed nothing: after SQLite's busy
        handler gave up it is a ShardTimeout; a refusal the handler does not
        cover goes through :meth:`run`, which waits and tries again."""
        local = self._local
        cur: sqlite3.Cursor | None = getattr(local, "cur", None)
        if cur is None:  # first use, or inside a unit of work
            return super().execute(sql, params, replay=replay)
        try:
            return cur.execute(sql, params).rowcount
        except sqlite3.Error as exc:
            if _is_busy(exc):
                if self._waited(exc):
                    raise self._locked_error() from exc
                return super().execute(sql, params, replay=replay)
            error = self.translated(exc)
            if isinstance(error, ShardUnavailable):
                self._discard(local.conn)
            raise error from exc

    def write(self, work: Callable[..., T], *args: Any, replay: bool = True) -> T:
        """:meth:`Backend.write` on the thread's idle connection, through its
        kept cursor: ``BEGIN IMMEDIATE``, ``work(cursor, *args)``, ``COMMIT``,
        with none of the generic path's unit of work (a cursor made and
        closed, a context manager's generator, the retry loop's frames: a
        fifth of a one-entity put's Python).  A failure rolls back as
        :meth:`run` does; a ``SQLITE_BUSY`` that SQLite's busy handler did not
        cover runs the work again by the generic path, which waits and tries
        again.  (``replay``: nothing to do; a file has no connection to lose.)"""
        local = self._local
        cur: sqlite3.Cursor | None = getattr(local, "cur", None)
        if cur is None:  # first use, or inside a unit of work
            return super().write(work, *args, replay=replay)
        local.cur = None  # in a unit of work
        try:
            cur.execute("BEGIN IMMEDIATE")
            result = work(cur, *args)
            cur.execute("COMMIT")
        except BaseException as exc:
            error = self._settle(cur.connection, exc)  # rolled back and released, or discarded
            if _is_busy(exc):
                if self._waited(exc):
                    raise self._locked_error() from exc
                time.sleep(_BUSY_FIRST_WAIT)
                return super().write(work, *args, replay=replay)
            if error is exc:
                raise
            raise error from exc
        local.cur = cur  # idle
        return result

    def run(self, work: Callable[..., T], *args: Any, attempts: int = 5, replay: bool = True) -> T:
        """:meth:`Backend.run`, run again after a ``SQLITE_BUSY`` that SQLite's
        busy handler does not cover (short waits, see the module's text), for
        ``busy_timeout`` seconds at most; one that it covered has waited that
        long already and is raised at once."""
        deadline: float | None = None
        wait = _BUSY_FIRST_WAIT
        while True:
            try:
                return super().run(work, *args, attempts=attempts, replay=replay)
            except ShardTimeout as exc:
                if not _is_busy(exc.__cause__):
                    raise
                now = time.monotonic()
                deadline = now + self._busy_timeout if deadline is None else deadline
                if now >= deadline or self._waited(exc.__cause__):
                    raise self._locked_error() from exc.__cause__
            time.sleep(min(wait, deadline - now))
            wait = min(2 * wait, _BUSY_MAX_WAIT)

    def _waited(self, exc: BaseException | None) -> bool:
        """Whether the busy error ``exc`` came after SQLite's busy handler had
        waited ``busy_timeout``: a plain ``SQLITE_BUSY`` (in WAL mode the busy
        codes returned without waiting are extended ones: BUSY_SNAPSHOT,
        BUSY_RECOVERY)."""
        code = getattr(exc, "sqlite_errorcode", None)
        return self._busy_ms > 0 and code == sqlite3.SQLITE_BUSY

    def _locked_error(self) -> ShardTimeout:
        return ShardTimeout(
            f"{self.name}: the database stayed locked by another connection for "
            f"{self._busy_timeout:g} s (busy_timeout)"
        )

    def _read(self, sql: str, params: Sequence[Any], *, one: bool) -> Any:
        cur: sqlite3.Cursor | None = getattr(self._local, "cur", None)
        if cur is None:  # first use, or inside a unit of work
            rows = super().fetchall(sql, params)
            return (rows[0] if rows else None) if one else rows
        conn = cur.connection
        try:
            return _fetch(conn, sql, params, one)
        except sqlite3.Error as exc:
            return self._read_failed(conn, exc, sql, params, one)

    def _read_failed(
        self,
        conn: sqlite3.Connection,
        exc: sqlite3.Error,
        sql: str,
        params: Sequence[Any],
        one: bool,
    ) -> Any:
        """After a read on the thread's idle ``conn`` failed with ``exc``: run
        it again as writers wait when the file was locked, else raise the
        error (the connection discarded if the file is unavailable)."""
        if _is_busy(exc):  # rare for a read in WAL mode: wait as writers do
            if self._waited(exc):
                raise self._locked_error() from exc
            return self.run(_fetch, sql, params, one)
        error = self.translated(exc)
        if isinstance(error, ShardUnavailable):
            self._discard(conn)
        raise error from exc

    def read_together(
        self, sql: str, params: Sequence[Any], reach: Sequence[Backend]
    ) -> list[tuple[Any, ...]]:
        """Run a read over several shard files on this thread's reading
        connection, attaching the files of ``reach`` it lacks (and detaching
        others when it would hold too many)."""
        local = self._readers
        conn: sqlite3.Connection | None = getattr(local, "conn", None)
        try:
            if conn is None:
                spare = self._spare_readers.take()
                if spare is None:
                    spare = (self._reading_connection(), {})
                conn, local.attached = spare
                local.conn = conn
                local.token = self._spare_readers.token(spare)
            attached: dict[str, str] = local.attached
            for b in reach:
                if b.schema not in attached:
                    self._attach(conn, attached, reach)
                    break
            try:
                return conn.execute(sql, params).fetchall()
            except sqlite3.OperationalError as exc:
                if not _is_busy(exc) or self._waited(exc):
                    raise
            deadline = time.monotonic() + self._busy_timeout
            wait = _BUSY_FIRST_WAIT
            while True:
                time.sleep(wait)
                wait = min(2 * wait, _BUSY_MAX_WAIT)
                try:
                    return conn.execute(sql, params).fetchall()
                except sqlite3.OperationalError as exc:
                    if not _is_busy(exc) or self._waited(exc) or time.monotonic() >= deadline:
                        raise
        except sqlite3.Error as exc:
            if conn is not None and isinstance(self.translated(exc), ShardUnavailable):
                local.token.disarm()
                local.conn = local.token = None
                self._close(conn)
            raise self.translated(exc) from exc

    def _reading_connection(self) -> sqlite3.Connection:
        conn = sqlite3.connect(
            ":memory:",
            isolation_level=None,
            check_same_thread=False,
            uri=True,
            cached_statements=512,  # statements over several files vary more
        )
        conn.execute(f"PRAGMA busy_timeout={self._busy_ms}")
        with self._lock:
            self._all.append(conn)
        return conn

    def _attach(
        self, conn: sqlite3.Connection, attached: dict[str, str], reach: Sequence[Backend]
    ) -> None:
        """Attach the files of ``reach`` that ``conn`` lacks (``attached``: name
        -> path of those it holds), detaching others when it would hold too
        many."""
        wanted: dict[str, str] = {}
        for b in reach:
            if not isinstance(b, SQLiteBackend) or b.schema is None:
                raise ConfigurationError(f"{b.name} cannot be read together with {self.name}")
            wanted[b.schema] = b.path
        # (A name is derived from its file's path: attached means this file.)
        missing = [name for name in wanted if name not in attached]
        for name in [n for n in attached if n not in wanted]:
            if len(attached) + len(missing) <= _MAX_ATTACHED:
                break
            conn.execute(f"DETACH DATABASE {self.dialect.q(name)}")
            del attached[name]
        for name in missing:
            # mode=rw: a missing file is an error, not a new empty database
            uri = f"file:{urllib.parse.quote(os.path.abspath(wanted[name]))}?mode=rw"
            conn.execute(f"ATTACH DATABASE ? AS {self.dialect.q(name)}", (uri,))
            attached[name] = wanted[name]

    def after_bulk_step(self) -> None:
        """Checkpoint the WAL (PASSIVE: it neither waits for nor blocks anyone).
        Bulk writes grow the WAL fast, and SQLite checkpoints it in whichever
        commit crosses ``wal_autocheckpoint`` pages: left alone, a live writer's
        commit pays for copying the bulk pages into the database and its fsync."""
        self._read("PRAGMA wal_checkpoint(PASSIVE)", (), one=True)

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(
            self.path, timeout=self._busy_timeout, isolation_level=None, check_same_thread=False
        )
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(f"PRAGMA synchronous={self._synchronous}")
        conn.execute(f"PRAGMA busy_timeout={self._busy_ms}")  # see the module's text
        conn.create_function("bagstore_clock", 0, clock)  # see SQLiteDialect.put_one_sql
        with self._lock:
            self._all.append(conn)
        return conn

    # The thread's connection is ``local.conn``; ``local.kept`` its cursor for
    # statements outside units of work (get_body's, execute's) and for the
    # transactions of ``write``, which is ``local.cur`` while the connection
    # is idle and None while a unit of work (or a write) holds it: the
    # statements' one test of the thread's state.  ``local.token`` hands both
    # back when the thread ends (a spare taken by the next new thread).
    def _acquire(self) -> Any:
        local = self._local
        conn: sqlite3.Connection | None = getattr(local, "conn", None)
        if conn is None:
            spare = self._spares.take()
            if spare is None:
                new = self._connect()
                spare = (new, new.cursor())
            conn, local.kept = spare
            local.conn = conn
            local.token = self._spares.token(spare)
        elif local.cur is None:  # re-entered on the same thread: a private connection
            return self._connect()
        local.cur = None  # in a unit of work
        return conn

    def _release(self, conn: Any) -> None:
        local = self._local
        if conn is getattr(local, "conn", None):
            local.cur = local.kept  # idle
        else:
            self._close(conn)

    def _discard(self, conn: Any) -> None:
        local = self._local
        if conn is getattr(local, "conn", None):
            local.token.disarm()
            local.conn = local.cur = local.kept = local.token = None
        self._close(conn)

    def _idle(self, conn: sqlite3.Connection) -> bool:
        """Whether a connection handed back at the end of its thread may serve
        another: still open (not closed with the store) and in no transaction."""
        with self._lock:
            return conn in self._all and not conn.in_transaction

    def _close(self, conn: sqlite3.Connection) -> None:
        with self._lock:
            if conn in self._all:
                self._all.remove(conn)
        conn.close()

    def close(self) -> None:
        with self._lock:
            conns, self._all = self._all, []
        for conn in conns:
            conn.close()
        self._spares.clear()
        self._spare_readers.clear()
        self._local = threading.local()
        self._readers = threading.local()

    def classify(self, exc: BaseException) -> type[BackendError]:
        text = str(exc).lower()
        if isinstance(exc, sqlite3.OperationalError):
            if "locked" in text or "busy" in text:
                return ShardTimeout
            if "unable to open" in text or "disk i/o" in text:
                return ShardUnavailable
        if isinstance(exc, sqlite3.IntegrityError) and "unique" in text:
            return DuplicateValue
        return BackendError


def _is_busy(exc: BaseException | None) -> bool:
    """Whether ``exc`` is SQLite refusing because another connection holds a lock."""
    return isinstance(exc, sqlite3.OperationalError) and exc.sqlite_errorcode & 0xFF in (
        sqlite3.SQLITE_BUSY,  # and its extended codes (BUSY_SNAPSHOT, BUSY_RECOVERY...)
        sqlite3.SQLITE_LOCKED,
    )


def _fetch(conn: sqlite3.Connection, sql: str, params: Sequence[Any], one: bool) -> Any:
    cur = conn.execute(sql, params)
    return cur.fetchone() if one else cur.fetchall()
