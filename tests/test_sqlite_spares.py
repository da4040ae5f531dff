"""SQLite's per-thread connections are handed back when their thread ends
(bagstore.backends.spares): a program starting a thread per request keeps a
few connections open, not one (and two file descriptors) per thread it ever
ran, and a new thread does not pay for opening one."""

from __future__ import annotations

import doctest
import threading
from collections.abc import Callable
from pathlib import Path

import bagstore
from bagstore.backends import spares, sqlitelib
from bagstore.backends.sqlite import SQLiteBackend


def in_threads(n: int, body: Callable[[], object], at_once: int = 1) -> None:
    """``n`` threads running ``body``, ``at_once`` at a time."""
    for _ in range(0, n, at_once):
        threads = [threading.Thread(target=body) for _ in range(at_once)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


def test_threads_that_end_hand_their_connection_to_the_next(tmp_path: Path) -> None:
    with bagstore.Datastore([f"sqlite:///{tmp_path / 's.db'}"]) as ds:
        entity_id = ds.put({"n": 0})
        (backend,) = ds.router.topology.backends
        assert isinstance(backend, SQLiteBackend)
        opened = len(backend._all)

        def bump() -> None:
            ds.update(entity_id, lambda e: {**e, "n": e["n"] + 1})

        in_threads(40, bump)  # one after the other: each takes the one before's
        assert len(backend._all) == opened + 1
        in_threads(40, bump, at_once=4)  # four at a time: at most four more
        assert len(backend._all) <= opened + 4
        entity = ds.get(entity_id)
        assert entity is not None and entity["n"] == 80  # every update on a handed-down one


def test_a_thread_ends_with_its_reading_connection_handed_back(tmp_path: Path) -> None:
    backends = [SQLiteBackend(str(tmp_path / f"f{i}.db")) for i in range(3)]
    try:
        for n, b in enumerate(backends):
            b.execute("CREATE TABLE t (n INTEGER)")
            b.execute("INSERT INTO t VALUES (?)", (n,))
        lead = backends[0]
        q = lead.dialect.q
        sql = lead.dialect.union_all_sql([f"SELECT n FROM {q(b.schema or '')}.t" for b in backends])
        seen: list[list[int]] = []

        def read() -> None:
            seen.append(sorted(row[0] for row in lead.read_together(sql, (), backends)))

        in_threads(1, read)
        opened = len(lead._all)  # the reading connection, the three files attached to it
        in_threads(20, read)
        assert len(lead._all) == opened
        assert seen == [[0, 1, 2]] * 21
    finally:
        for b in backends:
            b.close()


def test_discarded_closed_and_private_connections_are_not_handed_down(tmp_path: Path) -> None:
    backend = SQLiteBackend(str(tmp_path / "s.db"))
    backend.execute("CREATE TABLE t (n INTEGER)")

    def discard() -> None:  # a connection found broken: closed, never handed down
        backend.execute("INSERT INTO t VALUES (1)")
        backend._discard(backend._local.conn)

    in_threads(1, discard)
    assert backend._spares.take() is None
    in_threads(1, lambda: backend.execute("INSERT INTO t VALUES (2)"))
    backend.close()  # the spare closed with the rest, not taken by the next thread
    assert backend._spares.take() is None
    in_threads(1, lambda: backend.execute("INSERT INTO t VALUES (3)"))  # a new one
    assert [r[0] for r in backend.fetchall("SELECT n FROM t ORDER BY n")] == [1, 2, 3]
    backend.close()

    memory = SQLiteBackend(":memory:")  # each thread's own database: gone with its thread
    in_threads(3, lambda: memory.execute("CREATE TABLE t (n INTEGER)"))
    assert memory._all == [] and memory._spares.take() is None
    memory.close()


def test_module_doctests_pass() -> None:
    for module in (spares, sqlitelib):
        failed, attempted = doctest.testmod(module)
        assert failed == 0 and attempted > 0, module.__name__
