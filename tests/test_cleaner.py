"""The Cleaner: online backfill, resumable after SIGKILL, and repair after crashes."""

from __future__ import annotations

import binascii
import json
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import bagstore
from bagstore import testing
from bagstore.cleaner import Throttle
from tests import servers
from tests.conftest import Topology

link_idx = bagstore.Index(table="index_link", properties=["link"], shard_on="link")
user_idx = bagstore.Index(table="index_user_id", properties=["user_id"], shard_on="user_id")
tags_idx = bagstore.Index(table="index_tags", properties=["tags"])


def consistent(ds: bagstore.Datastore) -> bool:
    report = ds.check()
    return (report["missing"], report["stale"]) == (0, 0)


def test_backfill_life_cycle(topo: Topology) -> None:
    ds = topo.open(indexes=[user_idx])
    old = ds.put_many([{"user_id": b"u%d" % (i % 5), "link": f"l{i % 40}"} for i in range(300)])
    assert ds.add_index(link_idx) == "building"
    with pytest.raises(bagstore.IndexNotReady):
        link_idx.get_all(ds, link="l3")
    during = ds.put({"link": "l3"})  # indexed by its writer at once
    assert [e["id"] for e in link_idx.get_all(ds, link="l3", allow_partial=True)] == [during]
    seen: list[tuple[int, int]] = []
    stats = bagstore.Cleaner(ds, batch=50).backfill(
        "index_link", progress=lambda d, t: seen.append((d, t))
    )
    assert stats.written == 300 and stats.entities == 301
    assert seen[-1][0] == seen[-1][1] == 301
    assert ds.indexes()["index_link"][1] == "ready"
    found = link_idx.get_all(ds, link="l3")
    assert sorted(e["id"] for e in found) == sorted([during, *[old[i] for i in range(3, 300, 40)]])
    assert consistent(ds)
    again = bagstore.Cleaner(ds, settle=0).backfill("index_link")  # harmless
    assert (again.written, again.removed) == (0, 0)
    assert consistent(ds)


@pytest.mark.parametrize("duty", [0.0, 0.2])
def test_duty_runs_one_batch_at_a_time_per_server(
    topo: Topology, duty: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a duty, the workers of one server (the 4 databases of the MariaDB)
    take turns, batch and pause; duty=0 reads every shard at once, and so does
    any duty on SQLite, whose files are written side by side."""
    ds = topo.open()
    ds.put_many([{"link": f"l{i}"} for i in range(400)])
    ds.add_index(link_idx)
    lock = threading.Lock()
    inside = [0, 0]  # now, most at once

    scan = type(ds.router.backends[0]).scan_bodies

    def slow_scan(backend: object, *args: object, **kwargs: object) -> object:
        with lock:
            inside[0] += 1
            inside[1] = max(inside[1], inside[0])
        try:
            time.sleep(0.01)  # long enough for workers running side by side to meet
            return scan(backend, *args, **kwargs)  # type: ignore[arg-type]
        finally:
            with lock:
                inside[0] -= 1

    monkeypatch.setattr(type(ds.router.backends[0]), "scan_bodies", slow_scan)
    stats = bagstore.Cleaner(ds, batch=20, duty=duty, settle=0).backfill("index_link")
    assert stats.written == 400 and consistent(ds)
    if duty and topo.name != "sqlite":
        assert inside[1] == 1
    else:
        assert inside[1] >= 2  # shards read side by side


def test_other_process_learns_of_new_index_within_refresh(topo: Topology) -> None:
    writer = topo.open(refresh_interval=0.2)
    admin = topo.open()
    writer.put({"link": "before"})
    admin.add_index(link_idx)
    time.sleep(0.3)
    new = writer.put({"link": "after"})  # the writer re-read the catalog
    assert [e["id"] for e in link_idx.get_all(admin, link="after", allow_partial=True)] == [new]


def test_backfill_under_concurrent_updates_leaves_no_stale_rows(topo: Topology) -> None:
    ds = topo.open()
    ids = ds.put_many([{"link": f"a{i}"} for i in range(400)])
    ds.add_index(link_idx)
    stop = threading.Event()

    def churn() -> None:
        n = 0
        while not stop.is_set():
            ds.put({"id": ids[n % 400], "link": f"b{n}"})
            n += 1

    t = threading.Thread(target=churn)
    t.start()
    try:
        bagstore.Cleaner(ds, batch=20, duty=0, settle=0).backfill("index_link")
    finally:
        stop.set()
        t.join()
    assert consistent(ds)


def test_backfill_keeps_rows_of_an_entity_moved_during_its_batch(
    topo: Topology, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An entity whose bucket moves to another shard between the backfill's
    read of a batch and its check of that batch is not gone: its rows stay."""
    ds = topo.open()
    ids = ds.put_many([{"link": f"m{i}"} for i in range(30)])
    ds.add_index(link_idx)
    moved = ids[7]
    bucket = ds.bucket_of_id(moved)
    assert bucket is not None
    source = ds.placement.shard_of_bucket[bucket]
    target = (source + 1) % len(ds.router.backends)
    backend = ds.router.backends[source]
    original = backend.stamps_text
    done: list[bool] = []

    def move_then_read(*args: Any, **kwargs: Any) -> Any:
        if not done:  # once, after the batch holding `moved` was read and indexed
            done.append(True)
            ds.move_buckets([bucket], to=target, grace=0)
        return original(*args, **kwargs)

    monkeypatch.setattr(backend, "stamps_text", move_then_read)
    bagstore.Cleaner(ds, batch=50, duty=0, settle=0).backfill("index_link")
    assert done
    assert [e["id"] for e in link_idx.get_all(ds, link="m7")] == [moved]
    assert consistent(ds)


def test_repair_keeps_rows_of_an_entity_moved_during_its_batch(
    topo: Topology, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same race for repair: an entity moved away after repair read its
    batch is reconciled where it is now, not taken for deleted."""
    ds = topo.open(indexes=[link_idx, user_idx])
    ids = ds.put_many([{"link": f"r{i}", "user_id": b"u%d" % i} for i in range(30)])
    moved = ids[11]
    bucket = ds.bucket_of_id(moved)
    assert bucket is not None
    source = ds.placement.shard_of_bucket[bucket]
    backend = ds.router.backends[source]
    original = backend.versions
    done: list[bool] = []

    def move_then_read(*args: Any, **kwargs: Any) -> Any:
        if not done:
            done.append(True)
            ds.move_buckets([bucket], to=(source + 1) % len(ds.router.backends), grace=0)
        return original(*args, **kwargs)

    monkeypatch.setattr(backend, "versions", move_then_read)
    stats = bagstore.Cleaner(ds, batch=100, duty=0).repair(sweep=False)
    assert done and stats.removed == 0
    assert [e["id"] for e in link_idx.get_all(ds, link="r11")] == [moved]
    assert [e["id"] for e in user_idx.get_all(ds, user_id=b"u11")] == [moved]
    assert consistent(ds)


def test_backfill_does_not_chase_entities_added_while_it_runs(topo: Topology) -> None:
    ds = topo.open()
    ds.put_many([{"link": f"a{i}"} for i in range(400)])
    ds.add_index(link_idx)
    stop = threading.Event()
    added = [0]

    def insert() -> None:  # new entities: the writer indexes them itself
        deadline = time.monotonic() + 30  # a backfill that chases them ends too
        while not stop.is_set() and time.monotonic() < deadline:
            ds.put({"link": f"new{added[0]}"})
            added[0] += 1

    def hold_the_start(done: int, total: int) -> None:
        # Called once the backfill has read where each shard ends, before it
        # reads any entity: the writer adds its hundred first, however slowly
        # its puts go on a busy machine (a fixed ~1 s scan left it 96 once).
        while not held and added[0] - before < 100 and t.is_alive():
            time.sleep(0.01)
        held.append(True)

    held: list[bool] = []
    t = threading.Thread(target=insert)
    t.start()
    try:
        time.sleep(0.05)
        before = added[0]
        # Slowed to ~1 s so that the writer adds hundreds meanwhile, too.
        cleaner = bagstore.Cleaner(ds, batch=10, duty=0, settle=0, max_rate=400)
        stats = cleaner.backfill("index_link", progress=hold_the_start)
        after = added[0]
    finally:
        stop.set()
        t.join()
    assert after - before >= 100  # the writer kept adding while it ran
    # It scans what there was when it started (and a few puts that land while
    # it reads where each shard ends), not what came while it ran.
    assert stats.entities - 400 - before <= (after - before) / 2
    assert ds.indexes()["index_link"][1] == "ready"
    assert consistent(ds)


def test_repair_fixes_every_failpoint_crash(topo: Topology) -> None:
    ds = topo.open(indexes=[link_idx, user_idx, tags_idx])
    ids = ds.put_many(
        [{"link": f"l{i}", "user_id": b"u", "tags": ["x", f"t{i}"]} for i in range(20)]
    )
    for i, point in enumerate(["put.after_entity", "put.after_index_delete", "put.after_entity"]):
        with testing.failpoint(point), pytest.raises(testing.SimulatedCrash):
            ds.put({"id": ids[i], "link": f"new{i}", "user_id": b"v", "tags": ["y"]})
    with testing.failpoint("delete.after_entity"), pytest.raises(testing.SimulatedCrash):
        ds.delete(ids[10])
    report = ds.check()
    assert report["missing"] > 0 and report["stale"] > 0
    assert ds.check() == report  # check() changes nothing
    stats = bagstore.Cleaner(ds).repair()
    assert stats.written == report["missing"] and stats.removed == report["stale"]
    assert consistent(ds)
    assert [e["id"] for e in link_idx.get_all(ds, link="new1")] == [ids[1]]


def test_follow_repairs_within_seconds(topo: Topology) -> None:
    ds = topo.open(indexes=[link_idx])
    cleaner = bagstore.Cleaner(ds)
    runner = threading.Thread(target=lambda: cleaner.follow(interval=0.1, margin=1.0))
    runner.start()
    try:
        entity_id = ds.put({"link": "old"})
        with testing.failpoint("put.after_entity"), pytest.raises(testing.SimulatedCrash):
            ds.put({"id": entity_id, "link": "new"})
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not consistent(ds):
            time.sleep(0.1)
        assert consistent(ds)
        assert [e["id"] for e in link_idx.get_all(ds, link="new")] == [entity_id]
    finally:
        cleaner.stop()
        runner.join()


def test_backfill_killed_by_sigkill_resumes_from_checkpoint(topo: Topology) -> None:
    ds = topo.open()
    ds.put_many([{"link": f"l{i}"} for i in range(3000)])
    ds.add_index(link_idx)
    proc = servers.spawn_python(
        f"""
        import bagstore
        ds = bagstore.Datastore({topo.urls!r})
        bagstore.Cleaner(ds, batch=50, max_rate=1500, settle=0).backfill("index_link")
        """
    )
    cleaner = bagstore.Cleaner(ds, settle=0)
    names = [f"backfill:entities:index_link:{s}" for s in range(4)]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if sum(cleaner.checkpoints.get(n) is not None for n in names) >= 4:
            break
        time.sleep(0.05)
    time.sleep(0.3)
    proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate()
    marks = [cleaner.checkpoints.get(n) for n in names]
    assert all(m is not None for m in marks), err
    assert ds.indexes()["index_link"][1] == "building"
    stats = cleaner.backfill("index_link")
    assert 0 < stats.entities < 3000  # resumed, not restarted
    assert ds.indexes()["index_link"][1] == "ready"
    assert consistent(ds)
    assert len(link_idx.get_all(ds, link__gte="l")) == 3000


def test_writers_killed_by_sigkill_lose_no_acknowledged_write(topo: Topology) -> None:
    topo.open(indexes=[link_idx, user_idx])  # registers the indexes
    writer = f"""
        import os, sys, random
        import bagstore
        idx = [bagstore.Index(table="index_link", properties=["link"], shard_on="link"),
               bagstore.Index(table="index_user_id", properties=["user_id"], shard_on="user_id")]
        ds = bagstore.Datastore({topo.urls!r}, indexes=idx)
        mine = []
        n = 0
        while True:
            n += 1
            if mine and random.random() < 0.3:
                entity_id = random.choice(mine)
                link = f"upd{{os.getpid()}}-{{n}}"
                ds.put({{"id": entity_id, "link": link, "user_id": b"w2", "n": n}})
            elif mine and random.random() < 0.05:
                entity_id = mine.pop()
                print("d", entity_id.hex(), flush=True)  # a delete in flight
                ds.delete(entity_id)
                print("D", entity_id.hex(), flush=True)
                continue
            else:
                link = f"new{{os.getpid()}}-{{n}}"
                entity_id = ds.put({{"link": link, "user_id": b"w1", "n": n}})
                mine.append(entity_id)
            print("P", entity_id.hex(), n, flush=True)
        """
    procs = [servers.spawn_python(writer) for _ in range(3)]
    # Until the writers are well under way: not a fixed sleep, since a loaded
    # machine starts Python processes slowly.
    watcher = topo.open()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and watcher.count() < 150:
        time.sleep(0.1)
    watcher.close()
    for p in procs:
        p.send_signal(signal.SIGKILL)
    acked: dict[bytes, int | None] = {}
    in_flight: set[bytes] = set()  # deletes begun and not acknowledged when killed
    history: dict[bytes, list[str]] = {}
    for k, p in enumerate(procs):
        out, _ = p.communicate()
        for line in out.splitlines():
            if len(line.split()) >= 2:
                history.setdefault(bytes.fromhex(line.split()[1][:32].ljust(32, "0")), []).append(
                    f"writer {k}: {line}"
                )
            parts = line.split()
            if parts[0] == "P" and len(parts) == 3:
                acked[bytes.fromhex(parts[1])] = int(parts[2])
            elif parts[0] == "d" and len(parts) == 2:
                in_flight.add(bytes.fromhex(parts[1]))
            elif parts[0] == "D" and len(parts) == 2:
                acked[bytes.fromhex(parts[1])] = None
                in_flight.discard(bytes.fromhex(parts[1]))
    assert len(acked) > 20
    fresh = topo.open()
    assert len(in_flight) <= len(procs)  # at most one unacknowledged delete each
    got = fresh.get_many(list(acked))
    for (entity_id, n), entity in zip(acked.items(), got, strict=True):
        if n is None:
            assert entity is None
        elif entity is None:  # only a delete begun before the kill may have removed it
            on = [b.name for b in fresh.router.backends if b.get_bodies(fresh.kind, [entity_id])]
            assert entity_id in in_flight, (
                f"{entity_id.hex()} (n={n}) lost; on shards {on}; {history.get(entity_id)}"
            )
        else:  # the acknowledged write, or a later one not yet acknowledged
            assert entity["n"] >= n
    stats = bagstore.Cleaner(fresh).repair()
    assert stats.entities > 0
    assert consistent(fresh)


def test_friendfeed_example_on_two_mariadb_servers(
    mysql_main: servers.MySQLAddress,
    mysql_second: servers.MariaDBServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    database = servers.unique_name("ff")
    monkeypatch.setenv("BAGSTORE_MYSQL_DATABASE", database)
    try:
        # As in FriendFeed's post, with only the module name changed.
        user_id_index = bagstore.Index(
            table="index_user_id", properties=["user_id"], shard_on="user_id"
        )
        link_index = bagstore.Index(table="index_link", properties=["link"], shard_on="link")
        datastore = bagstore.DataStore(
            mysql_shards=[f"127.0.0.1:{mysql_main.port}", f"127.0.0.1:{mysql_second.port}"],
            indexes=[user_id_index],
        )
        new_entity = {
            "id": binascii.a2b_hex("71f0c4d2291844cca2df6f486e96e37c"),
            "user_id": binascii.a2b_hex("f48b0440ca0c4f66991c4d5f6a078eaf"),
            "feed_id": binascii.a2b_hex("f48b0440ca0c4f66991c4d5f6a078eaf"),
            "title": "We just launched a new backend system for FriendFeed!",
            "link": "http://friendfeed.com/e/71f0c4d2-2918-44cc-a2df-6f486e96e37c",
            "published": 1235697046,
            "updated": 1235697046,
        }
        datastore.put(new_entity)
        entity = datastore.get(binascii.a2b_hex("71f0c4d2291844cca2df6f486e96e37c"))
        entities = user_id_index.get_all(
            datastore, user_id=binascii.a2b_hex("f48b0440ca0c4f66991c4d5f6a078eaf")
        )
        assert entity == new_entity and entities == [new_entity]
        # The link index arrives later, on a store that already holds data.
        datastore.close()
        datastore = bagstore.DataStore(
            mysql_shards=[f"127.0.0.1:{mysql_main.port}", f"127.0.0.1:{mysql_second.port}"],
            indexes=[user_id_index, link_index],
        )
        bagstore.Cleaner(datastore).backfill("index_link")
        assert link_index.get_all(datastore, link=new_entity["link"]) == [new_entity]
        status = datastore.status()
        assert [s["name"].split("@")[1] for s in status["shards"]] == [
            f"127.0.0.1:{mysql_main.port}/{database}",
            f"127.0.0.1:{mysql_second.port}/{database}",
        ]
        datastore.close()
    finally:
        servers.drop_databases(mysql_main.host, mysql_main.port, [database])
        servers.drop_databases(mysql_second.host, mysql_second.port, [database])


def test_cleaner_refuses_unknown_and_retired_indexes(topo: Topology) -> None:
    ds = topo.open(indexes=[link_idx])
    with pytest.raises(bagstore.ConfigurationError, match="no index"):
        bagstore.Cleaner(ds).backfill("index_nothing")
    ds.retire_index("index_link")
    with pytest.raises(bagstore.ConfigurationError, match="retired"):
        bagstore.Cleaner(ds).backfill("index_link")
    with pytest.raises(bagstore.ConfigurationError, match="batch"):
        bagstore.Cleaner(ds, batch=0)
    for duty in (-0.1, 11, "0.5", True):
        with pytest.raises(bagstore.ConfigurationError, match="duty"):
            bagstore.Cleaner(ds, duty=duty)  # type: ignore[arg-type]
    for rate in (0, -5, "100"):
        with pytest.raises(bagstore.ConfigurationError, match="max_rate"):
            bagstore.Cleaner(ds, max_rate=rate)  # type: ignore[arg-type]
    assert ds.indexes()["index_link"][1] == "retired"  # nothing changed


def test_stats_are_plain_numbers() -> None:
    stats = bagstore.CleanStats(written=2, removed=1, entities=3, seconds=0.5)
    assert json.loads(json.dumps(stats.as_dict())) == {
        "written": 2,
        "removed": 1,
        "entities": 3,
        "seconds": 0.5,
    }


def test_backfill_waits_for_writers_to_learn_of_the_index(topo: Topology) -> None:
    writer = topo.open(refresh_interval=0.5)
    admin = topo.open(refresh_interval=0.5)
    entity_id = writer.put({"link": "old"})
    writer.registry()  # the writer's view of the catalog: no index_link
    admin.add_index(link_idx)
    # An update by a writer that does not know the index yet ...
    writer.put({"id": entity_id, "link": "new"})
    stats = bagstore.Cleaner(admin).backfill("index_link")  # settles 1.5 s first
    assert stats.seconds < 5
    assert consistent(admin)
    assert [e["id"] for e in link_idx.get_all(admin, link="new")] == [entity_id]


def test_failed_put_many_keeps_claims_of_entities_it_stored(
    topo: Topology, monkeypatch: pytest.MonkeyPatch
) -> None:
    email = bagstore.Index(table="index_email", properties=["email"], unique=True)
    ds = topo.open(indexes=[email], buckets=8)
    entities = [{"id": bagstore.new_id(), "email": f"{i}@x"} for i in range(40)]
    shard_of = ds.placement.shard_of_bucket
    broken = shard_of[ds.placer.entity_bucket(entities[0], entities[0]["id"])]
    backend = ds.router.backends[broken]

    def fail(*args: object, **kwargs: object) -> object:
        raise bagstore.ShardUnavailable("shard down (injected)", shard=backend.name)

    monkeypatch.setattr(backend, "put_entities", fail)
    with pytest.raises(bagstore.ShardUnavailable):
        ds.put_many([dict(e) for e in entities])
    monkeypatch.undo()
    stored = [e for e in entities if ds.get(e["id"]) is not None]
    assert 0 < len(stored) < 40
    report = ds.check()
    assert report["missing"] == 0  # stored entities kept their unique rows
    with pytest.raises(bagstore.DuplicateValue):
        ds.put({"email": stored[0]["email"]})
    ds.put({"email": next(e for e in entities if e not in stored)["email"]})


def test_throttle_pauses_in_proportion_and_backs_off_when_the_database_slows() -> None:
    t = Throttle(duty=0.5)
    for _ in range(50):  # steady batches: duty x batch time, nothing more
        assert t.pause_after(1000, 0.02) == pytest.approx(0.01)
    # a sudden, lasting 5x slowdown (live traffic): extra pauses within a few batches
    pauses = [t.pause_after(1000, 0.1) for _ in range(8)]
    assert pauses[-1] > 0.1 * 0.5 + 0.05
    # back to normal: the extra pause fades away
    for _ in range(40):
        last = t.pause_after(1000, 0.02)
    assert last == pytest.approx(0.01, abs=1e-4)


def test_throttle_takes_slowly_growing_inserts_for_the_usual_pace() -> None:
    """A long backfill's batches slow down as the tables grow (here 10x over
    1,000 batches): that is not a busy database, and costs no extra pause."""
    t = Throttle(duty=0.0)
    extra = [t.pause_after(1000, 0.01 * 10 ** (n / 1000)) for n in range(1000)]
    assert max(extra) == 0.0


def test_throttle_keeps_under_max_rate() -> None:
    t = Throttle(duty=0.0, max_rate=10_000)
    assert t.pause_after(1000, 0.0) == pytest.approx(0.1, abs=0.01)  # 1,000 rows: 0.1 s


def _wal_frames(db: Path) -> tuple[int, int]:
    """``(frames in the WAL, frames already copied into the database)``, read
    from the WAL index (the ``-shm`` file) without checkpointing anything."""
    header = (db.parent / (db.name + "-shm")).read_bytes()[:100]
    return int.from_bytes(header[16:20], sys.byteorder), int.from_bytes(
        header[96:100], sys.byteorder
    )


def test_backfill_checkpoints_sqlite_wal_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A live writer's commit must not inherit the backfill's pages to checkpoint.
    ds = bagstore.open(tmp_path, shards=2)
    try:
        ds.put_many([{"link": f"l{i}"} for i in range(300)])
        ds.add_index(link_idx)
        inserts: list[str] = []
        steps: list[str] = []
        for backend in ds.router.backends:
            insert, step = backend.insert_index_rows, backend.after_bulk_step

            def counted_insert(*a: Any, _f: Any = insert, _n: str = backend.name, **k: Any) -> Any:
                inserts.append(_n)
                return _f(*a, **k)

            def counted_step(_f: Any = step, _n: str = backend.name) -> None:
                steps.append(_n)
                _f()

            monkeypatch.setattr(backend, "insert_index_rows", counted_insert)
            monkeypatch.setattr(backend, "after_bulk_step", counted_step)
        bagstore.Cleaner(ds, settle=0, batch=50).backfill("index_link")
        assert len(inserts) >= 6  # 300 entities, 50 a batch
        assert sorted(steps) == sorted(inserts)  # every insert is followed by a checkpoint
        assert len(link_idx.get_all(ds, link__gte="l")) == 300
        # and the checkpoint copies every frame of the WAL into the database
        db = Path(ds.router.backends[1].path)
        ds.put_many([{"link": f"m{i}"} for i in range(50)])
        frames, copied = _wal_frames(db)
        assert frames > copied  # commits leave their pages in the WAL
        ds.router.backends[1].after_bulk_step()
        frames, copied = _wal_frames(db)
        assert frames == copied > 0
    finally:
        ds.close()


def test_throttle_without_backoff_pauses_in_proportion_only() -> None:
    # A bucket move's steps vary in size: a 3-row step's time per row is no sign
    # of a busy database.
    t = Throttle(duty=1.0, adaptive=False)
    assert t.pause_after(100, 0.010) == pytest.approx(0.010)
    assert t.pause_after(3, 0.004) == pytest.approx(0.004)
    assert t.pause_after(3, 0.004) == pytest.approx(0.004)
    assert t.extra == 0.0
    adaptive = Throttle(duty=1.0)
    adaptive.pause_after(100, 0.010)
    adaptive.pause_after(3, 0.004)
    assert adaptive.pause_after(3, 0.004) > 0.004  # taken for a slow database
