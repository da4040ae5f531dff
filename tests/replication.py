"""Replication groups of private MariaDB servers for the replica and failover tests.

A :class:`ReplicationGroup` starts ``n`` ``mariadbd --no-defaults`` servers
(:class:`tests.servers.MariaDBServer`: own ports, data directories on
``/dev/shm`` when it exists) with binary logs and GTIDs, makes the first the
primary and points the others at it (``CHANGE MASTER TO ... MASTER_USE_GTID=
slave_pos``).  Durability is traded for speed as a SIGKILL of mariadbd (not a
power cut) allows: ``sync_binlog=0``, ``innodb_flush_log_at_trx_commit=2``.
Semi-synchronous replication is built into MariaDB >= 10.3: every server may
be a semi-sync replica, and :meth:`ReplicationGroup.semi_sync` turns the
primary's side on or off.

Positions are compared by polling with ``MASTER_GTID_WAIT``, never by sleeping.
Servers are stopped by pid; :func:`paused` sends SIGSTOP only to a server the
test started, and SIGCONT in a ``finally``.

The group also makes a non-privileged application user (:data:`APP_USER`: all
privileges on the test databases, none global, so ``read_only`` applies to it)
for the fencing tests.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pymysql

from tests import servers

#: The application's own login: rights on ``bst_*`` databases only (no SUPER,
#: no READ_ONLY ADMIN), so a server's ``read_only`` refuses its writes.
APP_USER = "bsapp"
APP_PASSWORD = "bsapp-pw"
#: The login replicas use to reach their primary.
REPL_USER = "bsrepl"
REPL_PASSWORD = "bsrepl-pw"


class ReplicatedServer(servers.MariaDBServer):
    """A private MariaDB server with binary logs and GTIDs, ready to be a
    primary or a (semi-synchronous) replica."""

    name = "mariadb-repl"
    tmp_root = "/dev/shm" if os.path.isdir("/dev/shm") else None

    def __init__(self, server_id: int, extra_options: Sequence[str] = ()) -> None:
        super().__init__(
            extra_options=(
                f"--server-id={server_id}",
                "--log-bin=mysql-bin",
                "--log-slave-updates",
                "--binlog-format=ROW",
                "--sync-binlog=0",
                "--skip-slave-start",
                "--rpl-semi-sync-slave-enabled=ON",
                "--slave-net-timeout=5",
                *extra_options,
            )
        )
        self.server_id = server_id

    @property
    def addr(self) -> str:
        return f"{self.host}:{self.port}"

    def sql(self, statement: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """Run one statement as root; its rows."""
        conn = self.connect()
        try:
            with conn.cursor() as cur:
                cur.execute(statement, params)
                return list(cur.fetchall())
        finally:
            conn.close()

    def one(self, statement: str, params: Sequence[Any] = ()) -> Any:
        rows = self.sql(statement, params)
        return rows[0][0] if rows else None

    def gtid(self) -> str:
        """Where this server's binary log is (``@@gtid_binlog_pos``)."""
        return str(self.one("SELECT @@gtid_binlog_pos"))

    def wait_for(self, gtid: str, timeout: float = 30.0) -> None:
        """Wait until this replica has applied ``gtid`` (``MASTER_GTID_WAIT``)."""
        if not gtid:
            return
        result = self.one("SELECT MASTER_GTID_WAIT(%s, %s)", (gtid, timeout))
        if result != 0:
            raise AssertionError(f"{self.addr} did not reach {gtid} within {timeout} s")

    def replicate_from(self, primary: ReplicatedServer) -> None:
        """Point this server at ``primary`` (GTID, from its own slave position)."""
        self.sql("STOP SLAVE")
        self.sql(
            "CHANGE MASTER TO MASTER_HOST=%s, MASTER_PORT=%s, MASTER_USER=%s, "
            "MASTER_PASSWORD=%s, MASTER_USE_GTID=slave_pos, MASTER_CONNECT_RETRY=1",
            (primary.host, primary.port, REPL_USER, REPL_PASSWORD),
        )
        self.sql("START SLAVE")


class ReplicationGroup:
    """``n`` servers: ``servers[0]`` the primary, the others its replicas."""

    def __init__(self, n: int = 3) -> None:
        self.servers = [ReplicatedServer(server_id=i + 1) for i in range(n)]

    @property
    def primary(self) -> ReplicatedServer:
        return self.servers[0]

    @property
    def replicas(self) -> list[ReplicatedServer]:
        return self.servers[1:]

    def start(self) -> ReplicationGroup:
        """Start the servers (from the main thread: see tests/servers.py) and
        set up replication; the replicas read_only."""
        for server in self.servers:
            server.start()
        for server in self.servers:
            # The same users on every server, written outside the binary log:
            # each server can be promoted and each can be a replica.
            server.sql("SET sql_log_bin = 0")
            for statement in _users():
                _run_unlogged(server, statement)
        for replica in self.replicas:
            replica.sql("SET GLOBAL read_only = ON")
            replica.replicate_from(self.primary)
        self.sync()
        return self

    def stop(self) -> None:
        for server in self.servers:
            with contextlib.suppress(Exception):
                resume(server)
            server.stop()

    def url(self, database: str, *, user: str = "root", password: str = "") -> str:
        """A shard URL naming the primary and, as ``replica=``, the others."""
        login = f"{user}:{password}" if password else user
        replicas = "&".join(f"replica={r.addr}" for r in self.replicas)
        return f"mysql://{login}@{self.primary.addr}/{database}" + (
            f"?{replicas}" if replicas else ""
        )

    def sync(self, timeout: float = 30.0) -> None:
        """Wait until every running replica has applied the primary's position."""
        gtid = self.primary.gtid()
        for replica in self.replicas:
            if replica.running:
                replica.wait_for(gtid, timeout)

    def semi_sync(self, on: bool, timeout_ms: int = 10_000) -> None:
        """Turn the primary's semi-synchronous side on (AFTER_SYNC) or off."""
        p = self.primary
        if on:
            p.sql("SET GLOBAL rpl_semi_sync_master_wait_point = 'AFTER_SYNC'")
            p.sql(f"SET GLOBAL rpl_semi_sync_master_timeout = {int(timeout_ms)}")
        p.sql(f"SET GLOBAL rpl_semi_sync_master_enabled = {'ON' if on else 'OFF'}")
        for replica in self.replicas:
            if replica.running:  # the IO thread announces semi-sync when it connects
                replica.sql("STOP SLAVE IO_THREAD")
                replica.sql("START SLAVE IO_THREAD")
        if on:
            deadline = time.monotonic() + 10
            while (
                int(
                    p.one(
                        "SELECT variable_value FROM information_schema.global_status "
                        "WHERE variable_name = 'Rpl_semi_sync_master_clients'"
                    )
                    or 0
                )
                < 1
            ):
                if time.monotonic() > deadline:
                    raise AssertionError("no semi-sync replica connected")
                time.sleep(0.02)

    def drop(self, databases: Sequence[str]) -> None:
        """Drop test databases on the primary (replicated to the others)."""
        for name in databases:
            self.primary.sql(f"DROP DATABASE IF EXISTS {servers.quote_ident(name)}")


def _users() -> list[str]:
    return [
        f"CREATE USER IF NOT EXISTS '{REPL_USER}'@'127.0.0.1' IDENTIFIED BY '{REPL_PASSWORD}'",
        f"GRANT REPLICATION SLAVE ON *.* TO '{REPL_USER}'@'127.0.0.1'",
        f"CREATE USER IF NOT EXISTS '{APP_USER}'@'127.0.0.1' IDENTIFIED BY '{APP_PASSWORD}'",
        f"GRANT ALL PRIVILEGES ON `bst\\_%`.* TO '{APP_USER}'@'127.0.0.1'",
        # SHOW SLAVE STATUS, for max_lag: no power over the servers
        f"GRANT SLAVE MONITOR ON *.* TO '{APP_USER}'@'127.0.0.1'",
    ]


def _run_unlogged(server: ReplicatedServer, statement: str) -> None:
    conn = server.connect()
    try:
        with conn.cursor() as cur:
            cur.execute("SET sql_log_bin = 0")
            cur.execute(statement)
    finally:
        conn.close()


@contextlib.contextmanager
def paused(server: servers.MariaDBServer) -> Iterator[None]:
    """SIGSTOP a server this test started (and SIGCONT it however the block ends)."""
    pid = server.pid
    if pid is None:
        raise AssertionError(f"{server!r} is not running")
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        resume(server)


def resume(server: servers.MariaDBServer) -> None:
    pid = server.pid
    if pid is not None:
        os.kill(pid, signal.SIGCONT)


def connect_as_app(server: servers.MariaDBServer, database: str | None = None) -> Any:
    """A connection as the non-privileged application user."""
    return pymysql.connect(
        host=server.host,
        port=server.port,
        user=APP_USER,
        password=APP_PASSWORD,
        database=database,
        autocommit=True,
        connect_timeout=servers.CONNECT_TIMEOUT_S,
    )


@contextlib.contextmanager
def started_group(n: int = 3) -> Iterator[ReplicationGroup]:
    """A started group (a test skips, or fails in CI, when servers cannot
    start), stopped by pid at the end."""
    import pytest

    group = ReplicationGroup(n)
    try:
        group.start()
    except servers.ServerUnavailable as exc:
        group.stop()
        if servers.in_ci():
            pytest.fail(f"CI requires this server: {exc}")
        pytest.skip(str(exc))
    try:
        yield group
    finally:
        group.stop()


class CrossedPair:
    """Yupoo's pair: two servers replicating each other (master-master), each
    in its own GTID domain, ``auto_increment_increment=2`` with offsets 1 and 2
    so that rows inserted on either side never take the same ``added_id``.
    Logical shards are active on alternating sides (``url(db, side)``)."""

    def __init__(self) -> None:
        self.servers = [
            ReplicatedServer(
                server_id=k,
                extra_options=(
                    f"--gtid-domain-id={k}",
                    "--auto-increment-increment=2",
                    f"--auto-increment-offset={k}",
                ),
            )
            for k in (1, 2)
        ]

    def start(self) -> CrossedPair:
        for server in self.servers:
            server.start()
        for server in self.servers:
            for statement in _users():
                _run_unlogged(server, statement)
        a, b = self.servers
        a.replicate_from(b)
        b.replicate_from(a)
        self.sync()
        return self

    def stop(self) -> None:
        for server in self.servers:
            server.stop()

    def url(self, database: str, side: int) -> str:
        """A shard active on ``servers[side]``, the other side its replica."""
        active, other = self.servers[side], self.servers[1 - side]
        return f"mysql://root@{active.addr}/{database}?replica={other.addr}"

    def sync(self, timeout: float = 30.0) -> None:
        """Each side has applied everything the other wrote."""
        a, b = self.servers
        for _ in range(2):  # (what one applied is then in its log for the other)
            b.wait_for(a.gtid(), timeout)
            a.wait_for(b.gtid(), timeout)

    def replicating(self) -> bool:
        return all(s.sql("SHOW SLAVE STATUS") and _both_running(s) for s in self.servers)


def _both_running(server: ReplicatedServer) -> bool:
    conn = server.connect()
    try:
        with conn.cursor(pymysql.cursors.DictCursor) as cur:
            cur.execute("SHOW SLAVE STATUS")
            row = cur.fetchone()
    finally:
        conn.close()
    return bool(row) and row["Slave_IO_Running"] == "Yes" and row["Slave_SQL_Running"] == "Yes"


@contextlib.contextmanager
def started_pair() -> Iterator[CrossedPair]:
    """A started crossed pair (skipped, or failed in CI, when it cannot start)."""
    import pytest

    pair = CrossedPair()
    try:
        pair.start()
    except servers.ServerUnavailable as exc:
        pair.stop()
        if servers.in_ci():
            pytest.fail(f"CI requires this server: {exc}")
        pytest.skip(str(exc))
    try:
        yield pair
    finally:
        pair.stop()
