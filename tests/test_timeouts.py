"""A hung MariaDB server does not hang the caller (issue #21, item 6).

A server that stops answering gives ``ShardTimeout`` once the timeouts run
out: a statement's answer (``read_timeout``), a new connection, the handshake
included (``connect_timeout``).  A statement that timed out is never run
again by bagstore (a write may have been applied), and bulk work (Cleaner
batches, bucket moves) waits ``bulk_timeout`` instead.  The servers here are
real: a ``mariadbd`` this test starts and stops with SIGSTOP/SIGCONT, a socket
that accepts and never answers, and a row lock held on the shared server.
"""

from __future__ import annotations

import os
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pymysql
import pytest

import bagstore
from bagstore.backends import open_backend
from bagstore.backends.pool import Pool, in_long_statements, long_statements
from tests import servers
from tests.conftest import DRIVER, started

#: On mysqlclient a read timeout is an error 2013, like a lost connection
#: (ShardUnavailable), and timeouts cannot change per statement.
pymysql_only = pytest.mark.skipif(
    "mysqlclient" in DRIVER, reason="timeouts are told apart on PyMySQL only"
)


@pytest.fixture
def stalled_server() -> Iterator[servers.MariaDBServer]:
    """A MariaDB server of this test's own (it is stopped with SIGSTOP)."""
    with started(servers.MariaDBServer()) as server:
        try:
            yield server
        finally:
            pid = server.pid
            if pid is not None:
                os.kill(pid, signal.SIGCONT)


def _count_new_connections(mp: pytest.MonkeyPatch, backend: object) -> list[object]:
    """One item per connection ``backend``'s pool tries to make from now on
    (while ``mp`` lasts)."""
    made: list[object] = []
    pool = backend._pool  # type: ignore[attr-defined]
    connect = pool._create

    def counted() -> object:
        made.append("attempt")
        return connect()

    mp.setattr(pool, "_create", counted)
    return made


@contextmanager
def _stopped(server: servers.MariaDBServer) -> Iterator[None]:
    pid = server.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        # The signal stops the process's threads a moment later: wait for it
        # (state T), or a statement sent now might still be answered.
        stat = Path(f"/proc/{pid}/stat")
        while stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "T":
            time.sleep(0.001)
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def test_a_stopped_server_gives_shard_timeout_for_a_put_and_a_get(
    stalled_server: servers.MariaDBServer,
) -> None:
    server = stalled_server
    url = f"mysql://root@{server.host}:{server.port}/{servers.unique_name('hung')}"
    by_t = bagstore.Index(table="index_t", properties=["t"])
    ds = bagstore.Datastore([url], indexes=[by_t], read_timeout=1, connect_timeout=1)
    try:
        first = ds.put({"t": "before"})
        entity = {"id": first, "t": "during"}
        with pytest.MonkeyPatch.context() as mp:
            backend = ds.router.backends[0]
            made = _count_new_connections(mp, backend)
            with _stopped(server):
                with pytest.raises(bagstore.ShardTimeout) as put_error:
                    ds.put(entity)
                with pytest.raises(bagstore.ShardTimeout) as get_error:
                    ds.get(first)
        assert "may or may not have been applied" in str(put_error.value)
        assert "read_timeout" in str(put_error.value)
        assert isinstance(get_error.value.__cause__, pymysql.err.OperationalError)
        # The timed-out put was not run again on a new connection (the get
        # that followed needed one: its pooled connection was closed).
        assert len(made) == 1
        # Once the server runs again the store works.  The put had not been
        # applied: the server was stopped before its BEGIN was answered.
        assert ds.get(first) == {"id": first, "t": "before"}
        ds.put(entity)
        assert by_t.get_all(ds, t="during") == [entity]
        assert (ds.check()["missing"], ds.check()["stale"]) == (0, 0)
    finally:
        ds.close()


def test_a_socket_that_never_answers_gives_shard_timeout_on_connect() -> None:
    # Accepts connections (the kernel completes them) and never sends the
    # server's handshake.
    with socket.create_server(("127.0.0.1", 0)) as mute:
        port = mute.getsockname()[1]
        # read_timeout stated: the handshake is bounded by connect_timeout
        # (before: by read_timeout, and with none given, never)
        url = f"mysql://root@127.0.0.1:{port}/nothing_here?connect_timeout=1&read_timeout=60"
        with pytest.raises(bagstore.ShardTimeout) as error:
            bagstore.Datastore([url])
    assert "connect_timeout" in str(error.value) and "nothing was sent" in str(error.value)


def test_a_refused_connection_stays_shard_unavailable() -> None:
    with socket.create_server(("127.0.0.1", 0)) as closed:
        port = closed.getsockname()[1]
    with pytest.raises(bagstore.ShardUnavailable):
        bagstore.Datastore([f"mysql://root@127.0.0.1:{port}/nothing_here?connect_timeout=1"])


@pymysql_only
def test_a_write_blocked_by_a_lock_times_out_once_and_is_not_applied(
    mysql_main: servers.MySQLAddress,
) -> None:
    database = servers.unique_name("lockwait")
    url = f"mysql://root@{mysql_main.host}:{mysql_main.port}/{database}{DRIVER}"
    ds = bagstore.Datastore([url], indexes=[bagstore.Index(table="index_t", properties=["t"])])
    holder = pymysql.connect(
        host=mysql_main.host, port=mysql_main.port, user="root", password="", database=database
    )
    slow = bagstore.Datastore([url + ("&" if "?" in url else "?") + "read_timeout=1"])
    try:
        entity_id = ds.put({"t": "old"})
        slow.get(entity_id)  # a pooled connection
        cur = holder.cursor()
        cur.execute("BEGIN")
        cur.execute("SELECT body FROM entities WHERE id = %s FOR UPDATE", (entity_id,))
        backend = slow.router.backends[0]
        with pytest.MonkeyPatch.context() as mp:
            made = _count_new_connections(mp, backend)
            with pytest.raises(bagstore.ShardTimeout, match="may or may not have been applied"):
                slow.put({"id": entity_id, "t": "new"})
        assert made == []  # not retried (before: twice more, on new connections)
        holder.rollback()
        assert ds.get(entity_id) == {"id": entity_id, "t": "old"}
    finally:
        holder.close()
        slow.close()
        ds.close()
        servers.drop_databases(mysql_main.host, mysql_main.port, [database])


def test_bulk_work_waits_bulk_timeout(mysql_main: servers.MySQLAddress) -> None:
    database = servers.unique_name("bulk")
    backend = open_backend(
        f"mysql://root@{mysql_main.host}:{mysql_main.port}/{database}"
        "?read_timeout=1&bulk_timeout=60"
    )
    try:
        with pytest.raises(bagstore.ShardTimeout, match="read_timeout"):
            backend.fetchall("SELECT SLEEP(3)")
        with long_statements():
            assert backend.fetchall("SELECT SLEEP(3)") == [(0,)]
        with pytest.raises(bagstore.ShardTimeout):  # the connection is back to 1 s
            backend.fetchall("SELECT SLEEP(3)")
    finally:
        backend.close()
        servers.drop_databases(mysql_main.host, mysql_main.port, [database])


def test_the_cleaner_the_mover_check_and_count_run_as_bulk_work(tmp_path: Path) -> None:
    seen: dict[str, set[bool]] = {}
    # parallel=True: shards are read from the pool's threads, which must know
    ds = bagstore.open(tmp_path / "s", shards=2, parallel=True)
    try:
        ids = ds.put_many([{"t": str(i)} for i in range(20)])
        buckets = {ds.bucket_of_id(i) for i in ids}
        on_first = [b for b in buckets if b is not None and ds.placement.shard_of_bucket[b] == 0]
        ds.add_index(bagstore.Index(table="index_t", properties=["t"]))
        for name in ("insert_index_rows", "copy_entity_rows", "count"):
            for backend in ds.router.backends:
                method = getattr(backend, name)

                def spy(*args: object, _m: object = method, _n: str = name, **kw: object) -> object:
                    seen.setdefault(_n, set()).add(in_long_statements())
                    return _m(*args, **kw)  # type: ignore[operator]

                setattr(backend, name, spy)
        bagstore.Cleaner(ds, settle=0).backfill("index_t")
        bagstore.Mover(ds, grace=0).move(on_first, 1)
        assert ds.count() == 20
        assert ds.check()["missing"] == 0
        bulk = dict(seen)
        seen.clear()
        ds.put({"t": "a put is no bulk work"})
    finally:
        ds.close()
    assert bulk == {"insert_index_rows": {True}, "copy_entity_rows": {True}, "count": {True}}
    assert seen == {"insert_index_rows": {False}}


@pytest.mark.parametrize(
    "bad",
    ["read_timeout=0", "write_timeout=-1", "bulk_timeout=soon", "connect_timeout=nan"],
)
def test_bad_timeouts_are_refused(bad: str) -> None:
    with pytest.raises(bagstore.ConfigurationError, match=bad.split("=")[0]):
        open_backend(f"mysql://root@127.0.0.1:1/db?{bad}")


def test_timeouts_from_keywords_and_toml() -> None:
    with pytest.raises(bagstore.ConfigurationError, match="read_timeout"):
        bagstore.Datastore(["mysql://root@127.0.0.1:1/db"], read_timeout=0)
    with tempfile.TemporaryDirectory() as d:
        config = Path(d) / "bagstore.toml"
        config.write_text(
            '[bagstore]\nshards = ["mysql://root@127.0.0.1:1/db"]\nread_timeout = -2\n'
        )
        with pytest.raises(bagstore.ConfigurationError, match="read_timeout"):
            bagstore.Datastore.from_config(config)


def test_timeouts_reach_every_mysql_shard_and_a_url_wins(
    mysql_main: servers.MySQLAddress, tmp_path: Path
) -> None:
    names = [servers.unique_name("tmo") for _ in range(2)]
    base = f"mysql://root@{mysql_main.host}:{mysql_main.port}"
    config = tmp_path / "bagstore.toml"
    config.write_text(
        "[bagstore]\n"
        f'shards = ["{base}/{names[0]}", "{base}/{names[1]}?read_timeout=3"]\n'
        "read_timeout = 7\nbulk_timeout = 900\nconnect_timeout = 2\n"
    )
    ds = bagstore.Datastore.from_config(config)
    try:
        got = [
            (b._connect_timeout, b._read_timeout, b._write_timeout, b._bulk_timeout)  # type: ignore[attr-defined]
            for b in ds.router.backends
        ]
        assert got == [(2, 7, 30, 900), (2, 3, 30, 900)]
    finally:
        ds.close()
        servers.drop_databases(mysql_main.host, mysql_main.port, names)


def test_a_connection_discarded_twice_frees_one_slot() -> None:
    # A timed-out (or lost) connection inside a transaction is discarded by the
    # failed rollback and again by the unit of work: the pool must not count
    # two free slots for it (before, the pool then held more than its size).
    pool: Pool[object] = Pool(object, lambda c: None, size=1, timeout=0.05)
    conn = pool.acquire()
    pool.discard(conn)
    pool.discard(conn)
    held = pool.acquire()
    with pytest.raises(bagstore.ShardTimeout, match="no free connection"):
        pool.acquire()
    pool.release(held)


def test_a_deadlock_victim_runs_again_after_a_pause(
    mysql_main: servers.MySQLAddress, caplog: pytest.LogCaptureFixture
) -> None:
    """Two transactions that lock two rows in opposite orders: MariaDB kills
    one (1213); it runs again, after a random pause, on a connection of the
    pool (its own is kept, not replaced), and both commit."""
    database = servers.unique_name("deadlock")
    url = f"mysql://root@{mysql_main.host}:{mysql_main.port}/{database}{DRIVER}"
    backend = open_backend(url)
    try:
        backend.execute("CREATE TABLE t (id INT PRIMARY KEY, n INT NOT NULL)")
        backend.execute("INSERT INTO t VALUES (1, 0), (2, 0)")
        both = threading.Barrier(2)
        calls: list[int] = []
        sessions: list[int] = []

        def locking(first: int, second: int) -> Any:
            def work(conn: Any) -> None:
                calls.append(first)
                sessions.append(conn.thread_id())
                with backend.transaction(conn) as cur:
                    cur.execute("UPDATE t SET n = n + 1 WHERE id = %s", (first,))
                    if len(calls) <= 2:  # the first attempts meet each other
                        both.wait(timeout=10)
                    time.sleep(0.05)
                    cur.execute("UPDATE t SET n = n + 1 WHERE id = %s", (second,))

            return lambda: backend.run(work)

        with caplog.at_level("INFO", logger="bagstore.backends.base"):
            threads = [threading.Thread(target=locking(a, b)) for a, b in ((1, 2), (2, 1))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=30)
        assert backend.fetchall("SELECT id, n FROM t ORDER BY id") == [(1, 2), (2, 2)]
        assert len(calls) == 3  # one victim, run once more
        # the victim's connection was kept (rolled back), not closed and replaced
        open_now = {int(r[0]) for r in backend.fetchall("SHOW PROCESSLIST")}
        assert set(sessions[:2]) <= open_now
        assert any("Deadlock" in r.getMessage() and "trying again" in r.getMessage()
                   for r in caplog.records)  # fmt: skip
    finally:
        backend.close()
        servers.drop_databases(mysql_main.host, mysql_main.port, [database])
