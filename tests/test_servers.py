"""Tests of tests/servers.py against real servers (extra ones are started here)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pymysql
import pytest

from tests import servers

# Each extra MariaDB must accept connections within this (0.3-0.5 s here, plus
# 0.6-3.7 s for mariadb-install-db the first time in a process), and the whole
# lifecycle test (two servers, a crash, two restarts) within twice this.
MARIADB_START_TIMEOUT_S = 10.0


def require(reason: str | None) -> None:
    """Skip the test when ``reason`` is set, or fail it in CI, where servers are required."""
    if reason is None:
        return
    if servers.in_ci():
        pytest.fail(f"{reason} (CI is set: this server is required)")
    pytest.skip(reason)


def require_binary(name: str, package: str) -> None:
    if servers.find_binary(name) is None:
        require(f"{name} is not installed (apt-get install {package})")


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def memcached_command(addr: str, command: bytes) -> bytes:
    host, port = servers.parse_hostport(addr, 11211)
    with socket.create_connection((host, port), timeout=2) as sock:
        sock.sendall(command)
        reply = b""
        while not reply.endswith((b"END\r\n", b"STORED\r\n", b"ERROR\r\n")):
            chunk = sock.recv(4096)
            if not chunk:
                break
            reply += chunk
    return reply


# ---------------------------------------------------------------------------
# Pure helpers


def test_unique_name_is_a_unique_valid_identifier() -> None:
    names = {servers.unique_name("Entity_Store") for _ in range(1000)}
    assert len(names) == 1000
    for name in names:
        assert name.startswith("bst_entity_store_")
        servers.quote_ident(name)  # valid identifier
    long = servers.unique_name("x" * 200)
    assert len(long) <= 64
    servers.quote_ident(long)
    assert servers.unique_name("").startswith("bst_")
    with pytest.raises(ValueError):
        servers.unique_name("no-dashes")


@pytest.mark.parametrize(
    "name", ["", "1abc", "a-b", "a`b", "a b", "x" * 65, "db; DROP DATABASE mysql"]
)
def test_quote_ident_rejects_unsafe_names(name: str) -> None:
    with pytest.raises(ValueError):
        servers.quote_ident(name)


def test_quote_ident_backquotes() -> None:
    assert servers.quote_ident("bst_a_1") == "`bst_a_1`"


@pytest.mark.parametrize(
    ("value", "expected"),
    [("true", True), ("1", True), ("TRUE", True), ("", False), ("false", False), ("0", False)],
)
def test_in_ci(monkeypatch: pytest.MonkeyPatch, value: str, expected: bool) -> None:
    monkeypatch.setenv("CI", value)
    assert servers.in_ci() is expected


def test_in_ci_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    assert servers.in_ci() is False


def test_parse_urls() -> None:
    assert servers.parse_mysql_url("mysql://root@127.0.0.1:3306") == (
        "127.0.0.1",
        3306,
        "root",
        "",
    )
    assert servers.parse_mysql_url("mysql://u:p%40ss@db:3307") == ("db", 3307, "u", "p@ss")
    assert servers.parse_hostport("127.0.0.1:11211", 1) == ("127.0.0.1", 11211)
    assert servers.parse_hostport("localhost", 11211) == ("localhost", 11211)


def test_closed_ports_give_reasons() -> None:
    port = servers.free_port()
    started = time.monotonic()
    assert "not reachable" in (servers.mysql_reachable("127.0.0.1", port) or "")
    assert "not reachable" in (servers.memcached_reachable(f"127.0.0.1:{port}") or "")
    pytest.importorskip("redis")
    assert "not reachable" in (servers.redis_reachable(f"redis://127.0.0.1:{port}/0") or "")
    assert time.monotonic() - started < 10


def test_stale_workdirs_of_dead_processes_are_removed(monkeypatch: pytest.MonkeyPatch) -> None:
    tmp = Path(tempfile.gettempdir())
    dead = tmp / f"bst-mariadb-{dead_pid()}-abc123"
    alive = tmp / f"bst-memcached-{os.getppid()}-abc123"
    other = tmp / "bst-not-ours"
    for path in (dead, alive, other):
        path.mkdir()
    try:
        monkeypatch.setattr(servers, "_stale_workdirs_removed", False)
        servers._remove_stale_workdirs()
        assert not dead.exists()
        assert alive.exists()
        assert other.exists()
    finally:
        for path in (dead, alive, other):
            if path.exists():
                path.rmdir()


# ---------------------------------------------------------------------------
# The standard servers


@pytest.mark.parametrize("kind", ["mysql", "redis", "memcached"])
def test_standard_server_is_reachable(kind: str) -> None:
    if kind == "mysql":
        reason = servers.mysql_reachable(*servers.parse_mysql_url(servers.MYSQL_URL))
    elif kind == "redis":
        reason = servers.redis_reachable(servers.REDIS_URL)
    else:
        reason = servers.memcached_reachable(servers.MEMCACHED_ADDR)
    require(reason)


@pytest.mark.mysql
def test_create_and_drop_databases_on_the_standard_server() -> None:
    host, port, user, password = servers.parse_mysql_url(servers.MYSQL_URL)
    require(servers.mysql_reachable(host, port, user, password))
    names = [servers.unique_name("servers_test"), servers.unique_name("servers_test")]
    servers.create_databases(host, port, names, user, password)
    try:
        conn = servers._connect(host, port, user, password)
        try:
            with conn.cursor() as cur:
                cur.execute("SHOW DATABASES LIKE %s", ("bst\\_servers\\_test\\_%",))
                found = {row[0] for row in cur.fetchall()}
        finally:
            conn.close()
        assert set(names) <= found
    finally:
        servers.drop_databases(host, port, names, user, password)
    servers.drop_databases(host, port, names, user, password)  # IF EXISTS: no error
    conn = servers._connect(host, port, user, password)
    try:
        with conn.cursor() as cur:
            cur.execute("SHOW DATABASES LIKE %s", ("bst\\_servers\\_test\\_%",))
            assert not set(names) & {row[0] for row in cur.fetchall()}
    finally:
        conn.close()


@pytest.mark.mysql
def test_a_drop_left_half_done_by_a_trigger_files_backup_is_finished() -> None:
    """MariaDB can leave ``<table>.TRG-`` in a database's directory, after
    which its drop fails with "Directory not empty" however often it is
    tried; the fixtures' drop removes such a leftover and drops it.  Any
    other file left there is not touched: the drop fails."""
    host, port, user, password = servers.parse_mysql_url(servers.MYSQL_URL)
    require(servers.mysql_reachable(host, port, user, password))
    conn = servers._connect(host, port, user, password)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT @@datadir")
            datadir = Path(str(cur.fetchone()[0]))  # type: ignore[index]
    finally:
        conn.close()
    if not os.access(datadir, os.W_OK):
        pytest.skip("the server's data directory is not writable from here")
    names = [servers.unique_name("servers_left"), servers.unique_name("servers_left")]
    servers.create_databases(host, port, names, user, password)
    (datadir / names[0] / "bagstore_owned.TRG-").write_text("TYPE=TRIGGERS\n")
    (datadir / names[1] / "stranger.txt").write_text("not the server's\n")
    try:
        servers.drop_databases(host, port, names[:1], user, password)
        assert not (datadir / names[0]).exists()
        with pytest.raises(pymysql.err.OperationalError, match="Directory not empty"):
            servers.drop_databases(host, port, names[1:], user, password)
        assert (datadir / names[1] / "stranger.txt").exists()
    finally:
        stranger = datadir / names[1] / "stranger.txt"
        if stranger.exists():
            stranger.unlink()
        servers.drop_databases(host, port, names, user, password)
    assert not (datadir / names[1]).exists()


# ---------------------------------------------------------------------------
# Extra servers


def test_mariadb_server_lifecycle() -> None:
    require_binary("mariadbd", "mariadb-server")
    require_binary("mariadb-install-db", "mariadb-server")
    started = time.monotonic()
    with servers.MariaDBServer(startup_timeout_s=MARIADB_START_TIMEOUT_S) as server:
        assert server.running
        assert server.url == f"mysql://root@127.0.0.1:{server.port}"
        assert server.port != 3306
        pid_file = server.workdir / "mariadbd.pid"
        assert int(pid_file.read_text()) == server.pid
        assert server.reachable() is None

        name = servers.unique_name("lifecycle")
        servers.create_databases(server.host, server.port, [name])
        conn = server.connect(name)
        try:
            with conn.cursor() as cur:
                cur.execute("SELECT @@character_set_server")
                assert cur.fetchone() == ("utf8mb4",)
                cur.execute("CREATE TABLE t (id INT PRIMARY KEY, v VARCHAR(10)) ENGINE=InnoDB")
                cur.execute("INSERT INTO t VALUES (1, 'kept')")  # autocommit
        finally:
            conn.close()

        port, old_pid = server.port, server.pid
        server.kill()
        assert not server.running and server.pid is None
        assert server.reachable() is not None
        assert not os.path.exists(f"/proc/{old_pid}")

        server.restart()  # crash recovery: the committed row must survive
        assert server.port == port and server.pid != old_pid
        conn = server.connect(name)
        try:
            with conn.cursor() as cur:
                cur.execute("SELECT v FROM t WHERE id = 1")
                assert cur.fetchone() == ("kept",)
        finally:
            conn.close()

        server.restart()  # while running: clean shutdown, then start
        assert server.reachable() is None

        with servers.MariaDBServer(
            startup_timeout_s=MARIADB_START_TIMEOUT_S
        ) as second:  # a second one at the same time
            assert second.port != server.port
            assert second.reachable() is None

        servers.drop_databases(server.host, server.port, [name])
        workdir = server.workdir
    assert not server.running
    assert not workdir.exists()
    server.stop()  # idempotent
    elapsed = time.monotonic() - started
    assert elapsed < 2 * MARIADB_START_TIMEOUT_S, f"MariaDB lifecycle took {elapsed:.1f} s"


def test_drop_stale_test_databases() -> None:
    require_binary("mariadbd", "mariadb-server")
    require_binary("mariadb-install-db", "mariadb-server")
    with servers.MariaDBServer(startup_timeout_s=MARIADB_START_TIMEOUT_S) as server:
        old = int(time.time()) - 7200
        stale = f"bst_t_{old}_{dead_pid()}_1_abcdef"
        live_pid = f"bst_t_{old}_{os.getpid()}_2_abcdef"
        fresh = servers.unique_name("t")
        other = "bst_keep_me"
        servers.create_databases(server.host, server.port, [stale, live_pid, fresh, other])
        dropped = servers.drop_stale_test_databases(server.host, server.port)
        assert dropped == [stale]
        conn = server.connect()
        try:
            with conn.cursor() as cur:
                cur.execute("SHOW DATABASES LIKE 'bst%'")
                left = {row[0] for row in cur.fetchall()}
        finally:
            conn.close()
        assert left == {live_pid, fresh, other}


def test_memcached_lifecycle() -> None:
    require_binary("memcached", "memcached")
    with servers.Memcached() as cache:
        assert cache.addr == f"127.0.0.1:{cache.port}"
        assert cache.reachable() is None
        assert memcached_command(cache.addr, b"set k 0 0 2\r\nhi\r\n") == b"STORED\r\n"
        assert memcached_command(cache.addr, b"get k\r\n") == b"VALUE k 0 2\r\nhi\r\nEND\r\n"

        port, old_pid = cache.port, cache.pid
        cache.kill()
        assert cache.pid is None
        assert cache.reachable() is not None

        cache.restart()
        assert cache.port == port and cache.pid != old_pid
        assert cache.reachable() is None
        assert memcached_command(cache.addr, b"get k\r\n") == b"END\r\n"  # a new, empty cache
    assert not cache.running
    assert cache.reachable() is not None


def test_missing_binary_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(servers, "find_binary", lambda name: None)
    with pytest.raises(servers.ServerUnavailable, match="memcached"):
        servers.Memcached()
    with pytest.raises(servers.ServerUnavailable, match="mariadbd"):
        servers.MariaDBServer()
