"""MariaDB / MySQL through PyMySQL (default) or mysqlclient (the statement
text, :class:`MySQLDialect`, is in ``mysqlsql.py``; a put of one entity
calls a stored procedure: ``mysqlproc.py``; the drivers' error codes:
``mysqlerrors.py``).

Driver quirks live here: every session runs with ``time_zone='+00:00'`` and a
strict ``sql_mode``; bytes go over the wire with the ``_binary`` prefix; the
database is created when missing (``utf8mb4_bin``, so text compares as
bytes); connections idle for a minute are pinged before use and replaced if the
server dropped them; a statement that failed on a lost connection or as a
deadlock victim is retried on a fresh connection (see ``Backend.run``).

Timeouts (docs/configuration.md): connecting, the handshake included, may take
``connect_timeout`` seconds (5); a statement's answer ``read_timeout`` (30)
and sending it ``write_timeout`` (30); bulk work (Cleaner batches, moves,
``check``, ``count``: see :func:`bagstore.backends.pool.long_statements`)
waits ``bulk_timeout`` (600) instead, on PyMySQL.  A timeout is
``ShardTimeout``, never retried: the connection is closed, and a write whose
answer did not come may or may not have been applied.

The largest body and the largest multi-row statement follow from the server's
``max_allowed_packet`` (a value may be escaped to twice its size on the wire).

A primary with replicas (``replica=`` in its URL, docs/replication.md)
remembers the GTID of each transaction this process commits there (MariaDB's
``session_track_system_variables=last_gtid``, read from the OK packet that
PyMySQL already receives: no extra round trip; mysqlclient asks
``SELECT @@last_gtid`` after a write), so that a replica read can wait for it.
Every new connection to such a primary first checks that the server is
writable (``read_only`` off) and what role row it holds, and a connection
that broke makes the next statement re-check where the primary is (see
``guard``; the router decides, :mod:`bagstore.sharding.replicas`).
"""

from __future__ import annotations

import importlib
import logging
import math
import random
from collections.abc import Callable, Sequence
from typing import Any

from bagstore.backends.base import Backend, check_identifier
from bagstore.backends.gtid import Gtids, tracking_connection
from bagstore.backends.mysqlerrors import (
    DEADLOCK,
    DUPLICATE,
    LOST,
    NO_SUCH_TABLE,
    READ_ONLY,
    TIMEOUT,
    UNAVAILABLE,
    UNKNOWN_DATABASE,
    UNKNOWN_VARIABLE,
    timed_out,
    timeout_of,
)
from bagstore.backends.mysqlproc import ProcedurePuts
from bagstore.backends.mysqlsql import MySQLDialect
from bagstore.backends.pipeline import MULTI_STATEMENTS, Pipeline
from bagstore.backends.pool import Pool, in_long_statements
from bagstore.errors import (
    BackendError,
    ConfigurationError,
    DuplicateValue,
    ShardTimeout,
    ShardUnavailable,
)

__all__ = ["MySQLBackend", "MySQLDialect"]

SQL_MODE = (
    "STRICT_ALL_TABLES,NO_ZERO_IN_DATE,NO_ZERO_DATE,"
    "ERROR_FOR_DIVISION_BY_ZERO,NO_ENGINE_SUBSTITUTION"
)
# group_concat_max_len: MySQL's default (1,024 bytes) would cut int_column short.
INIT_COMMAND = f"SET time_zone = '+00:00', sql_mode = '{SQL_MODE}', group_concat_max_len = 16777216"

log = logging.getLogger(__name__)
#: A BIGINT column's type in result metadata (MYSQL_TYPE_LONGLONG).
_LONGLONG = 8

_SESSION_TRACK = 1 << 23  # client capability: session state in OK packets
_MEDIUMBLOB_MAX = 16 * 1024 * 1024 - 1


def _load_driver(name: str) -> Any:
    module = {"pymysql": "pymysql", "mysqlclient": "MySQLdb", "mysqldb": "MySQLdb"}.get(name)
    if module is None:
        raise ConfigurationError(f"unknown MySQL driver {name!r} (use pymysql or mysqlclient)")
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigurationError(
            f"MySQL driver {name!r} is not installed (pip install 'bagstore[{name}]')"
        ) from exc


class MySQLBackend(ProcedurePuts, Backend):
    """One MariaDB/MySQL database (a schema) on one server."""

    dialect = MySQLDialect()
    #: Each statement is a commit (and an fsync): fewer, larger ones fill faster.
    index_rows_per_statement = 1000
    bulk_rows_per_statement = 5000

    def __init__(
        self,
        *,
        host: str,
        port: int,
        user: str,
        password: str,
        database: str,
        driver: str = "pymysql",
        pool_size: int = 16,
        connect_timeout: float = 5.0,
        read_timeout: float | None = 30.0,
        write_timeout: float | None = 30.0,
        bulk_timeout: float | None = 600.0,
        replicas: Sequence[str] = (),
        replica: bool = False,
    ) -> None:
        check_identifier(database, "MySQL database name")
        #: How to open the same database on another server (see ``sibling``).
        self._settings: dict[str, Any] = dict(
            user=user, password=password, database=database, driver=driver,
            pool_size=pool_size, connect_timeout=connect_timeout, read_timeout=read_timeout,
            write_timeout=write_timeout, bulk_timeout=bulk_timeout,
        )  # fmt: skip
        #: The servers configured as this one's replicas (``host:port``).
        self.replicas = tuple(replicas)
        #: A replica: never creates the database nor tracks GTIDs.
        self.replica = replica
        #: Called before work when a connection to this primary broke (or a new
        #: one found the server read-only): the router re-reads where the
        #: primary is and may ``retarget`` this backend.
        self.guard: Callable[[MySQLBackend], None] | None = None
        self.suspect = False
        #: The role row a new connection must find (epoch), set by the router.
        self.epoch = 0
        #: the GTIDs this process committed here (the highest per domain)
        self.gtids = Gtids()
        super().__init__(f"mysql://{user}@{host}:{port}/{database}", server=f"{host}:{port}")
        self.host, self.port, self.user, self.database = host, port, user, database
        self._password = password
        self._driver = _load_driver(driver)
        # Databases on one server reached with one login: one connection reads
        # them all (``db`.`table``), so their reads may share a statement.
        self.together = ("mysql", host, port, user, password, self._driver.__name__)
        self.schema = database
        self.driver_errors = (self._driver.Error,)
        self._connect_timeout = connect_timeout
        self._read_timeout = read_timeout
        self._write_timeout = write_timeout
        self._bulk_timeout = bulk_timeout
        # PyMySQL reads a connection's timeouts at each packet: they can change
        # between statements (a bulk step's longer ones, the handshake's shorter).
        self._switchable = self._driver.__name__ == "pymysql"
        self.parses_in_python = self._switchable
        self._created_database = replica
        self._track = bool(replicas) and not replica
        self._tracking_class: Any = None
        if self._track and self._switchable:
            self._tracking_class = tracking_connection(self._driver)
        self._pool: Pool[Any] = self._new_pool()
        self._limits_known = False
        self._compound_kinds: set[str] = set()  # puts without a procedure: mysqlproc.py

    def _columns(self, table: str) -> dict[str, int]:
        """``{column name: protocol type code}`` of ``table`` here (empty if
        there is no such table), from a ``SELECT ... LIMIT 0``'s result
        metadata: no information_schema query, whose temporary table some
        MariaDB 10.11 builds crash on while other sessions drop databases."""
        sql = f"SELECT * FROM {self.dialect.q(check_identifier(table, 'table name'))} LIMIT 0"

        def work(conn: Any) -> dict[str, int]:
            cur = conn.cursor()
            try:
                cur.execute(sql)
                return {str(d[0]).lower(): int(d[1]) for d in cur.description}
            except self._driver.ProgrammingError as exc:
                if exc.args and exc.args[0] == NO_SUCH_TABLE:
                    return {}
                raise
            finally:
                cur.close()

        return self.run(work)

    def table_columns(self, table: str) -> frozenset[str]:
        return frozenset(self._columns(table))

    def _widen_version(self, kind: str) -> None:
        found = self._columns(kind).get("version")
        if found is not None and found != _LONGLONG:
            log.warning("shard %s: widening %s.version to BIGINT (once)", self.name, kind)
            self._executescript(self.dialect.widen_version_sql(kind))

    def _new_pool(self) -> Pool[Any]:
        return Pool(
            self._connect,
            lambda c: c.close(),
            size=int(self._settings["pool_size"]),
            alive=self._alive,
            name=self.name,
        )

    # -- replication (docs/replication.md) ------------------------------------------
    @property
    def replicated(self) -> bool:
        """Whether this is a primary with replicas."""
        return self._track

    def sibling(
        self,
        address: str,
        *,
        user: str | None = None,
        password: str | None = None,
        **settings: Any,
    ) -> MySQLBackend:
        """The same database on another server (``host:port``), with this
        login unless ``user`` is given (``settings``: other timeouts, ...):
        a replica's backend, which never creates the database."""
        host, _, port = address.rpartition(":")
        settings = {**self._settings, **settings}
        if user is not None:
            settings.update(user=user, password=password or "")
        return MySQLBackend(host=host, port=int(port), replica=True, **settings)

    def retarget(self, address: str) -> None:
        """Send this shard's statements to another server from now on (the
        router's decision after a failover): connections to the old one are
        closed as they come back."""
        host, _, port = address.rpartition(":")
        old = self._pool
        self.host, self.port, self.server = host, int(port), address
        self.together = ("mysql", host, int(port), *self.together[3:])  # type: ignore[index]
        self._pool = self._new_pool()
        old.close()

    def position(self) -> str:
        """The GTID position of this process's writes here ('' if none), for
        ``MASTER_GTID_WAIT`` on a replica."""
        return self.gtids.position()

    # PyMySQL parses every column of every row in Python (~1.5 us each): a
    # flat-out backfill's read leaves the stamps out of the rows and gets them
    # as one string in the same statement (one read view), and its check after
    # the insert reads that string again, one row instead of a row per entity.
    # (A paced backfill reads the rows as they are: the Python it saves would
    # shorten each batch, and so its pause, and raise its load on the server.)
    def scan_bodies(
        self, kind: str, after_added_id: int, limit: int, *, packed: bool = False
    ) -> tuple[list[tuple[bytes, bytes]], str]:
        if not packed:
            return super().scan_bodies(kind, after_added_id, limit)
        rows: list[tuple[bytes, bytes]] = []
        text = ""
        for r in self.fetchall(self.sql("scan_bodies_sql", kind, int(limit)), [after_added_id] * 2):
            if r[0] is None:
                found = r[1]
                text = found.decode() if isinstance(found, bytes | bytearray) else str(found or "")
            else:
                rows.append((bytes(r[0]), bytes(r[1])))
        return rows, text

    def stamps_text(self, kind: str, after: int, last: int, *, packed: bool = False) -> str:
        if not packed:
            return super().stamps_text(kind, after, last)
        found = self.fetchall(self.sql("stamps_text_sql", kind), [after, last])[0][0]
        if found is None:
            return ""
        return found.decode() if isinstance(found, bytes | bytearray) else str(found)

    def int_column(self, table: str, key: str, value: str) -> list[int] | None:
        # One row instead of one per key: the catalog's bucket map (1,024 rows)
        # took 9 ms to read row by row through PyMySQL, 0.5 ms this way.
        d = self.dialect
        k, v = d.q(key), d.q(value)
        rows = self.fetchall(
            f"SELECT COUNT(*), MIN({k}), MAX({k}), "
            f"GROUP_CONCAT({v} ORDER BY {k} SEPARATOR ',') FROM {d.q(table)}"
        )
        count, low, high, joined = rows[0]
        if not count:
            return []
        # the keys are a primary key (distinct): count and bounds tell they are 0..n-1
        if int(low) != 0 or int(high) != int(count) - 1:
            return None
        text = joined.decode() if isinstance(joined, bytes | bytearray) else str(joined)
        values = [int(x) for x in text.split(",")]
        return values if len(values) == int(count) else None

    def server_advice(self) -> list[str]:
        # MariaDB runs InnoDB's purge as tasks of a thread pool that keeps two
        # per core busy; its default of 4 purge tasks fills that pool on a
        # 2-core server, and a move's deletes then stall writers for seconds
        # (docs/scaleout.md).  thread_pool_size: the cores MariaDB counted,
        # unless set (MySQL has no such variable: no advice there).
        try:
            rows = self.fetchall("SELECT @@innodb_purge_threads, @@thread_pool_size")
        except BackendError as exc:
            if self._code(exc.__cause__) != UNKNOWN_VARIABLE:
                raise
            return []  # not MariaDB
        purge, cores = int(rows[0][0]), int(rows[0][1])
        enough = max(1, cores // 2)
        if cores < 1 or purge <= enough:  # (0: set at run time, not counted)
            return []
        return [
            f"{self.server}: innodb_purge_threads is {purge} on a server with {cores} cores "
            f"(thread_pool_size); InnoDB's purge can then stall writes for seconds while "
            f"buckets move. Set it to {enough} "
            f"(SET GLOBAL innodb_purge_threads = {enough}; see docs/scaleout.md)."
        ]

    def _check_role(self, conn: Any) -> None:
        """A new connection to a primary with replicas: the server must be
        writable and must not hold a role row newer than the one this process
        routes by (else: ``_NotPrimary``, and the router looks again)."""
        cur = conn.cursor()
        try:
            cur.execute("SELECT @@global.read_only")
            read_only = int(cur.fetchone()[0])
            epoch = self.epoch
            try:
                cur.execute("SELECT epoch FROM bagstore_role WHERE one = 1")
                row = cur.fetchone()
                epoch = int(row[0]) if row else 0
            except self._driver.Error as exc:
                if self._code(exc) != NO_SUCH_TABLE:  # no failover yet
                    raise
        finally:
            cur.close()
        if read_only or epoch != self.epoch:
            conn.close()
            self.suspect = True
            raise _NotPrimary(
                f"shard {self.name}: {self.server} is "
                + ("read-only" if read_only else f"at epoch {epoch}, not {self.epoch}")
            )

    def _connect_args(self, database: str | None) -> dict[str, Any]:
        args: dict[str, Any] = {
            "host": self.host,
            "port": self.port,
            "user": self.user,
            "password": self._password,
            "charset": "utf8mb4",
            "autocommit": True,
            "init_command": INIT_COMMAND,
            "connect_timeout": self._connect_timeout,
            "binary_prefix": True,
        }
        if self._switchable:
            # The handshake and the session's set-up are part of connecting: PyMySQL
            # waits for them with the read timeout, set to the statements' own
            # once connected (see _connect).
            args["read_timeout"] = args["write_timeout"] = self._connect_timeout
        else:
            for key in ("read_timeout", "write_timeout"):
                if getattr(self, f"_{key}") is not None:
                    args[key] = getattr(self, f"_{key}")
        if self._driver.__name__ == "MySQLdb":  # mysqlclient takes whole seconds only
            for key in ("connect_timeout", "read_timeout", "write_timeout"):
                if key in args:
                    args[key] = max(1, math.ceil(args[key]))
        if database is not None:
            args["database"] = database
        flags = MULTI_STATEMENTS if self._switchable else 0  # PyMySQL: see _write_cursor
        if self._track:
            args["init_command"] += ", session_track_system_variables = 'last_gtid'"
            if self._tracking_class is not None:
                flags |= _SESSION_TRACK
        if flags:
            args["client_flag"] = flags
        return args

    def _write_cursor(self, conn: Any) -> Any:
        # With PyMySQL, a write transaction is pipelined (bagstore.backends.pipeline).
        return Pipeline(conn.cursor()) if self._switchable else conn.cursor()

    def _connect(self) -> Any:
        drv = self._driver
        connect = self._tracking_class or drv.connect
        try:
            try:
                conn = connect(**self._connect_args(self.database))
            except drv.OperationalError as exc:
                if exc.args and exc.args[0] == UNKNOWN_DATABASE and not self._created_database:
                    self._create_database()
                    conn = connect(**self._connect_args(self.database))
                else:
                    raise
            if not self._limits_known:
                self._read_limits(conn)
            if self._track:
                self._check_role(conn)
        except drv.Error as exc:
            if self._track:
                self.suspect = True  # no answer: is the primary elsewhere now?
            if timed_out(exc):
                raise ShardTimeout(
                    f"shard {self.name}: the server did not complete a new connection within "
                    f"{self._connect_timeout:g} s (connect_timeout); nothing was sent to it "
                    f"({exc})",
                    shard=self.name,
                ) from exc
            raise
        if self._switchable:
            conn._read_timeout, conn._write_timeout = self._read_timeout, self._write_timeout
        return conn

    def _create_database(self) -> None:
        conn = self._driver.connect(**self._connect_args(None))
        try:
            cur = conn.cursor()
            cur.execute(
                f"CREATE DATABASE IF NOT EXISTS {self.dialect.q(self.database)} "
                "CHARACTER SET utf8mb4 COLLATE utf8mb4_bin"
            )
            cur.close()
        finally:
            conn.close()
        self._created_database = True

    def _read_limits(self, conn: Any) -> None:
        cur = conn.cursor()
        cur.execute("SELECT @@max_allowed_packet")
        packet = int(cur.fetchone()[0])
        cur.close()
        self.max_body_bytes = min(_MEDIUMBLOB_MAX, (packet - 64 * 1024) // 2)
        self.max_statement_bytes = max(64 * 1024, (packet - 64 * 1024) // 2)
        self._limits_known = True

    def _alive(self, conn: Any) -> bool:
        try:
            conn.ping(False)
        except self._driver.Error:
            return False
        return True

    def ensure_limits(self) -> None:
        """Make sure ``max_body_bytes`` reflects the server (one connection)."""
        if not self._limits_known:
            with self.connection():
                pass

    def _acquire(self) -> Any:
        if self.suspect and self.guard is not None:
            self.guard(self)
        try:
            conn = self._pool.acquire()
        except _NotPrimary:
            if self.guard is None:
                raise
            self.guard(self)  # waits while no server is writable, may retarget
            conn = self._pool.acquire()
        if self._switchable:
            if in_long_statements():
                read = write = self._bulk_timeout
            else:
                read, write = self._read_timeout, self._write_timeout
            if conn._read_timeout != read or conn._write_timeout != write:
                conn._read_timeout, conn._write_timeout = read, write
        return conn

    def _release(self, conn: Any) -> None:
        if self._track:
            self._collect_gtid(conn)
        self._pool.release(conn)

    def _collect_gtid(self, conn: Any) -> None:
        if self._tracking_class is not None:
            gtid = conn.tracked_gtid
            if gtid:
                conn.tracked_gtid = ""
                self.gtids.note(gtid)
        else:  # mysqlclient reports no session state: ask (a write may have committed)
            try:
                cur = conn.cursor()
                cur.execute("SELECT @@last_gtid")
                gtid = cur.fetchone()[0]
                cur.close()
            except self._driver.Error:
                return  # (the connection's next use finds it broken)
            if gtid:
                self.gtids.note(gtid.decode() if isinstance(gtid, bytes) else str(gtid))

    def _discard(self, conn: Any) -> None:
        if self._track:
            self.suspect = True  # a broken connection: where is the primary now?
        self._pool.discard(conn)

    def close(self) -> None:
        self._pool.close()

    def _code(self, exc: BaseException | None) -> int | None:
        args = getattr(exc, "args", ())
        return args[0] if args and isinstance(args[0], int) else None

    def classify(self, exc: BaseException) -> type[BackendError]:
        code = self._code(exc)
        if timed_out(exc):
            return ShardTimeout
        if code in UNAVAILABLE or isinstance(exc, self._driver.InterfaceError):
            return ShardUnavailable
        if code in TIMEOUT:
            return ShardTimeout
        if code in DUPLICATE:
            return DuplicateValue
        if code == READ_ONLY and self._track:
            return ShardUnavailable  # the primary was fenced: see is_retryable
        return BackendError

    def translated(self, exc: BaseException) -> BackendError:
        if not timed_out(exc):
            return super().translated(exc)
        bulk = self._switchable and in_long_statements()
        limit = self._bulk_timeout if bulk else self._read_timeout
        waited = f"{limit:g} s" if limit is not None else "the time allowed"
        error = ShardTimeout(
            f"shard {self.name}: no answer within {waited} "
            f"({'bulk_timeout' if bulk else 'read_timeout'}); the statement was abandoned "
            "and its connection closed. If it was a write (or its commit), the write may or "
            "may not have been applied: read it back before writing it again "
            f"({timeout_of(exc)})",
            shard=self.name,
        )
        error.__cause__ = exc
        return error

    def _settle(self, conn: Any, exc: BaseException) -> BaseException:
        if isinstance(exc, self.driver_errors) and timed_out(exc):
            # The driver closed the connection: nothing to roll back.
            self._discard(conn)
            return self.translated(exc)
        return super()._settle(conn, exc)

    def retry_pause(self, exc: BaseException, attempt: int) -> float:
        # A deadlock victim that tries again at once meets the same writers
        # in the same order: a random pause, doubling, spreads them out.
        if self._code(exc) in DEADLOCK:
            return random.uniform(0.0, min(0.004 * 2**attempt, 0.25))
        return 0.0

    def connection_survives(self, exc: BaseException) -> bool:
        return self._code(exc) in DEADLOCK  # InnoDB rolled the victim back; the session is fine

    def is_retryable(self, exc: BaseException) -> bool:
        code = self._code(exc)
        # A connection lost mid-way is worth one more try; a server that refuses
        # connections is not (fail fast, the caller sees ShardUnavailable), nor
        # one that did not answer in time (its write may have been applied, and
        # waiting again would double the caller's wait).
        if timed_out(exc):
            return False
        if code == READ_ONLY and self._track:
            self.suspect = True  # fenced (a switchover): look for the primary again
            return True
        if not code and isinstance(exc, self._driver.InterfaceError):
            # the rollback after a lost connection found it closed: the loss counts
            return self.is_retryable(exc.__context__) if exc.__context__ is not None else False
        return code in DEADLOCK or code in LOST

    def outcome_unknown(self, exc: BaseException) -> bool:
        code = self._code(exc)
        if not code and isinstance(exc, self._driver.InterfaceError):
            return self.outcome_unknown(exc.__context__) if exc.__context__ is not None else False
        return code in LOST and not timed_out(exc)


class _NotPrimary(ShardUnavailable):
    """A new connection found a server that is not (or no longer) the primary."""
