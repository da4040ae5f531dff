"""SQL for integer id sequences: block reservations and Flickr-style ticket tables.

Every id server (the catalog database, or each ``sequence_servers=`` URL) holds

``bagstore_sequences``, one row per sequence:

========== ===================================================================
name       the sequence's name (primary key, a plain identifier)
id         the top of the last block reserved on this server
high       written by the same statement as ``id``; a reservation starts above
           ``GREATEST(id, high, floor)``, so lowering ``id`` by hand moves nothing
servers    how many id servers share the sequence (n)
server_no  this server's place among them (i, from 0): it hands out ids ≡ i+1 (mod n)
========== ===================================================================

A reservation is one statement: the interval ``(base, base + span]`` with
``base = GREATEST(id, high, floor)`` becomes this process's, and the new top is
read back without a second round trip:

* MariaDB/MySQL: ``UPDATE ... SET id = LAST_INSERT_ID(GREATEST(id, high, %s) + %s),
  high = id`` (single-table assignments run left to right, so ``high`` gets the
  new ``id``), the top read from ``cursor.lastrowid``.  No trigger may sit on the
  table: a statement that fires one reports 0 as its insert id.
* SQLite (3.35+): ``UPDATE ... SET id = max(id, high, ?) + ?, high = ... RETURNING id``
  as one autocommit statement (atomic: SQLite runs one writer at a time).

``bagstore_tickets_<name>``: Flickr's single-row ticket table; ``REPLACE INTO t
(stub) VALUES ('a')`` and the new id from ``cursor.lastrowid`` (one round trip).
On MariaDB the server steps the ids itself (``auto_increment_increment`` /
``auto_increment_offset``: bagstore sets them for its own sessions when there
are several id servers, and otherwise leaves the server's settings alone); on
SQLite ticket ``t`` of server ``i`` of ``n`` is mapped to ``(t - 1) * n + i + 1``.

Nothing here decides which server to ask or what to hand out: that is
:mod:`bagstore.ids.sequence`.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Sequence
from typing import Any, ClassVar, NamedTuple

from bagstore.backends.base import Backend, check_identifier
from bagstore.errors import BackendError, ConfigurationError

__all__ = [
    "SEQUENCES",
    "TICKET_PREFIX",
    "MySQLSequenceSQL",
    "SQLiteSequenceSQL",
    "SequenceRow",
    "SequenceSQL",
    "advance_sequence_row",
    "create_sequence_row",
    "ensure_sequences_table",
    "ensure_ticket_table",
    "next_ticket",
    "reserve",
    "sequence_row",
    "sequence_rows",
    "ticket_table",
]

SEQUENCES = "bagstore_sequences"
TICKET_PREFIX = "bagstore_tickets_"
_COLUMNS = ("name", "id", "high", "servers", "server_no")


class SequenceRow(NamedTuple):
    """One row of ``bagstore_sequences`` as stored on one server."""

    name: str
    id: int
    high: int
    servers: int
    server_no: int

    @property
    def value(self) -> int:
        """The last id reserved: ``max(id, high)``."""
        return max(self.id, self.high)


class SequenceSQL:
    """Statement builders for sequences; one subclass per dialect, found as the
    dialect's ``sequences`` attribute."""

    #: True when the ticket table steps by n from offset i+1 by itself.
    native_ticket_step: ClassVar[bool] = False

    def create_sequences_sql(self) -> list[str]:
        raise NotImplementedError

    def reserve_sql(self) -> str:
        raise NotImplementedError

    def reserve_params(
        self, name: str, floor: int, span: int, servers: int, server_no: int
    ) -> list[Any]:
        raise NotImplementedError

    def reserved_top(self, cur: Any) -> int | None:
        """The new top from the cursor of :meth:`reserve_sql`, or None if no row matched."""
        raise NotImplementedError

    def advance_sql(self) -> str:
        """Insert the row ``(name, id, high, servers, server_no)``, or raise an
        existing one to at least that ``id`` and give it that servers/server_no."""
        raise NotImplementedError

    def create_ticket_sql(self, table: str) -> list[str]:
        raise NotImplementedError

    def ticket_sql(self, table: str) -> str:
        return f"REPLACE INTO {check_identifier(table)} (stub) VALUES ('a')"

    def ticket_session_sql(self, servers: int, server_no: int) -> str | None:
        """A statement that makes this session step tickets by ``servers``, or None."""
        return None

    def ticket_seed_sql(self, table: str) -> str:
        """Plant the row ``(id = ?, stub = 'a')`` only if the table is empty (an
        ignored insert would still move SQLite's AUTOINCREMENT counter)."""
        raise NotImplementedError

    def ticket_seed(self, start: int, servers: int, server_no: int) -> int:
        """The ticket row to plant when the table is made, so that the first id
        handed out is at least ``start`` (0: plant nothing)."""
        if self.native_ticket_step:
            return start - 1
        offset = server_no + 1
        first = 1 if start <= offset else -(-(start - offset) // servers) + 1
        return first - 1


class SQLiteSequenceSQL(SequenceSQL):
    native_ticket_step: ClassVar[bool] = False

    def create_sequences_sql(self) -> list[str]:
        return [
            f"CREATE TABLE IF NOT EXISTS {SEQUENCES} (name TEXT NOT NULL PRIMARY KEY, "
            "id INTEGER NOT NULL, high INTEGER NOT NULL, servers INTEGER NOT NULL, "
            "server_no INTEGER NOT NULL) WITHOUT ROWID"
        ]

    def reserve_sql(self) -> str:
        return (
            f"UPDATE {SEQUENCES} SET id = max(id, high, ?) + ?, high = max(id, high, ?) + ? "
            "WHERE name = ? AND servers = ? AND server_no = ? RETURNING id"
        )

    def reserve_params(
        self, name: str, floor: int, span: int, servers: int, server_no: int
    ) -> list[Any]:
        return [floor, span, floor, span, name, servers, server_no]

    def reserved_top(self, cur: Any) -> int | None:
        rows = cur.fetchall()
        return rows[0][0] if rows else None

    def advance_sql(self) -> str:
        return (
            f"INSERT INTO {SEQUENCES} (name, id, high, servers, server_no) "
            "VALUES (?, ?, ?, ?, ?) ON CONFLICT(name) DO UPDATE SET "
            "id = max(id, high, excluded.id), high = max(id, high, excluded.id), "
            "servers = excluded.servers, server_no = excluded.server_no"
        )

    def create_ticket_sql(self, table: str) -> list[str]:
        return [
            f"CREATE TABLE IF NOT EXISTS {check_identifier(table)} "
            "(id INTEGER PRIMARY KEY AUTOINCREMENT, stub TEXT NOT NULL UNIQUE)"
        ]

    def ticket_seed_sql(self, table: str) -> str:
        t = check_identifier(table)
        return (
            f"INSERT OR IGNORE INTO {t} (id, stub) SELECT ?, 'a' "
            f"WHERE NOT EXISTS (SELECT 1 FROM {t})"
        )


_MYSQL_ENGINE = "ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin"


class MySQLSequenceSQL(SequenceSQL):
    native_ticket_step: ClassVar[bool] = True

    def create_sequences_sql(self) -> list[str]:
        return [
            f"CREATE TABLE IF NOT EXISTS {SEQUENCES} (name VARCHAR(64) NOT NULL PRIMARY KEY, "
            "id BIGINT UNSIGNED NOT NULL, high BIGINT UNSIGNED NOT NULL, "
            f"servers INT UNSIGNED NOT NULL, server_no INT UNSIGNED NOT NULL) {_MYSQL_ENGINE}"
        ]

    def reserve_sql(self) -> str:
        # `high = id` sees the new id: MariaDB/MySQL evaluate single-table UPDATE
        # assignments left to right (bagstore's sql_mode has no SIMULTANEOUS_ASSIGNMENT).
        return (
            f"UPDATE {SEQUENCES} SET id = LAST_INSERT_ID(GREATEST(id, high, %s) + %s), "
            "high = id WHERE name = %s AND servers = %s AND server_no = %s"
        )

    def reserve_params(
        self, name: str, floor: int, span: int, servers: int, server_no: int
    ) -> list[Any]:
        return [floor, span, name, servers, server_no]

    def reserved_top(self, cur: Any) -> int | None:
        # Every reservation changes the row, so "affected rows" is 1 when it matched.
        return int(cur.lastrowid) if cur.rowcount else None

    def advance_sql(self) -> str:
        return (
            f"INSERT INTO {SEQUENCES} (name, id, high, servers, server_no) "
            "VALUES (%s, %s, %s, %s, %s) ON DUPLICATE KEY UPDATE "
            "id = GREATEST(id, high, VALUES(id)), high = id, "
            "servers = VALUES(servers), server_no = VALUES(server_no)"
        )

    def create_ticket_sql(self, table: str) -> list[str]:
        return [
            f"CREATE TABLE IF NOT EXISTS {check_identifier(table)} "
            "(id BIGINT UNSIGNED NOT NULL AUTO_INCREMENT PRIMARY KEY, "
            f"stub CHAR(1) NOT NULL DEFAULT '', UNIQUE KEY stub (stub)) {_MYSQL_ENGINE}"
        ]

    def ticket_seed_sql(self, table: str) -> str:
        t = check_identifier(table)
        return (
            f"INSERT INTO {t} (id, stub) SELECT %s, 'a' FROM DUAL "
            f"WHERE NOT EXISTS (SELECT 1 FROM {t}) ON DUPLICATE KEY UPDATE {t}.stub = {t}.stub"
        )

    def ticket_session_sql(self, servers: int, server_no: int) -> str | None:
        return (
            f"SET SESSION auto_increment_increment = {int(servers)}, "
            f"auto_increment_offset = {int(server_no) + 1}"
        )


def _sql(backend: Backend) -> SequenceSQL:
    sql = getattr(backend.dialect, "sequences", None)
    if not isinstance(sql, SequenceSQL):
        raise ConfigurationError(f"{backend.name} ({backend.dialect.name}) cannot hold sequences")
    return sql


def ticket_table(name: str) -> str:
    """The ticket table of sequence ``name`` (``bagstore_tickets_<name>``)."""
    return check_identifier(TICKET_PREFIX + name, "ticket table name")


# -- block sequences -----------------------------------------------------------------


def ensure_sequences_table(backend: Backend) -> None:
    """Create ``bagstore_sequences`` when missing."""
    backend._executescript(_sql(backend).create_sequences_sql())


def reserve(
    backend: Backend, name: str, *, floor: int, span: int, servers: int, server_no: int
) -> int | None:
    """Reserve ``(base, base + span]`` with ``base = max(id, high, floor)`` in one
    statement; return the new top, or None if the row (with this ``servers`` /
    ``server_no``) does not exist."""
    sql = _sql(backend)
    text = sql.reserve_sql()
    params = sql.reserve_params(name, floor, span, servers, server_no)

    def work(conn: Any) -> int | None:
        cur = conn.cursor()
        try:
            cur.execute(text, params)
            return sql.reserved_top(cur)
        finally:
            cur.close()

    top = backend.run(work)
    if top is not None and (type(top) is not int or top - span < floor):
        raise BackendError(
            f"{backend.name}: sequence {name!r} reserved up to {top!r}, below its floor {floor}",
            shard=backend.name,
        )
    return top


def create_sequence_row(
    backend: Backend, name: str, *, value: int, servers: int, server_no: int
) -> None:
    """Insert the row of a new sequence (``id = high = value``) unless it exists."""
    backend.insert_ignore(SEQUENCES, _COLUMNS, [(name, value, value, servers, server_no)])


def advance_sequence_row(
    backend: Backend, name: str, *, value: int, servers: int, server_no: int
) -> None:
    """Make the row hold at least ``value`` (never lower it) and belong to
    server ``server_no`` of ``servers``: one statement."""
    backend.execute(_sql(backend).advance_sql(), [name, value, value, servers, server_no])


def sequence_row(backend: Backend, name: str) -> SequenceRow | None:
    rows = backend.select_all(SEQUENCES, _COLUMNS, {"name": name})
    return _row(rows[0]) if rows else None


def sequence_rows(backend: Backend) -> list[SequenceRow]:
    """Every sequence stored on this server, by name."""
    return sorted(_row(r) for r in backend.select_all(SEQUENCES, _COLUMNS))


def _row(r: Sequence[Any]) -> SequenceRow:
    return SequenceRow(str(r[0]), int(r[1]), int(r[2]), int(r[3]), int(r[4]))


# -- ticket tables --------------------------------------------------------------------


def ensure_ticket_table(
    backend: Backend, table: str, *, start: int, servers: int, server_no: int
) -> None:
    """Create the ticket table when missing; a new (or empty) one hands out ids
    from ``start``."""
    sql = _sql(backend)
    backend._executescript(sql.create_ticket_sql(table))
    seed = sql.ticket_seed(start, servers, server_no)
    if seed > 0:
        backend.execute(sql.ticket_seed_sql(table), [seed])


#: Connections whose session already steps tickets as (servers, server_no).
_sessions: weakref.WeakKeyDictionary[Any, tuple[int, int]] = weakref.WeakKeyDictionary()
_sessions_lock = threading.Lock()


def _session_is(conn: Any, wanted: tuple[int, int]) -> bool:
    try:
        with _sessions_lock:
            return _sessions.get(conn) == wanted
    except TypeError:  # a driver whose connections take no weak reference
        return False


def _remember_session(conn: Any, wanted: tuple[int, int]) -> None:
    with _sessions_lock, contextlib.suppress(TypeError):
        _sessions[conn] = wanted


def next_ticket(backend: Backend, table: str, *, servers: int, server_no: int) -> int:
    """One ticket: one ``REPLACE INTO`` (plus, once per connection with several
    servers on MariaDB, the session's increment and offset)."""
    sql = _sql(backend)
    text = sql.ticket_sql(table)
    session = sql.ticket_session_sql(servers, server_no) if servers > 1 else None
    wanted = (servers, server_no)

    def work(conn: Any) -> int:
        cur = conn.cursor()
        try:
            if session is not None and not _session_is(conn, wanted):
                cur.execute(session)
                _remember_session(conn, wanted)
            cur.execute(text)
            return int(cur.lastrowid)
        finally:
            cur.close()

    ticket = backend.run(work)
    if ticket < 1:
        raise BackendError(
            f"{backend.name}: ticket table {table} gave {ticket}", shard=backend.name
        )
    return ticket if sql.native_ticket_step else (ticket - 1) * servers + server_no + 1
