"""The core store: put / get / delete on every backend, placement, reopening."""

from __future__ import annotations

import binascii
import datetime as dt
import threading
import time
import zoneinfo
from pathlib import Path

import pytest

import bagstore
from bagstore.sharding.hashing import bucket_of, buckets_of
from tests import servers
from tests.conftest import Topology, sqlite_write_lock_held

FRIENDFEED_ENTITY = {
    "id": binascii.a2b_hex("71f0c4d2291844cca2df6f486e96e37c"),
    "user_id": binascii.a2b_hex("f48b0440ca0c4f66991c4d5f6a078eaf"),
    "feed_id": binascii.a2b_hex("f48b0440ca0c4f66991c4d5f6a078eaf"),
    "title": "We just launched a new backend system for FriendFeed!",
    "link": "http://friendfeed.com/e/71f0c4d2-2918-44cc-a2df-6f486e96e37c",
    "published": 1235697046,
    "updated": 1235697046,
}


def test_friendfeed_entity_round_trips(ds: bagstore.Datastore) -> None:
    entity_id = ds.put(dict(FRIENDFEED_ENTITY))
    assert entity_id == FRIENDFEED_ENTITY["id"]
    assert ds.get(binascii.a2b_hex("71f0c4d2291844cca2df6f486e96e37c")) == FRIENDFEED_ENTITY


def test_every_value_type_round_trips(ds: bagstore.Datastore) -> None:
    entity = {
        "s": "héllo \x00 wörld",
        "b": b"\x00\xff\x10",
        "i": -(2**70),
        "small": 7,
        "f": 1.5,
        "t": True,
        "n": None,
        "l": [1, "two", [3.0, b"4"], {"five": 5}],
        "d": {"nested": {"deep": [None, False]}},
        "naive": dt.datetime(2009, 2, 27, 1, 10, 46, 123456),
        "aware": dt.datetime(2009, 2, 27, 1, 10, 46, tzinfo=zoneinfo.ZoneInfo("Asia/Tokyo")),
    }
    entity_id = ds.put(entity)
    got = ds.get(entity_id)
    assert got == entity
    assert type(got["t"]) is bool and type(got["b"]) is bytes
    assert got["aware"].tzinfo == zoneinfo.ZoneInfo("Asia/Tokyo")


def test_put_without_id_assigns_time_ordered_id(ds: bagstore.Datastore) -> None:
    entity: dict[str, object] = {"title": "x"}
    first = ds.put(entity)
    assert entity["id"] == first and len(first) == 16
    second = ds.put({"title": "y"})
    assert ds.get(first) == {"title": "x", "id": first}
    assert bagstore.ids.id_time(second) >= bagstore.ids.id_time(first)


def test_put_replaces_whole_body_never_merges(ds: bagstore.Datastore) -> None:
    entity_id = ds.put({"a": 1, "b": 2})
    ds.put({"id": entity_id, "a": 3})
    assert ds.get(entity_id) == {"id": entity_id, "a": 3}


def test_get_missing_is_none_and_delete_missing_is_false(ds: bagstore.Datastore) -> None:
    missing = bagstore.new_id()
    assert ds.get(missing) is None
    assert ds.delete(missing) is False
    entity_id = ds.put({"x": 1})
    assert ds.delete(entity_id) is True
    assert ds.get(entity_id) is None
    assert ds.delete(entity_id) is False


def test_put_many_get_many_keep_order(ds: bagstore.Datastore) -> None:
    entities = [{"n": i} for i in range(300)]
    ids = ds.put_many(entities)
    assert len(set(ids)) == 300 and [e["id"] for e in entities] == ids
    missing = bagstore.new_id()
    asked = [ids[5], missing, ids[0], ids[5], *ids[100:150]]
    got = ds.get_many(asked)
    assert [g["n"] if g else None for g in got] == [5, None, 0, 5, *range(100, 150)]
    assert got[0] is not got[3]  # the same id twice gives two dicts
    assert ds.count() == 300
    assert ds.delete_many([*ids[:100], missing]) == 100
    assert ds.count() == 200


def test_put_many_same_id_twice_keeps_last(ds: bagstore.Datastore) -> None:
    entity_id = bagstore.new_id()
    ds.put_many([{"id": entity_id, "v": 1}, {"id": entity_id, "v": 2}])
    assert ds.get(entity_id) == {"id": entity_id, "v": 2}


def test_entities_spread_over_shards_by_bucket(topo: Topology) -> None:
    ds = topo.open()
    ids = ds.put_many([{"n": i} for i in range(400)])
    status = ds.status()
    assert status["entities"] == 400
    assert all(s["entities"] > 40 for s in status["shards"])  # 4 shards, ~100 each
    assert [s["buckets"] for s in status["shards"]] == [256, 256, 256, 256]
    shard_of = ds.placement.shard_of_bucket
    for entity_id in ids[:50]:
        backend = ds.router.backends[shard_of[bucket_of(entity_id, 1024)]]
        assert backend.get_bodies("entities", [entity_id])


def test_buckets_of_is_bucket_of() -> None:
    keys = [b"", bytes(16), *(bytes(range(n)) for n in range(1, 40)), b"\xff" * 300]
    for buckets in (1, 7, 64, 1024):
        assert buckets_of(keys, buckets) == {k: bucket_of(k, buckets) for k in keys}


def test_reopen_sees_same_data_and_placement(topo: Topology) -> None:
    first = topo.open(buckets=64)
    ids = first.put_many([{"n": i} for i in range(50)])
    first.close()
    again = topo.open()
    assert again.placement.buckets == 64
    assert [e["n"] for e in again.get_many(ids)] == list(range(50))  # type: ignore[index]


def test_reopen_with_other_bucket_count_is_refused(topo: Topology) -> None:
    topo.open(buckets=64).close()
    with pytest.raises(bagstore.ConfigurationError, match="64 buckets"):
        topo.open(buckets=128)


def test_reopen_with_shards_in_other_order_is_refused(topo: Topology) -> None:
    topo.open().close()
    with pytest.raises(bagstore.ConfigurationError, match="catalog"):
        bagstore.Datastore(list(reversed(topo.urls)))


def test_several_kinds_share_the_store(topo: Topology) -> None:
    users = topo.open(kind="users")
    photos = topo.open(kind="photos")
    uid = users.put({"name": "ann"})
    pid = photos.put({"user": uid})
    assert users.get(pid) is None and photos.get(uid) is None
    assert users.get(uid) == {"name": "ann", "id": uid}


def test_threads_share_one_datastore(ds: bagstore.Datastore) -> None:
    errors: list[BaseException] = []
    ids: list[bytes] = []
    lock = threading.Lock()

    def work(t: int) -> None:
        try:
            for i in range(50):
                entity_id = ds.put({"t": t, "i": i})
                assert ds.get(entity_id) == {"t": t, "i": i, "id": entity_id}
                with lock:
                    ids.append(entity_id)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    assert len(set(ids)) == 300 and ds.count() == 300


def test_two_datastores_same_store_see_each_others_writes(topo: Topology) -> None:
    a, b = topo.open(), topo.open()
    entity_id = a.put({"v": 1})
    assert b.get(entity_id) == {"v": 1, "id": entity_id}
    b.put({"id": entity_id, "v": 2})
    assert a.get(entity_id) == {"v": 2, "id": entity_id}


def test_context_manager_closes(topo: Topology) -> None:
    with topo.open() as ds:
        entity_id = ds.put({"x": 1})
    with topo.open() as ds2:
        assert ds2.get(entity_id) == {"x": 1, "id": entity_id}


def test_embedded_open_creates_and_reopens(tmp_path: object) -> None:
    path = f"{tmp_path}/store"
    with bagstore.open(path, shards=2) as ds:
        entity_id = ds.put({"x": 1})
        assert len(ds.shards) == 2
    with bagstore.open(path) as ds:  # keeps the 2 shards it was made with
        assert len(ds.shards) == 2
        assert ds.get(entity_id) == {"x": 1, "id": entity_id}
    with pytest.raises(bagstore.ConfigurationError, match="has 2 shards"):
        bagstore.open(path, shards=3)


def test_parallel_fan_out_policy(tmp_path: Path) -> None:
    urls = [f"sqlite:///{tmp_path}/p_{i}.db" for i in range(3)]
    with bagstore.Datastore(urls) as ds:
        assert ds.router.parallel is False  # embedded files: one after another
        ids = ds.put_many([{"n": i} for i in range(60)])
    with bagstore.Datastore(urls, parallel=True) as ds:
        assert ds.router.parallel is True
        assert [e["n"] for e in ds.get_many(ids) if e is not None] == list(range(60))
    with pytest.raises(bagstore.ConfigurationError, match="parallel must be"):
        bagstore.Datastore(urls, parallel="yes")  # type: ignore[arg-type]
    with bagstore.Datastore(urls) as ds:
        assert ds.count() == 60


def test_mysqlclient_driver_round_trips(mysql_main: servers.MySQLAddress) -> None:
    pytest.importorskip("MySQLdb", reason="mysqlclient is optional (pip install mysqlclient)")
    name = servers.unique_name("drv")
    url = f"mysql://{mysql_main.user}@{mysql_main.host}:{mysql_main.port}/{name}?driver=mysqlclient"
    try:
        with bagstore.Datastore([url]) as ds:  # connect_timeout is whole seconds there
            entity = {"b": b"\x00\xff", "s": "bób ", "n": 2**70}
            entity_id = ds.put(entity)
            assert ds.get(entity_id) == entity
    finally:
        servers.drop_databases(
            mysql_main.host, mysql_main.port, [name], mysql_main.user, mysql_main.password
        )


def test_sqlite_writer_waits_for_a_lock_another_connection_holds(tmp_path: Path) -> None:
    ds = bagstore.open(tmp_path, shards=1)
    try:
        ds.put({"n": 0})
        with sqlite_write_lock_held(ds.router.backends[0].path) as events:
            entity_id = ds.put({"n": 1})  # waits for the lock instead of failing
            events.append("put")
        assert events == ["released", "put"]
        assert ds.get(entity_id) == {"id": entity_id, "n": 1}
    finally:
        ds.close()


def test_sqlite_lock_held_past_busy_timeout_is_a_clear_error(tmp_path: Path) -> None:
    import sqlite3

    from bagstore.backends.sqlite import SQLiteBackend

    path = str(tmp_path / "one.db")
    backend = SQLiteBackend(path, busy_timeout=0.2)
    try:
        backend.execute("CREATE TABLE t (n INTEGER)")
        backend.execute("INSERT INTO t VALUES (1)")
        holder = sqlite3.connect(path, isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")
        for attempt in (1, 2):  # the kept cursor's statement, then run()'s unit of work
            t0 = time.monotonic()
            with pytest.raises(
                bagstore.ShardTimeout, match=r"stayed locked .* 0.2 s \(busy_timeout\)"
            ):
                if attempt == 1:
                    backend.execute("INSERT INTO t VALUES (2)")
                else:
                    backend.run(lambda conn: conn.execute("INSERT INTO t VALUES (2)"))
            waited = time.monotonic() - t0
            # SQLite's busy handler waited busy_timeout; bagstore did not wait it again
            assert 0.19 <= waited < 0.38, waited
        assert backend.fetchall("SELECT n FROM t") == [(1,)]  # reads go on meanwhile
        holder.execute("ROLLBACK")
        holder.close()
        backend.execute("INSERT INTO t VALUES (3)")
        assert backend.fetchall("SELECT n FROM t ORDER BY n") == [(1,), (3,)]
    finally:
        backend.close()


def test_sqlite_busy_after_the_handler_waited_is_told_from_one_it_skipped(
    tmp_path: Path,
) -> None:
    """A plain SQLITE_BUSY comes after SQLite's busy handler waited
    busy_timeout: raised at once.  The extended codes come without a wait
    (a stale WAL snapshot, a WAL being recovered): tried again."""
    import sqlite3

    from bagstore.backends.sqlite import SQLiteBackend

    def busy(code: int) -> sqlite3.OperationalError:
        exc = sqlite3.OperationalError("database is locked")
        exc.sqlite_errorcode = code
        return exc

    waits = SQLiteBackend(str(tmp_path / "a.db"), busy_timeout=0.5)
    assert waits._waited(busy(sqlite3.SQLITE_BUSY))
    assert not waits._waited(busy(sqlite3.SQLITE_BUSY_SNAPSHOT))
    assert not waits._waited(busy(sqlite3.SQLITE_BUSY_RECOVERY))
    assert not waits._waited(ValueError("not SQLite's"))
    no_handler = SQLiteBackend(str(tmp_path / "b.db"), busy_timeout=0)
    assert not no_handler._waited(busy(sqlite3.SQLITE_BUSY))


def test_sqlite_read_together_attaches_and_detaches_files(tmp_path: Path) -> None:
    from bagstore.backends.sqlite import SQLiteBackend

    backends = [SQLiteBackend(str(tmp_path / f"f{i}.db")) for i in range(19)]
    try:
        for n, b in enumerate(backends):
            b.execute("CREATE TABLE t (n INTEGER)")
            b.execute("INSERT INTO t VALUES (?)", (n,))
        lead = backends[0]

        def read(group: list[SQLiteBackend]) -> list[int]:
            q = lead.dialect.q
            parts = [f"SELECT n FROM {q(b.schema or '')}.t" for b in group]
            sql = lead.dialect.union_all_sql(parts)
            return sorted(row[0] for row in lead.read_together(sql, (), group))

        first, second = backends[:10], [lead, *backends[10:]]
        for _ in range(2):  # ten files attached, then nine of them swapped for others
            assert read(first) == list(range(10))
            assert read(second) == [0, *range(10, 19)]
        with pytest.raises(bagstore.ConfigurationError, match="cannot be read together"):
            lead.read_together("SELECT 1", (), [lead, SQLiteBackend(":memory:")])
        gone = SQLiteBackend(str(tmp_path / "never_created.db"))
        with pytest.raises(bagstore.BackendError, match="unable to open"):
            lead.read_together("SELECT 1", (), [lead, gone])
        assert not (tmp_path / "never_created.db").exists()  # not created by the read
        assert read(first) == list(range(10))  # the reading connection still works
    finally:
        for b in backends:
            b.close()


def test_sqlite_point_reads_hold_no_snapshot_open(tmp_path: Path) -> None:
    """A point read keeps its cursor for the next one (SQLite): it must leave
    no statement open, or the file's WAL could not be checkpointed while the
    thread idles, and its next read would see an old snapshot."""
    import sqlite3

    with bagstore.open(str(tmp_path / "store"), shards=1) as ds:
        entity_id = ds.put({"n": 1})
        (path,) = (b.path for b in ds.router.backends)
        assert ds.get(entity_id) == {"n": 1, "id": entity_id}  # found
        assert ds.get(bytes(16)) is None  # and not found
        other = sqlite3.connect(path, isolation_level=None, timeout=0.2)
        try:
            other.execute("CREATE TABLE scratch (n INTEGER)")  # a frame past the reads
            # TRUNCATE fails (busy = 1) while a reader holds an older snapshot
            assert other.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0] == 0
        finally:
            other.close()
        ds.put({"id": entity_id, "n": 2})  # through bagstore, on the same thread
        assert ds.get(entity_id) == {"n": 2, "id": entity_id}
