"""MariaDB replication statements: roles, GTID positions, promotion, repointing.

Every statement about replication that bagstore sends lives here (the
decisions, which server to promote or read, are the router's:
:mod:`bagstore.sharding.replicas` and :mod:`bagstore.sharding.failover`).
They run on MariaDB's own GTID replication; bagstore never copies rows.

A shard's **role row** (``bagstore_role``, one row, in the shard's own
database) records the epoch of its last failover and its servers as JSON; it
is written on the primary and replicates to every replica, so any server of a
shard can say what it last heard.  A revived old primary still holds an older
epoch: whoever reads every server trusts only the highest.

Administrative statements (``read_only``, ``CHANGE MASTER``, ``KILL``) need a
login with those privileges (root, or one granted SUPER / REPLICA ADMIN); the
application's own login should have none (docs/replication.md).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bagstore.backends.mysql import MySQLBackend
from bagstore.backends.mysqlerrors import LOCK_WAIT_TIMEOUT, NO_SUCH_TABLE, UNKNOWN_DATABASE
from bagstore.errors import BackendError, ConfigurationError

__all__ = [
    "Role",
    "ServerState",
    "Servers",
    "ahead",
    "gtid_wait",
    "replica_lag",
    "seqs",
    "show_slave_status",
]

log = logging.getLogger(__name__)

#: How long ``SET GLOBAL read_only = ON`` may wait for the server's global
#: read lock (seconds) before the client connections in its way are closed,
#: and how many times it is tried.  The lock waits for every statement that
#: writes and every commit under way; a commit inside a stored routine (a
#: one-entity put) can wait on the lock's request in turn, a wait MariaDB's
#: deadlock detector does not see, so without a bound a switchover can hang.
READ_ONLY_WAIT = 2
READ_ONLY_TRIES = 5
_ROLE_TABLE = (
    "CREATE TABLE IF NOT EXISTS bagstore_role (one INT NOT NULL PRIMARY KEY, "
    "epoch BIGINT NOT NULL, servers TEXT NOT NULL) ENGINE=InnoDB"
)


@dataclass(frozen=True)
class Role:
    """Where a shard's primary is, as of ``epoch``: its primary, its replicas,
    and the old primaries refused since (``retired``).

    >>> role = Role(3, "db1r:3306", ("db1s:3306", "db1:3306"))
    >>> Role.from_json(3, role.to_json()) == role, role.servers[0]
    (True, 'db1r:3306')
    """

    epoch: int
    primary: str
    replicas: tuple[str, ...] = ()
    retired: tuple[str, ...] = ()

    def to_json(self) -> str:
        return json.dumps(
            {"primary": self.primary, "replicas": list(self.replicas),
             "retired": list(self.retired)}, sort_keys=True
        )  # fmt: skip

    @classmethod
    def from_json(cls, epoch: int, text: str) -> Role:
        data = json.loads(text)
        return cls(
            int(epoch),
            str(data["primary"]),
            tuple(str(r) for r in data.get("replicas", ())),
            tuple(str(r) for r in data.get("retired", ())),
        )

    @property
    def servers(self) -> tuple[str, ...]:
        return (self.primary, *self.replicas)


@dataclass
class ServerState:
    """What one server says about itself (``bagstore status``)."""

    address: str
    reachable: bool
    read_only: bool = False
    role: Role | None = None
    #: ``@@gtid_binlog_pos`` (what it wrote or applied and logged) and
    #: ``@@gtid_slave_pos`` (what it applied as a replica)
    binlog_pos: str = ""
    slave_pos: str = ""
    replicating_from: str | None = None
    io_running: bool = False
    sql_running: bool = False
    lag: int | None = None
    received_pos: str = ""
    semi_sync: dict[str, Any] = field(default_factory=dict)
    error: str = ""


class Servers:
    """Administrative statements on the servers of one shard, each reached as
    ``backend`` (a shard's backend: its database and login) on another address.
    Connections are opened per call and closed (failovers are rare)."""

    def __init__(
        self,
        backend: MySQLBackend,
        *,
        user: str | None = None,
        password: str | None = None,
        quick: bool = False,
    ) -> None:
        self.backend = backend
        self.user = user
        self.password = password
        #: short timeouts: a look at every server must not hang on one
        self._quick = {"connect_timeout": 1.0, "read_timeout": 2.0} if quick else {}

    def at(self, address: str) -> MySQLBackend:
        return self.backend.sibling(address, user=self.user, password=self.password, **self._quick)

    def _run(self, address: str, statements: Sequence[tuple[str, Sequence[Any]]]) -> list[Any]:
        """Run statements on one server (one connection); the last one's rows."""
        b = self.at(address)
        try:

            def work(conn: Any) -> list[Any]:
                cur = conn.cursor()
                rows: list[Any] = []
                try:
                    for sql, params in statements:
                        cur.execute(sql, params)
                        rows = list(cur.fetchall()) if cur.description else []
                finally:
                    cur.close()
                return rows

            return b.run(work, attempts=1)
        finally:
            b.close()

    # -- what servers say ------------------------------------------------------------
    def role(self, address: str) -> tuple[Role | None, bool]:
        """The role row ``address`` holds (None: none yet) and its ``read_only``."""
        b = self.at(address)
        try:

            def work(conn: Any) -> tuple[Role | None, bool]:
                cur = conn.cursor()
                try:
                    cur.execute("SELECT @@global.read_only")
                    read_only = bool(int(cur.fetchone()[0]))
                    try:
                        cur.execute("SELECT epoch, servers FROM bagstore_role WHERE one = 1")
                    except b.driver_errors as exc:
                        if b._code(exc) == NO_SUCH_TABLE:
                            return None, read_only
                        raise
                    row = cur.fetchone()
                finally:
                    cur.close()
                return (Role.from_json(row[0], _text(row[1])) if row else None), read_only

            try:
                return b.run(work, attempts=1)
            except BackendError as exc:
                if b._code(exc.__cause__) != UNKNOWN_DATABASE:
                    raise
            # a new store: no role yet; only whether the server is read-only
            other = self.backend.sibling(
                address,
                user=self.user,
                password=self.password,
                database="information_schema",
                **self._quick,
            )
            try:
                rows = other.fetchall("SELECT @@global.read_only")
            finally:
                other.close()
            return None, bool(int(rows[0][0]))
        finally:
            b.close()

    def state(self, address: str) -> ServerState:
        """Everything ``bagstore status`` shows of one server; never raises."""
        try:
            role, read_only = self.role(address)
            rows = self._run(
                address,
                [("SELECT @@gtid_binlog_pos, @@gtid_slave_pos", ())],
            )
            state = ServerState(address, True, read_only, role, _text(rows[0][0]),
                                _text(rows[0][1]))  # fmt: skip
            slave = self.slave_status(address)
            if slave:
                state.replicating_from = f"{slave['Master_Host']}:{slave['Master_Port']}"
                state.io_running = slave["Slave_IO_Running"] == "Yes"
                state.sql_running = slave["Slave_SQL_Running"] == "Yes"
                lag = slave.get("Seconds_Behind_Master")
                state.lag = None if lag is None else int(lag)
                state.received_pos = _text(slave.get("Gtid_IO_Pos", ""))
            state.semi_sync = self.semi_sync(address)
            return state
        except BackendError as exc:
            return ServerState(address, False, error=str(exc))

    def slave_status(self, address: str) -> dict[str, Any]:
        """``SHOW SLAVE STATUS`` as a dict ({} when not a replica)."""
        b = self.at(address)
        try:
            return show_slave_status(b, attempts=1)
        finally:
            b.close()

    def semi_sync(self, address: str) -> dict[str, Any]:
        """The primary side of semi-synchronous replication: ``enabled`` (the
        setting), ``active`` (False while it has fallen back to asynchronous
        replication), ``clients``, ``wait_point``, ``no_tx`` (commits not
        acknowledged by any replica)."""
        rows = self._run(
            address,
            [(
                "SELECT variable_name, variable_value FROM information_schema.global_status "
                "WHERE variable_name IN ('RPL_SEMI_SYNC_MASTER_STATUS', "
                "'RPL_SEMI_SYNC_MASTER_CLIENTS', 'RPL_SEMI_SYNC_MASTER_NO_TX') UNION ALL "
                "SELECT variable_name, variable_value FROM information_schema.global_variables "
                "WHERE variable_name IN ('RPL_SEMI_SYNC_MASTER_ENABLED', "
                "'RPL_SEMI_SYNC_MASTER_WAIT_POINT')", ()
            )],
        )  # fmt: skip
        got = {_text(k).lower(): _text(v) for k, v in rows}
        return {
            "enabled": got.get("rpl_semi_sync_master_enabled", "OFF") == "ON",
            "active": got.get("rpl_semi_sync_master_status", "OFF") == "ON",
            "clients": int(got.get("rpl_semi_sync_master_clients", "0") or 0),
            "wait_point": got.get("rpl_semi_sync_master_wait_point", ""),
            "no_tx": int(got.get("rpl_semi_sync_master_no_tx", "0") or 0),
        }

    def gtid_wait(self, address: str, position: str, timeout: float) -> bool:
        """Whether ``address`` applied ``position`` within ``timeout`` seconds."""
        if not position:
            return True
        rows = self._run(address, [("SELECT MASTER_GTID_WAIT(%s, %s)", (position, timeout))])
        return bool(rows[0][0] == 0)

    def binlog_pos(self, address: str) -> str:
        return _text(self._run(address, [("SELECT @@gtid_binlog_pos", ())])[0][0])

    # -- changing roles --------------------------------------------------------------
    def fence(self, address: str, role: Role) -> str:
        """On the old primary of a planned switchover: ``read_only=ON``, the new
        role row written (it replicates to every replica, the target first
        among them), every client connection but replication's killed; the
        position the target must reach."""
        self.read_only(address, [(_ROLE_TABLE, ()), *self._role_write(role)])
        self.kill_clients(address)
        return self.binlog_pos(address)

    def read_only(self, address: str, then: Sequence[tuple[str, Sequence[Any]]] = ()) -> list[Any]:
        """``read_only=ON`` on ``address``, then the statements ``then`` on the
        same connection (their last one's rows).  The global read lock it takes
        is waited for at most :data:`READ_ONLY_WAIT` seconds; then every client
        connection is closed (their transactions roll back; a write whose
        connection dropped is run again, which finds the new primary) and it
        is tried again, :data:`READ_ONLY_TRIES` times in all."""
        statements = [
            ("SET SESSION lock_wait_timeout = %s", (READ_ONLY_WAIT,)),
            ("SET GLOBAL read_only = ON", ()),
            ("SET SESSION lock_wait_timeout = DEFAULT", ()),
            *then,
        ]
        for attempt in range(1, READ_ONLY_TRIES + 1):
            try:
                return self._run(address, statements)
            except BackendError as exc:
                if self.backend._code(exc.__cause__) != LOCK_WAIT_TIMEOUT:
                    raise
                if attempt == READ_ONLY_TRIES:
                    raise BackendError(
                        f"{address}: read_only could not be set: its global read lock "
                        f"waited {READ_ONLY_WAIT} s {READ_ONLY_TRIES} times, with the "
                        "client connections closed between the tries (a statement of "
                        "another administrator's login? see information_schema.processlist)"
                    ) from exc
            closed = self.kill_clients(address)
            log.warning(
                "%s: read_only waited %d s for the global read lock (a write or commit "
                "under way); %d client connection(s) closed, trying again",
                address, READ_ONLY_WAIT, closed,
            )  # fmt: skip
        raise AssertionError("unreachable")

    def fence_database(self, address: str, role: Role) -> str:
        """The same for one database of a server that stays writable for
        others (one side of a crossed master-master pair): the new role row,
        then the connections using this database closed; new ones read the
        role row and go to the new side."""
        self._run(address, [(_ROLE_TABLE, ()), *self._role_write(role)])
        self.kill_clients(address, self.backend.database)
        return self.binlog_pos(address)

    def kill_clients(self, address: str, database: str | None = None) -> int:
        """Close every client connection of ``address`` (of ``database`` only,
        if given) except replication's and this one: their next statement
        finds where the primary is now."""
        rows = self._run(
            address,
            [(
                "SELECT id FROM information_schema.processlist WHERE id <> CONNECTION_ID() "
                "AND command NOT IN ('Binlog Dump', 'Daemon', 'Slave_IO', 'Slave_SQL', "
                "'Slave_worker') AND user NOT IN ('system user', 'event_scheduler') "
                "AND (%s IS NULL OR db = %s)", (database, database)
            )],
        )  # fmt: skip
        killed = 0
        for (pid,) in rows:
            try:
                self._run(address, [(f"KILL CONNECTION {int(pid)}", ())])
                killed += 1
            except BackendError:  # ended meanwhile
                pass
        return killed

    def source_of(self, address: str) -> str | None:
        """The ``host:port`` that ``address`` replicates from (None: none)."""
        slave = self.slave_status(address)
        if not slave:
            return None
        return f"{slave['Master_Host']}:{slave['Master_Port']}"

    def stop_io(self, address: str) -> None:
        self._run(address, [("STOP SLAVE IO_THREAD", ())])

    def promote(self, address: str, role: Role) -> None:
        """Make ``address`` a primary: replication stopped and forgotten,
        writable, the new role row written (in its binary log: replicas that
        follow it get it)."""
        self._run(
            address,
            [
                ("STOP SLAVE", ()),
                ("RESET SLAVE ALL", ()),
                (_ROLE_TABLE, ()),
                *self._role_write(role),
                ("SET GLOBAL read_only = OFF", ()),
            ],
        )

    def point_at(self, address: str, primary: str, user: str, password: str, *,
                 was_primary: bool = False) -> None:  # fmt: skip
        """Make ``address`` a read-only replica of ``primary`` (GTID, from its
        slave position; an old primary's own transactions count as applied)."""
        host, _, port = primary.rpartition(":")
        statements: list[tuple[str, Sequence[Any]]] = [("STOP SLAVE", ())]
        if was_primary:
            statements.append(("SET GLOBAL gtid_slave_pos = @@gtid_binlog_pos", ()))
        statements += [
            (
                "CHANGE MASTER TO MASTER_HOST = %s, MASTER_PORT = %s, MASTER_USER = %s, "
                "MASTER_PASSWORD = %s, MASTER_USE_GTID = slave_pos, MASTER_CONNECT_RETRY = 1",
                (host, int(port), user, password),
            ),
            ("START SLAVE", ()),
        ]
        self.read_only(address, statements)

    def write_role(self, address: str, role: Role) -> None:
        self._run(address, [(_ROLE_TABLE, ()), *self._role_write(role)])

    @staticmethod
    def _role_write(role: Role) -> list[tuple[str, Sequence[Any]]]:
        return [(
            "INSERT INTO bagstore_role (one, epoch, servers) VALUES (1, %s, %s) "
            "ON DUPLICATE KEY UPDATE epoch = VALUES(epoch), servers = VALUES(servers)",
            (role.epoch, role.to_json()),
        )]  # fmt: skip

    def wait_applied(self, address: str, timeout: float) -> str:
        """On a replica whose IO thread is stopped: wait until it applied all
        it received; its applied position (``@@gtid_slave_pos``)."""
        slave = self.slave_status(address)
        received = _text(slave.get("Gtid_IO_Pos", "")) if slave else ""
        if received and not self.gtid_wait(address, received, timeout):
            raise ConfigurationError(
                f"{address} did not apply what it received ({received}) within {timeout:g} s"
            )
        return _text(self._run(address, [("SELECT @@gtid_slave_pos", ())])[0][0])


def gtid_wait(replica: MySQLBackend, position: str, timeout: float) -> bool:
    """Whether ``replica`` applied ``position`` within ``timeout`` seconds (a
    replica read that must show this process's writes)."""
    rows = replica.fetchall("SELECT MASTER_GTID_WAIT(%s, %s)", (position, timeout))
    return bool(rows[0][0] == 0)


def replica_lag(replica: MySQLBackend) -> float | None:
    """``Seconds_Behind_Master`` of a replica (None: not replicating, its SQL
    thread stopped or its primary unreachable); needs SLAVE MONITOR."""

    lag = show_slave_status(replica).get("Seconds_Behind_Master")
    return None if lag is None else float(lag)


def show_slave_status(server: MySQLBackend, attempts: int = 5) -> dict[str, Any]:
    """``SHOW SLAVE STATUS`` of ``server`` as a dict of plain values ({} when
    it is not a replica)."""

    def work(conn: Any) -> dict[str, Any]:
        cur = conn.cursor()
        try:
            cur.execute("SHOW SLAVE STATUS")
            row = cur.fetchone()
            names = [d[0] for d in cur.description or ()]
        finally:
            cur.close()
        return {} if row is None else {n: _plain(v) for n, v in zip(names, row, strict=True)}

    return server.run(work, attempts=attempts)


def ahead(a: str, b: str) -> bool:
    """Whether GTID position ``a`` is past ``b`` (per replication domain,
    the highest sequence number; a domain missing counts as 0).

    >>> ahead("0-1-12", "0-2-9"), ahead("0-1-9", "0-1-9"), ahead("0-1-9,1-2-3", "0-1-9")
    (True, False, True)
    """
    pa, pb = seqs(a), seqs(b)
    domains = set(pa) | set(pb)
    return any(pa.get(d, 0) > pb.get(d, 0) for d in domains) and all(
        pa.get(d, 0) >= pb.get(d, 0) for d in domains
    )


def seqs(position: str) -> dict[str, int]:
    """``{domain: seq_no}`` of a GTID position.

    >>> seqs("0-1-5,1-2-9")
    {'0': 5, '1': 9}
    """
    out: dict[str, int] = {}
    for gtid in filter(None, (p.strip() for p in position.split(","))):
        domain, _, rest = gtid.partition("-")
        out[domain] = max(out.get(domain, 0), int(rest.rpartition("-")[2] or 0))
    return out


def _text(value: Any) -> str:
    if isinstance(value, bytes | bytearray):
        return value.decode()
    return "" if value is None else str(value)


def _plain(value: Any) -> Any:
    return value.decode() if isinstance(value, bytes | bytearray) else value
