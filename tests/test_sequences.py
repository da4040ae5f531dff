"""Integer id sequences: blocks, threads, several datastores and processes, hand
edits, several id servers (one of them killed), Flickr's ticket mode."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import bagstore
from bagstore.backends import Backend
from bagstore.ids import sequence as seqmod
from bagstore.ids.sequence import (
    Sequence,
    TicketSequence,
    advance_sequence,
    list_sequences,
    open_sequence,
)
from tests import servers
from tests.conftest import Topology

SEQUENCES = "bagstore_sequences"


def block_seq(ds: bagstore.Datastore, name: str, **kwargs: Any) -> Sequence:
    seq = open_sequence(ds, name, **kwargs)
    assert isinstance(seq, Sequence)
    return seq


def ticket_seq(ds: bagstore.Datastore, name: str, **kwargs: Any) -> TicketSequence:
    seq = open_sequence(ds, name, mode="ticket", **kwargs)
    assert isinstance(seq, TicketSequence)
    return seq


@contextlib.contextmanager
def id_server_urls(topo: Topology, tmp_path: Path, n: int) -> Iterator[list[str]]:
    """``n`` id-server URLs of the topology's kind: SQLite files, or fresh
    databases on the main MariaDB (dropped afterwards)."""
    if not topo.is_mysql:
        yield [f"sqlite:///{tmp_path}/ids_{i}.db" for i in range(n)]
        return
    main = servers.parse_mysql_url()
    names = [servers.unique_name("seq") for _ in range(n)]
    try:
        yield [f"mysql://root@{main.host}:{main.port}/{name}" for name in names]
    finally:
        servers.drop_databases(main.host, main.port, names, main.user, main.password)


def count_statements(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the statements the backend sends from now on (``counter[0]``)."""
    counter = [0]
    run = backend.run

    class Cursor:
        def __init__(self, cur: Any) -> None:
            self._cur = cur

        def execute(self, *args: Any) -> Any:
            counter[0] += 1
            return self._cur.execute(*args)

        def __getattr__(self, name: str) -> Any:
            return getattr(self._cur, name)

    class Conn:
        def __init__(self, conn: Any) -> None:
            self._conn = conn

        def cursor(self) -> Cursor:
            return Cursor(self._conn.cursor())

        def __getattr__(self, name: str) -> Any:
            return getattr(self._conn, name)

    def counting(work: Callable[[Any], Any], **kwargs: Any) -> Any:
        return run(lambda conn: work(Conn(conn)), **kwargs)

    monkeypatch.setattr(backend, "run", counting)
    return counter


# -- the basics ---------------------------------------------------------------------


def test_starts_at_one_and_increases(topo: Topology) -> None:
    ds = topo.open()
    seq = ds.sequence("photos", block=10)
    assert [seq.next() for _ in range(35)] == list(range(1, 36))
    assert ds.sequence("photos", block=10) is seq  # the datastore keeps one object


def test_start(topo: Topology) -> None:
    ds = topo.open()
    assert block_seq(ds, "orders", start=1000).next_many(3) == [1000, 1001, 1002]
    # start is a lower bound: an existing sequence continues above it ...
    assert block_seq(ds, "orders", start=5).next() > 1002
    # ... or jumps to it when it is higher than what was handed out.
    assert block_seq(ds, "orders", start=50_000).next() == 50_000


def test_next_many_uses_one_statement(topo: Topology, monkeypatch: pytest.MonkeyPatch) -> None:
    ds = topo.open()
    seq = block_seq(ds, "many", block=10)
    assert seq.next() == 1
    assert seq.next_many(0) == []
    assert seq.next_many(5) == [2, 3, 4, 5, 6]
    counter = count_statements(ds.router.catalog_backend, monkeypatch)
    assert seq.next_many(25) == list(range(7, 32))  # 4 left in memory, 21 reserved
    assert counter[0] == 1
    assert seq.next() == 32
    assert seq.next_many(8) == list(range(33, 41)) and counter[0] == 1
    assert seq.next_many(1000) == list(range(41, 1041)) and counter[0] == 2


def test_one_statement_per_block(topo: Topology, monkeypatch: pytest.MonkeyPatch) -> None:
    ds = topo.open()
    seq = block_seq(ds, "blocks", block=1000)
    seq.next()  # creates the table and the row
    counter = count_statements(ds.router.catalog_backend, monkeypatch)
    ids = [seq.next() for _ in range(10_000)]
    assert ids == list(range(2, 10_002))
    assert counter[0] == 10  # blocks 1001-2000, ..., 10001-11000


def test_names_are_independent(topo: Topology) -> None:
    ds = topo.open()
    a, b = ds.sequence("users", block=3), ds.sequence("albums", block=3)
    assert [a.next() for _ in range(5)] == [1, 2, 3, 4, 5]
    assert [b.next() for _ in range(2)] == [1, 2]
    assert a.next() == 6
    assert list_sequences(ds) == [("albums", 3), ("users", 6)]


@pytest.mark.parametrize(
    "name",
    ["", "1photos", "pho-tos", "pho tos", "x" * 65, "p'); DROP TABLE x; --", "фото", None, 7],
)
def test_bad_names_are_refused(tmp_path: Path, name: Any) -> None:
    with bagstore.open(tmp_path) as ds:
        with pytest.raises(bagstore.ConfigurationError, match="sequence name"):
            ds.sequence(name)
        with pytest.raises(bagstore.ConfigurationError, match="sequence name"):
            open_sequence(ds, name, mode="ticket")
        assert list_sequences(ds) == []


def test_bad_sizes_and_modes_are_refused(tmp_path: Path) -> None:
    with bagstore.open(tmp_path) as ds:
        for block in (0, -1, 1.5, True, "10", None, seqmod.MAX_BLOCK + 1):
            with pytest.raises(bagstore.ConfigurationError, match="block"):
                open_sequence(ds, "x", block=block)  # type: ignore[arg-type]
        for start in (0, -3, 2.0, False, seqmod.MAX_START + 1):
            with pytest.raises(bagstore.ConfigurationError, match="start"):
                open_sequence(ds, "x", start=start)  # type: ignore[arg-type]
        with pytest.raises(bagstore.ConfigurationError, match="mode"):
            open_sequence(ds, "x", mode="snowflake")
        with pytest.raises(bagstore.ConfigurationError, match="ticket table name"):
            open_sequence(ds, "x" * 48, mode="ticket")  # bagstore_tickets_ + 48 > 64
        seq = ds.sequence("x")
        for n in (-1, 1.0, "3", None, True, seqmod.MAX_MANY + 1):
            with pytest.raises(bagstore.InvalidQuery, match="next_many"):
                seq.next_many(n)
        assert seq.next() == 1  # nothing was consumed by the refusals


# -- concurrency --------------------------------------------------------------------


def test_threads_and_datastores_never_share_an_id(topo: Topology) -> None:
    stores = [topo.open(), topo.open()]
    seqs = [ds.sequence("shared", block=100) for ds in stores]
    per_thread = 1500
    got: list[list[int]] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(8)

    def worker(seq: Any, k: int) -> None:
        try:
            barrier.wait()
            mine: list[int] = []
            while len(mine) < per_thread:
                if k % 2 and len(mine) % 10 == 0:
                    mine += seq.next_many(min(3, per_thread - len(mine)))
                else:
                    mine.append(seq.next())
            got.append(mine)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(seq, k)) for seq in seqs for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    every = [i for mine in got for i in mine]
    assert len(every) == 8 * per_thread == len(set(every))
    assert min(every) >= 1
    for mine in got:
        assert mine == sorted(mine) and len(set(mine)) == len(mine)  # increasing per thread


def test_another_process_never_shares_an_id(topo: Topology) -> None:
    ds = topo.open()
    seq = ds.sequence("procs", block=50)
    script = (
        "import json, sys, bagstore\n"
        "ds = bagstore.Datastore(json.loads(sys.argv[1]))\n"
        "seq = ds.sequence('procs', block=50)\n"
        "print(json.dumps([seq.next() for _ in range(3000)]))\n"
        "ds.close()\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script, json.dumps(topo.urls)], stdout=subprocess.PIPE
    )
    mine = [seq.next() for _ in range(3000)]
    out, _ = child.communicate(timeout=120)
    assert child.returncode == 0
    theirs = json.loads(out)
    assert len(set(mine) | set(theirs)) == 6000
    assert theirs == sorted(theirs) and mine == sorted(mine)


def test_a_later_datastore_skips_reserved_ids(topo: Topology) -> None:
    first = topo.open()
    handed = [first.sequence("later").next() for _ in range(5)]
    assert handed == [1, 2, 3, 4, 5]
    first.close()  # ids 6-1000 were reserved and never handed out
    second = topo.open()
    assert second.sequence("later").next() == 1001


# -- hand edits ---------------------------------------------------------------------


def test_lowering_id_by_hand_repeats_nothing(topo: Topology) -> None:
    ds = topo.open()
    seq = block_seq(ds, "edited", block=10)
    before = [seq.next() for _ in range(15)]  # reserved up to 20
    catalog = ds.router.catalog_backend
    assert catalog.update(SEQUENCES, {"id": 3}, {"name": "edited"}) == 1
    other = block_seq(topo.open(), "edited", block=10)  # another process, later
    assert other.next() == 21  # `high` still says 20
    after = [seq.next() for _ in range(30)]
    assert len(set(before + after + [21])) == 46
    assert after == sorted(after) and after[0] > before[-1]


def test_a_running_process_never_goes_back(topo: Topology) -> None:
    ds = topo.open()
    seq = block_seq(ds, "lowered", block=10)
    handed = [seq.next() for _ in range(25)]  # reserved up to 30
    catalog = ds.router.catalog_backend
    # Both columns lowered: the process's own floor still holds.
    catalog.update(SEQUENCES, {"id": 2, "high": 2}, {"name": "lowered"})
    handed += [seq.next() for _ in range(10)]
    assert handed[25:] == list(range(26, 36))  # the rest of the block, then above 30
    # The row deleted: recreated, and the next block starts above the floor.
    catalog.delete_where(SEQUENCES, {"name": "lowered"})
    handed += seq.next_many(20)
    assert handed == sorted(handed) and len(set(handed)) == len(handed) == 55
    assert dict(list_sequences(ds))["lowered"] == 60


# -- several id servers -------------------------------------------------------------


def test_several_servers_split_by_residue(topo: Topology, tmp_path: Path) -> None:
    with id_server_urls(topo, tmp_path, 2) as urls:
        ds = topo.open(sequence_servers=urls)
        try:
            seq = block_seq(ds, "spread", block=5)
            ids = [seq.next() for _ in range(15)]
            # round robin: server 0 hands out odd ids, server 1 even ones, each
            # block starting above what this process already had
            assert ids == [1, 3, 5, 7, 9, 12, 14, 16, 18, 20, 21, 23, 25, 27, 29]
            assert list_sequences(ds) == [("spread", 30)]
            # the catalog holds no sequence: the id servers do
            assert seqmod.id_servers(ds).backends[0] is not ds.router.catalog_backend
            tickets = ticket_seq(ds, "tix", start=10)
            got = [tickets.next() for _ in range(6)]
            assert sorted(got) == [10, 11, 12, 13, 14, 15]
            assert got[0::2] == [11, 13, 15] and got[1::2] == [10, 12, 14]
        finally:
            seqmod.close_sequences(ds)


def test_failover_skips_a_failing_server(
    topo: Topology, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with id_server_urls(topo, tmp_path, 2) as urls:
        ds = topo.open(sequence_servers=urls)
        try:
            seq = block_seq(ds, "fail", block=4)
            first = seq.next_many(4)  # server 0: odd ids
            servers = seqmod.id_servers(ds)
            broken = servers.backends[1]
            calls = [0]

            def down(work: Any, **kwargs: Any) -> Any:
                calls[0] += 1
                raise bagstore.ShardUnavailable("id server down (simulated)", shard=broken.name)

            monkeypatch.setattr(broken, "run", down)
            during = seq.next_many(12) + seq.next_many(4)
            assert all(i % 2 == 1 for i in during)
            assert calls[0] == 1  # marked down after one failure, then skipped
            monkeypatch.undo()
            servers.reset()  # as after retry_after seconds
            after = seq.next_many(4) + seq.next_many(4)
            assert {i % 2 for i in after} == {0, 1}  # both servers serve again
            every = first + during + after
            assert every == sorted(every) and len(set(every)) == 28
        finally:
            seqmod.close_sequences(ds)


def test_a_changed_server_list_is_refused(topo: Topology, tmp_path: Path) -> None:
    with id_server_urls(topo, tmp_path, 2) as urls:
        ds = topo.open(sequence_servers=urls)
        swapped = topo.open(sequence_servers=urls[::-1])
        fewer = topo.open(sequence_servers=urls[:1])
        try:
            fixed = block_seq(ds, "fixed", block=1)
            assert [fixed.next(), fixed.next()] == [1, 4]  # a row on each server
            with pytest.raises(bagstore.ConfigurationError, match="sequence_servers changed"):
                swapped.sequence("fixed").next()
            with pytest.raises(bagstore.ConfigurationError, match="server 0 of 2"):
                fewer.sequence("fixed").next()
            with pytest.raises(bagstore.ConfigurationError, match="listed twice"):
                topo.open(sequence_servers=[urls[0], urls[0]]).sequence("fixed")
            with pytest.raises(bagstore.ConfigurationError, match="list of URLs"):
                topo.open(sequence_servers=urls[0]).sequence("fixed")  # one string
            # The documented way to change the list: stop, note the top, advance.
            top = dict(list_sequences(ds))["fixed"]
            assert top == 4
            advance_sequence(fewer, "fixed", top)
            assert [fewer.sequence("fixed", block=2).next() for _ in range(3)] == [5, 6, 7]
            advance_sequence(fewer, "fixed", 1)  # never lowers
            assert list_sequences(fewer) == [("fixed", 8)]
            with pytest.raises(bagstore.ConfigurationError, match="sequence_servers changed"):
                block_seq(ds, "fixed").next()  # the old list is refused now
        finally:
            for store in (ds, swapped, fewer):
                seqmod.close_sequences(store)


def test_two_mariadb_servers_with_one_killed(
    mysql_main: servers.MySQLAddress, mysql_second: servers.MariaDBServer, tmp_path: Path
) -> None:
    names = [servers.unique_name("seq"), servers.unique_name("seq")]
    urls = [
        f"mysql://root@{mysql_main.host}:{mysql_main.port}/{names[0]}",
        f"mysql://root@{mysql_second.host}:{mysql_second.port}/{names[1]}",
    ]
    shards = [f"sqlite:///{tmp_path}/shard_{i}.db" for i in range(2)]
    stores = [bagstore.Datastore(shards, sequence_servers=urls) for _ in range(2)]
    try:
        seqs = [block_seq(ds, "photos", block=50) for ds in stores]
        mine: list[list[int]] = [[], []]  # the ids each datastore handed out

        def take(n: int) -> list[list[int]]:
            got = [[seq.next() for _ in range(n)] for seq in seqs]
            for k in range(2):
                mine[k] += got[k]
            return got

        assert {i % 2 for got in take(300) for i in got} == {0, 1}  # both servers serve
        mysql_second.kill()
        for got in take(600):
            # after what was already in memory (< one block), the main server only
            assert all(i % 2 == 1 for i in got[50:])
        tickets = ticket_seq(stores[0], "tix")
        ticket_ids = [tickets.next() for _ in range(4)]  # from the main server only
        assert all(i % 2 == 1 for i in ticket_ids) and len(set(ticket_ids)) == 4
        mysql_second.restart()
        for ds in stores:
            seqmod.id_servers(ds).reset()
        assert {i % 2 for got in take(300) for i in got} == {0, 1}  # served again
        every = mine[0] + mine[1]
        assert len(every) == len(set(every)) == 2400
        assert all(ids == sorted(ids) for ids in mine)  # increasing within each
    finally:
        if not mysql_second.running:
            mysql_second.restart()
        for ds in stores:
            seqmod.close_sequences(ds)
            ds.close()
        servers.drop_databases(mysql_main.host, mysql_main.port, names[:1])
        servers.drop_databases(mysql_second.host, mysql_second.port, names[1:])


# -- Flickr's ticket server ---------------------------------------------------------


def test_ticket_mode(topo: Topology) -> None:
    ds = topo.open()
    tickets = ticket_seq(ds, "tickets")
    assert [tickets.next() for _ in range(3)] == [1, 2, 3]
    assert tickets.next_many(2) == [4, 5]
    assert tickets.statements == 2 + 5  # the table, then one statement per id
    later = ticket_seq(topo.open(), "tickets", start=1000)  # the table exists: start ignored
    assert later.next() == 6
    got: list[list[int]] = []
    lock = threading.Lock()

    def worker() -> None:
        mine = [tickets.next() for _ in range(50)]
        with lock:
            got.append(mine)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Unique and increasing for each caller; not gapless: a REPLACE INTO that
    # deadlocked with another is retried and takes a new AUTO_INCREMENT value.
    every = [i for mine in got for i in mine]
    assert len(got) == 4 and len(set(every)) == len(every) == 200 and min(every) >= 7
    assert all(mine == sorted(mine) for mine in got)
    assert ticket_seq(ds, "other", start=500).next() == 500
    assert list_sequences(ds) == []  # ticket tables are not block sequences


# -- configuration and exports ------------------------------------------------------


def test_sequence_servers_from_config(tmp_path: Path) -> None:
    config = tmp_path / "bagstore.toml"
    config.write_text(
        '[bagstore]\npath = "data/"\nshards = 2\n'
        f'sequence_servers = ["sqlite:///{tmp_path}/ids_0.db", "sqlite:///{tmp_path}/ids_1.db"]\n'
    )
    ds = bagstore.Datastore.from_config(config)
    try:
        seq = block_seq(ds, "cfg", block=2)
        assert seq.next_many(2) + seq.next_many(2) == [1, 3, 6, 8]
    finally:
        seqmod.close_sequences(ds)
        ds.close()
    config.write_text('[bagstore]\npath = "data/"\nsequence_servers = "sqlite:///x.db"\n')
    with pytest.raises(bagstore.ConfigurationError, match="sequence_servers"):
        bagstore.Datastore.from_config(config)


def test_exports() -> None:
    for name in (
        "Sequence",
        "TicketSequence",
        "open_sequence",
        "list_sequences",
        "advance_sequence",
    ):
        assert name in bagstore.ids.__all__ and hasattr(bagstore.ids, name)
