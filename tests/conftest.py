"""Fixtures: one suite, parametrized over backends and topologies.

* ``sqlite``  - four SQLite files in a temporary directory;
* ``mysql``   - four databases on the MariaDB at 127.0.0.1:3306;
* ``mysql2``  - four databases over two MariaDB servers: 3306 and a second
  ``mariadbd`` the fixtures start on a free port (for tests that ask for it).

Outside CI a missing server skips its tests; in CI (``CI=true``) it fails them.
"""

from __future__ import annotations

import os
import queue
import sqlite3
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest

import bagstore
from tests import servers

MYSQL = servers.parse_mysql_url()


def _need(reason: str | None) -> None:
    if reason is None:
        return
    if servers.in_ci():
        pytest.fail(f"CI requires this server: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def mysql_main() -> servers.MySQLAddress:
    _need(servers.mysql_reachable(MYSQL.host, MYSQL.port, MYSQL.user, MYSQL.password))
    return MYSQL


S = TypeVar("S", servers.MariaDBServer, servers.Memcached)


@contextmanager
def started(server: S) -> Iterator[S]:
    """``server`` started (skipped, or failed in CI, when it cannot be), and
    stopped by pid when the block ends."""
    try:
        server.start()
    except servers.ServerUnavailable as exc:
        _need(str(exc))
        raise
    try:
        yield server
    finally:
        try:
            DROPPER.drain()  # its databases dropped before it stops
        finally:
            server.stop()


class _Dropper:
    """Drops the databases of finished tests in a thread of this worker, so
    that the next test runs meanwhile (a drop waits mostly on the server's
    disk: ~10% of the suite's time when each teardown waited for its own).
    :meth:`drain` waits for the drops asked so far and raises the first
    that failed."""

    def __init__(self) -> None:
        self._work: queue.Queue[tuple[str, int, list[str]]] = queue.Queue()
        self._failed: list[str] = []
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def drop(self, host: str, port: int, names: list[str]) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="dropper", daemon=True)
                self._thread.start()
        self._work.put((host, port, names))

    def _run(self) -> None:
        while True:
            host, port, names = self._work.get()
            try:
                servers.drop_databases(host, port, names, "root", "")
            except Exception as e:  # reported by drain()
                self._failed.append(f"dropping {names} on {host}:{port}: {e!r}")
            finally:
                self._work.task_done()

    def drain(self) -> None:
        self._work.join()
        failed, self._failed = self._failed, []
        if failed:
            raise RuntimeError("; ".join(failed))


DROPPER = _Dropper()


@pytest.fixture(scope="session", autouse=True)
def _databases_dropped() -> Iterator[None]:
    """The main server's test databases dropped before the session ends."""
    yield
    DROPPER.drain()


@pytest.fixture(scope="session")
def mysql_second() -> Iterator[servers.MariaDBServer]:
    """A second MariaDB server, started for this test session."""
    with started(servers.MariaDBServer()) as server:
        yield server


def as_read(rows: list[tuple[Any, ...]], bodies: bool) -> list[tuple[Any, ...]]:
    """Change rows as a feed reader's ``read`` returns them (a fake reader's,
    bagstore.feedread.Reader): with ``bodies`` False, each body's length in
    its place (None where there is none)."""
    if bodies:
        return rows
    return [(*r[:6], None if r[6] is None else len(r[6])) for r in rows]


class Topology:
    """A set of shard URLs for one test; ``open()`` makes a Datastore on them."""

    def __init__(self, name: str, urls: list[str], cleanup: Callable[[], None] | None = None):
        self.name = name
        self.urls = urls
        self._cleanup = cleanup
        self._open: list[bagstore.Datastore] = []

    @property
    def is_mysql(self) -> bool:
        return self.name != "sqlite"

    def open(self, **kwargs: Any) -> bagstore.Datastore:
        ds = bagstore.Datastore(self.urls, **kwargs)
        self._open.append(ds)
        return ds

    def close(self) -> None:
        for ds in self._open:
            ds.close()
        if self._cleanup:
            self._cleanup()


#: ``BAGSTORE_TEST_MYSQL_DRIVER=mysqlclient`` runs the MariaDB topologies on
#: mysqlclient instead of PyMySQL.
DRIVER = (
    f"?driver={os.environ['BAGSTORE_TEST_MYSQL_DRIVER']}"
    if os.environ.get("BAGSTORE_TEST_MYSQL_DRIVER")
    else ""
)


def _mysql_topology(
    name: str, hosts: list[tuple[servers.MySQLAddress | servers.MariaDBServer, int]]
) -> Topology:
    urls: list[str] = []
    made: list[tuple[Any, list[str]]] = []
    for server, count in hosts:
        names = [servers.unique_name(name) for _ in range(count)]
        # bagstore creates missing databases itself; the fixture only drops them.
        made.append((server, names))
        urls += [f"mysql://root@{server.host}:{server.port}/{n}{DRIVER}" for n in names]

    def cleanup() -> None:
        for server, names in made:
            DROPPER.drop(server.host, server.port, names)

    return Topology(name, urls, cleanup)


@pytest.fixture(params=["sqlite", "mysql"])
def topo(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Topology]:
    """Four shards on SQLite, or four databases on the main MariaDB."""
    t = _make(request, request.param, tmp_path)
    yield t
    t.close()


@pytest.fixture(params=["sqlite", "mysql", "mysql2"])
def topo3(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Topology]:
    """Like ``topo``, plus four databases over two MariaDB servers."""
    t = _make(request, request.param, tmp_path)
    yield t
    t.close()


@pytest.fixture(scope="module", params=["sqlite", "mysql"])
def shared_topo(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Topology]:
    """Like ``topo``, one a module (and worker): for tests of input that is
    refused and changes nothing, each of which checks that itself, so that
    they share a store rather than each making one (a MariaDB store's
    schema takes a second or more to make and drop)."""
    t = _make(request, request.param, tmp_path_factory.mktemp("shared"))
    yield t
    t.close()


@pytest.fixture(scope="module", params=["sqlite", "mysql", "mysql2"])
def shared_topo3(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Topology]:
    """Like ``topo3``, one a module: see ``shared_topo``."""
    t = _make(request, request.param, tmp_path_factory.mktemp("shared"))
    yield t
    t.close()


def _make(request: pytest.FixtureRequest, name: str, tmp_path: Path) -> Topology:
    if name == "sqlite":
        return Topology(name, [f"sqlite:///{tmp_path}/shard_{i}.db" for i in range(4)])
    main = request.getfixturevalue("mysql_main")
    if name == "mysql":
        return _mysql_topology("t", [(main, 4)])
    second = request.getfixturevalue("mysql_second")
    return _mysql_topology("t2", [(main, 2), (second, 2)])


def buckets_of_rows(ds: bagstore.Datastore, kind: str) -> dict[bytes, int]:
    """``{id: bucket}`` of every row of ``kind``'s entities table, as its
    shards hold them (read with raw SQL, past bagstore's placement)."""
    out = {}
    for backend in ds.router.backends:
        for entity_id, bucket in backend.fetchall(f"SELECT id, bucket FROM {kind}"):
            out[bytes(entity_id)] = int(bucket)
    return out


@pytest.fixture
def ds(topo: Topology) -> bagstore.Datastore:
    """A datastore without indexes, on each backend."""
    return topo.open()


@pytest.fixture(autouse=True)
def _no_stray_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith("BAGSTORE_MYSQL_"):
            monkeypatch.delenv(key)


@pytest.fixture(autouse=True)
def _doctests_write_under_tmp_path(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The modules' doctests store in ``tempfile.mkdtemp()``: in a test that
    runs them, that is under the test's ``tmp_path`` (pytest removes it)
    rather than a new directory of /tmp left behind by every run."""
    if "doctest" in request.node.name:
        monkeypatch.setattr(tempfile, "tempdir", str(request.getfixturevalue("tmp_path")))


@contextmanager
def sqlite_write_lock_held(path: str, seconds: float = 0.15) -> Iterator[list[str]]:
    """Another connection holds the SQLite file's write lock for ``seconds``
    from the start of the block; the list given gets ``"released"`` when it
    lets go (the block's own events appended after it show what waited)."""
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")
    events: list[str] = []

    def release() -> None:
        threading.Event().wait(seconds)
        events.append("released")
        holder.execute("COMMIT")

    thread = threading.Thread(target=release)
    thread.start()
    try:
        yield events
    finally:
        thread.join()
        holder.close()


def same_pages(topo: Topology, *reads: list[Any]) -> None:
    """Reads of the same changes under different budgets: the same pages
    (MariaDB), or on SQLite the same changes, each bucket's from its first
    in position order (read in commit order, one shard's changes of one
    time and another's come in no particular order: how the reads of the
    shards interleave follows the budget)."""
    if topo.is_mysql:
        assert all(read == reads[0] for read in reads)
        return
    for read in reads:
        assert sorted(read, key=lambda c: c[:2]) == sorted(reads[0], key=lambda c: c[:2])
        last: dict[int, int] = {}
        for c in read:
            assert c[1] == last.get(c[0], 0) + 1, c
            last[c[0]] = c[1]
