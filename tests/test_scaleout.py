"""Scale-out while serving: add a shard, move buckets, fence stale processes."""

from __future__ import annotations

import os
import re
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import bagstore
from bagstore import keys
from bagstore.scaleout import Mover
from bagstore.sharding.hashing import bucket_of
from tests import servers
from tests.conftest import Topology, _mysql_topology, _need, buckets_of_rows

link_idx = bagstore.Index(table="index_link", properties=["link"], shard_on="link")


class Growth:
    """Two shards to start with, and the URL of a third on another server."""

    def __init__(self, topo: Topology, extra: str) -> None:
        self.topo = topo
        self.extra = extra

    def open(self, **kwargs: object) -> bagstore.Datastore:
        return self.topo.open(buckets=64, **kwargs)  # type: ignore[arg-type]


@pytest.fixture(params=["sqlite", "mysql2"])
def growth(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Growth]:
    if request.param == "sqlite":
        topo = Topology("sqlite", [f"sqlite:///{tmp_path}/s{i}.db" for i in range(2)])
        g = Growth(topo, f"sqlite:///{tmp_path}/new.db")
        yield g
        topo.close()
        return
    main = request.getfixturevalue("mysql_main")
    second: servers.MariaDBServer = request.getfixturevalue("mysql_second")
    topo = _mysql_topology("g", [(main, 2)])
    extra_db = servers.unique_name("gx")
    g = Growth(topo, f"mysql://root@127.0.0.1:{second.port}/{extra_db}")
    yield g
    topo.close()
    servers.drop_databases(second.host, second.port, [extra_db])


def rows_per_shard(ds: bagstore.Datastore, table: str) -> list[int]:
    return [b.count(table) for b in ds.router.backends]


def assert_placed(ds: bagstore.Datastore) -> None:
    """Every entity sits on the shard its bucket is placed on, and nowhere else."""
    shard_of = ds.placement.shard_of_bucket
    for no, backend in enumerate(ds.router.backends):
        for (entity_id,) in backend.fetchall("SELECT id FROM entities"):
            assert shard_of[bucket_of(bytes(entity_id), 64)] == no


def test_add_shard_and_rebalance_under_writes(growth: Growth) -> None:
    ds = growth.open(indexes=[link_idx])
    ds.put_many([{"link": f"l{i % 50}", "n": i} for i in range(600)])
    acked: dict[bytes, int] = {}
    stop = threading.Event()
    errors: list[BaseException] = []
    writer_ds = growth.open(indexes=[link_idx], refresh_interval=0.5)

    def writer() -> None:
        n = 0
        try:
            while not stop.is_set():
                n += 1
                entity_id = writer_ds.put({"link": f"w{n % 30}", "n": n})
                acked[entity_id] = n
        except BaseException as exc:  # reported below
            errors.append(exc)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        time.sleep(0.2)
        assert ds.add_shard(growth.extra) == 2
        stats = ds.rebalance(grace=0.6)
    finally:
        stop.set()
        thread.join()
    assert errors == []
    assert stats.buckets == 21  # 64 buckets: 32+32 -> 22+21+21
    assert len(acked) > 10
    fresh = growth.open(indexes=[link_idx])
    assert [s["buckets"] for s in fresh.status()["shards"]] == [22, 21, 21]
    got = fresh.get_many(list(acked))
    assert all(e is not None and e["n"] == acked[e["id"]] for e in got)
    assert fresh.count() == 600 + len(acked)
    assert rows_per_shard(fresh, "entities")[2] > 0  # rows on the new server
    assert_placed(fresh)  # and none left behind on the sources
    report = fresh.check()
    assert (report["missing"], report["stale"]) == (0, 0), report
    assert len(link_idx.get_all(fresh, link__gte="w")) == len(acked)


def test_stale_process_is_fenced(growth: Growth) -> None:
    stale = growth.open(refresh_interval=3600)  # never refreshes by itself
    admin = growth.open()
    entity_id = stale.put({"v": 1})
    bucket = bucket_of(entity_id, 64)
    source = stale.placement.shard_of_bucket[bucket]
    admin.add_shard(growth.extra)
    admin.move_buckets([bucket], to=2, grace=0)
    assert stale.placement.shard_of_bucket[bucket] == source  # stale view
    stale.put({"id": entity_id, "v": 2})  # refused by the source, retried
    assert stale.placement.shard_of_bucket[bucket] == 2
    assert admin.router.backends[source].get_bodies("entities", [entity_id]) == {}
    assert admin.get(entity_id) == {"id": entity_id, "v": 2}


def test_a_refused_write_rereads_only_its_buckets(
    growth: Growth, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refused by a shard that let a bucket go, a process reads where that
    bucket is now (not the whole placement: that costs every write milliseconds
    during a move), and still reads everything at its next timed refresh."""
    admin = growth.open()
    admin.add_shard(growth.extra)
    stale = growth.open(refresh_interval=3600)  # knows all three shards
    entity_id = stale.put({"v": 1})
    bucket = bucket_of(entity_id, 64)
    version = stale.placement.version
    admin.move_buckets([bucket], to=2, grace=0)
    whole: list[int] = []
    original = stale.catalog.read_placement
    monkeypatch.setattr(stale.catalog, "read_placement", lambda *a: whole.append(1) or original(*a))
    counts = stale.stats()["placement"]
    stale.put({"id": entity_id, "v": 2})  # refused by the source, retried on shard 2
    assert whole == []
    after = stale.stats()["placement"]
    assert {k: after[k] - counts[k] for k in after} == {
        "refused": 1,
        "frozen_waits": 0,
        "full_reads": 0,
        "bucket_reads": 1,
    }
    assert stale.placement.shard_of_bucket[bucket] == 2
    assert stale.placement.version == version  # so the next timed refresh reads all
    assert admin.get(entity_id) == {"id": entity_id, "v": 2}
    assert_placed(admin)
    stale.router.checked_at = float("-inf")  # the refresh interval has passed (whatever the clock)
    assert stale.refresh_placement().version == admin.placement.version
    assert whole == [1]
    assert stale.stats()["placement"]["full_reads"] == after["full_reads"] + 1


def test_an_incomplete_bucket_map_is_refused(topo: Topology) -> None:
    """The catalog's bucket map is read in one statement on MariaDB: a row
    missing anywhere (first, last, in between) is still told, not misread."""
    ds = topo.open()
    catalog = ds.catalog
    n = ds.placement.buckets
    assert catalog.read_placement().shard_of_bucket == ds.placement.shard_of_bucket
    for bucket in (0, n // 2, n - 1):
        shard = ds.placement.shard_of_bucket[bucket]
        catalog.backend.delete_where("bagstore_buckets", {"bucket": bucket})
        with pytest.raises(bagstore.ConfigurationError, match="placement is incomplete"):
            catalog.read_placement()
        catalog.backend.insert_ignore("bagstore_buckets", ("bucket", "shard_no"), [(bucket, shard)])
        assert catalog.read_placement().shard_of_bucket == ds.placement.shard_of_bucket


def test_an_index_and_a_kind_registered_during_a_move_are_moved_too(
    growth: Growth, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The copy made while writes go on uses the kinds and indexes as they were
    when the move began; the frozen sync reads them again, so rows of an index
    or a kind registered in between move with the bucket."""
    admin = growth.open()
    admin.add_shard(growth.extra)
    # (a tag none of the candidates below can equal: a rewrite that keeps the
    # value writes no row for a building index, which leaves it to the backfill)
    entity_id = admin.put({"v": 1, "tag": "before"})
    bucket = bucket_of(entity_id, 64)
    tag_idx = bagstore.Index(table="index_tag_late", properties=["tag"])
    # a tag whose index row lives in the moving bucket too
    tag = next(
        t
        for t in (f"t{n}" for n in range(100_000))
        if next(iter(tag_idx.rows_for({"tag": t}, entity_id, 64))).bucket == bucket
    )
    photos: list[bytes] = []
    original = Mover._sync
    calls: list[bool] = []

    def sync(self: Mover, *args: object, **kwargs: object) -> None:
        if not calls:  # before the first, paced copy: register, and write
            late = growth.open()
            late.add_index(tag_idx)
            late.put({"id": entity_id, "v": 2, "tag": tag})
            kind = growth.open(kind="photos")
            while not photos:  # a photo in the moving bucket, of a new kind
                pid = bagstore.new_id()
                if bucket_of(pid, 64) == bucket:
                    photos.append(kind.put({"id": pid, "p": 1}))
        calls.append(True)
        original(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Mover, "_sync", sync)
    admin.move_buckets([bucket], to=2, grace=0)
    fresh = growth.open(indexes=[tag_idx])
    assert fresh.placement.shard_of_bucket[bucket] == 2
    assert fresh.get(entity_id) == {"id": entity_id, "v": 2, "tag": tag}
    assert growth.open(kind="photos").get(photos[0]) == {"id": photos[0], "p": 1}
    assert_placed(fresh)
    for no, backend in enumerate(fresh.router.backends):  # the row lives in the moved bucket
        rows = backend.fetchall("SELECT entity_id FROM index_tag_late")
        assert [bytes(r[0]) for r in rows] == ([entity_id] if no == 2 else [])
    assert [
        bytes(r[0]) for r in fresh.router.backends[2].fetchall("SELECT id FROM photos")
    ] == photos


def test_a_failed_move_reports_its_own_error(
    growth: Growth, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A move that fails re-reads the placement on its way out; if that read
    fails too (the catalog gone), the move's own error is the one raised."""
    ds = growth.open()
    ds.add_shard(growth.extra)
    bucket = ds.placement.buckets_of_shard(0)[0]

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("the copy failed")

    mover = Mover(ds, grace=0)
    target = mover._target(2)  # reads the placement: before the catalog goes

    def unreachable(*args: object, **kwargs: object) -> None:
        raise bagstore.ShardUnavailable("catalog gone")

    monkeypatch.setattr(Mover, "_target", lambda self, to: target)
    monkeypatch.setattr(Mover, "_move_one", broken)
    monkeypatch.setattr(ds, "refresh_placement", unreachable)
    with pytest.raises(RuntimeError, match="the copy failed"):
        mover.move([bucket], 2)


def test_stale_process_is_fenced_when_it_deletes_index_rows(growth: Growth) -> None:
    tag_idx = bagstore.Index(table="index_tag", properties=["tag"], shard_on="tag")
    stale = growth.open(indexes=[tag_idx], refresh_interval=3600)
    admin = growth.open(indexes=[tag_idx])
    entity_id = stale.put({"tag": "a0"})
    # a tag whose index row lives in another bucket than the entity
    tag = next(
        f"a{n}"
        for n in range(1, 500)
        if bucket_of(keys.encode_value(f"a{n}"), 64) != bucket_of(entity_id, 64)
    )
    stale.put({"id": entity_id, "tag": tag})
    row_bucket = bucket_of(keys.encode_value(tag), 64)
    admin.add_shard(growth.extra)
    admin.move_buckets([row_bucket], to=2, grace=0)  # the row moves; the entity does not
    # The stale process deletes the old row on the shard that let the bucket go:
    # refused there, it refreshes and deletes it on the new owner.
    stale.put({"id": entity_id, "tag": "z"})
    report = admin.check()
    assert (report["missing"], report["stale"]) == (0, 0), report
    assert [e["id"] for e in tag_idx.get_all(admin, tag="z")] == [entity_id]


def test_frozen_bucket_makes_writers_wait_then_raise(growth: Growth) -> None:
    ds = growth.open(freeze_wait=0.3)
    entity_id = ds.put({"v": 1})
    bucket = bucket_of(entity_id, 64)
    backend = ds.router.backends[ds.placement.shard_of_bucket[bucket]]
    backend.set_bucket_state(bucket, 1)  # FROZEN, as a move does
    started = time.monotonic()
    with pytest.raises(bagstore.KeyMigrating):
        ds.put({"id": entity_id, "v": 2})
    assert time.monotonic() - started >= 0.3
    waits = ds.stats()["placement"]["frozen_waits"]
    assert 1 <= waits <= 0.3 / 0.005 + 1  # one per 5 ms wait
    assert ds.stats()["placement"]["refused"] == 0  # frozen is not stale
    backend.set_bucket_state(bucket, 0)
    ds.put({"id": entity_id, "v": 2})
    assert ds.get(entity_id) == {"id": entity_id, "v": 2}


def test_move_refuses_bad_targets(growth: Growth) -> None:
    ds = growth.open()
    with pytest.raises(bagstore.ConfigurationError, match="no shard"):
        ds.move_buckets([1], to=7)
    with pytest.raises(bagstore.ConfigurationError, match="no bucket"):
        ds.move_buckets([64], to=1)
    with pytest.raises(bagstore.ConfigurationError, match="already a shard"):
        ds.add_shard(growth.topo.urls[1])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"duty": -1}, "duty must be"),
        ({"duty": "1"}, "duty must be"),
        ({"duty": True}, "duty must be"),
        ({"batch": 0}, "batch must be"),
        ({"batch": 2.5}, "batch must be"),
        ({"max_rate": 0}, "max_rate must be"),
        ({"grace": -1}, "grace must be"),
    ],
)
def test_mover_refuses_bad_pacing(tmp_path: Path, kwargs: dict[str, object], message: str) -> None:
    ds = bagstore.open(tmp_path, shards=2, buckets=16)
    try:
        ids = ds.put_many([{"n": i} for i in range(20)])
        before = [s["buckets"] for s in ds.status()["shards"]]
        with pytest.raises(bagstore.ConfigurationError, match=message):
            Mover(ds, **kwargs)  # type: ignore[arg-type]
        with pytest.raises(bagstore.ConfigurationError, match=message):
            ds.move_buckets([1], to=0, **kwargs)  # type: ignore[arg-type]
        with pytest.raises(bagstore.ConfigurationError, match=message):
            ds.rebalance(**kwargs)  # type: ignore[arg-type]
        assert [s["buckets"] for s in ds.status()["shards"]] == before
        assert [e["n"] for e in ds.get_many(ids)] == list(range(20))  # type: ignore[index]
    finally:
        ds.close()


def test_move_is_paced_in_steps_but_not_while_frozen(
    growth: Growth, monkeypatch: pytest.MonkeyPatch
) -> None:
    ds = growth.open(indexes=[link_idx])
    ids = ds.put_many([{"link": f"l{i}", "n": i} for i in range(400)])
    counts: dict[int, int] = {}
    for i in ids:
        counts[bucket_of(i, 64)] = counts.get(bucket_of(i, 64), 0) + 1
    bucket = max(counts, key=lambda b: counts[b])  # the bucket with most entities
    assert counts[bucket] >= 7
    index_rows = sum(bucket_of(keys.encode_value(f"l{i}"), 64) == bucket for i in range(400))
    ds.add_shard(growth.extra)
    late = next(i for i in iter(bagstore.new_id, None) if bucket_of(i, 64) == bucket)
    other = growth.open(indexes=[link_idx])
    source = ds.placement.shard_of_bucket[bucket]
    calls: list[tuple[str, int, bool]] = []
    phase = ["copy"]
    original_paced = Mover._paced

    def paced(self: Mover, backend: Any, rows: int, started: float, paced: bool) -> None:
        calls.append((phase[0], rows, paced))
        original_paced(self, backend, rows, started, paced)

    src = ds.router.backends[source]
    original_state = src.set_bucket_state

    def set_state(b: int, state: int) -> None:
        if phase[0] == "copy":  # just before the freeze: a write the copy has not seen
            other.put({"id": late, "link": "late"})
            phase[0] = "frozen"
        original_state(b, state)

    monkeypatch.setattr(Mover, "_paced", paced)
    monkeypatch.setattr(src, "set_bucket_state", set_state)
    stats = Mover(ds, batch=2, duty=1.0, grace=0).move([bucket], to=2)
    copied = [(rows, p) for ph, rows, p in calls if ph == "copy"]
    frozen = [(rows, p) for ph, rows, p in calls if ph == "frozen"]
    # the copy: entities, then index rows, at most 2 a step, each step paced
    assert all(p and 1 <= rows <= 2 for rows, p in copied)
    assert sum(rows for rows, _ in copied) == counts[bucket] + index_rows
    # the frozen sync copies the late entity unpaced; the deletes after it are paced
    assert (1, False) in frozen
    assert sum(rows for rows, p in frozen if p) == stats.deleted
    late_row = bucket_of(keys.encode_value("late"), 64) == bucket
    assert stats.deleted == counts[bucket] + 1 + index_rows + late_row
    fresh = growth.open(indexes=[link_idx])
    assert fresh.get(late) is not None
    assert fresh.count() == 401
    assert_placed(fresh)
    report = fresh.check()
    assert (report["missing"], report["stale"]) == (0, 0), report


@pytest.mark.parametrize("ending", ["resume", "rollback"])
def test_move_killed_by_sigkill_can_be_resumed_or_rolled_back(growth: Growth, ending: str) -> None:
    ds = growth.open(indexes=[link_idx])
    ids = ds.put_many([{"link": f"l{i}", "n": i} for i in range(2000)])
    ds.add_shard(growth.extra)
    buckets = list(range(32))  # all of shard 0's
    proc = servers.spawn_python(
        f"""
        import bagstore
        ds = bagstore.Datastore({growth.topo.urls!r})
        from bagstore.scaleout import Mover
        Mover(ds, batch=5, grace=0).move({buckets!r}, to=2)
        """
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not ds.catalog.moves() and proc.poll() is None:
        time.sleep(0.01)
    time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate()
    unfinished = ds.catalog.moves()
    assert unfinished, err
    fresh = growth.open(indexes=[link_idx])
    assert all(e is not None for e in fresh.get_many(ids))  # readable after the kill
    mover = Mover(fresh, grace=0)
    if ending == "resume" or any(p == "switched" for _, _, p in unfinished.values()):
        mover.resume()
    else:
        for bucket in unfinished:
            try:
                mover.rollback(bucket)
            except bagstore.ConfigurationError as exc:
                # killed after the placement switched, before the phase said so
                assert "switched already" in str(exc)
        mover.resume()  # what switched goes on (nothing, if all rolled back)
    assert fresh.catalog.moves() == {}
    fresh.refresh_placement(force=True)
    assert_placed(fresh)
    assert [e["n"] for e in fresh.get_many(ids)] == list(range(2000))  # type: ignore[index]
    fresh.put({"id": ids[0], "link": "after", "n": -1})  # writable again
    report = fresh.check()
    assert (report["missing"], report["stale"]) == (0, 0), report


def test_new_process_opens_added_shards_from_the_catalog(growth: Growth) -> None:
    ds = growth.open()
    ds.add_shard(growth.extra)
    ds.rebalance(grace=0)
    entity_ids = ds.put_many([{"n": i} for i in range(100)])
    again = growth.open()  # its configuration lists only the first two shards
    assert len(again.shards) == 3
    assert [e["n"] for e in again.get_many(entity_ids)] == list(range(100))  # type: ignore[index]


def test_a_one_shard_store_reads_where_its_buckets_go(tmp_path: Path) -> None:
    """With every bucket on one shard, reads go there without hashing ids;
    once buckets move, what a process learns of it (a refused write, a
    refresh) routes its reads and index queries again."""
    tag_idx = bagstore.Index("index_tag", ["tag"])
    first, second = f"sqlite:///{tmp_path}/a.db", f"sqlite:///{tmp_path}/b.db"
    ds = bagstore.Datastore([first], buckets=8, indexes=[tag_idx], refresh_interval=3600)
    ids = ds.put_many([{"tag": "x" if n % 2 else "y", "n": n} for n in range(40)])
    expected = {i: {"id": i, "tag": "x" if n % 2 else "y", "n": n} for n, i in enumerate(ids)}

    def check() -> None:
        assert ds.get_many(ids) == [expected[i] for i in ids]
        assert [ds.get(i) for i in ids] == [expected[i] for i in ids]
        for tag in ("x", "y"):
            want = sorted(e["n"] for e in expected.values() if e["tag"] == tag)
            assert sorted(e["n"] for e in tag_idx.get_all(ds, tag=tag)) == want
        both = tag_idx.get_all(ds, tag__in=["x", "y"], limit=15)
        both += tag_idx.get_all(ds, tag__in=["x", "y"], limit=30, cursor=both.cursor)
        assert sorted(e["n"] for e in both) == sorted(e["n"] for e in expected.values())

    assert ds.router.topology.sole_shard == 0
    check()
    admin = bagstore.Datastore([first], buckets=8)
    admin.add_shard(second)
    admin.move_buckets(list(range(4)), to=1, grace=0)
    moved = next(i for i in ids if bucket_of(i, 8) < 4)
    expected[moved]["n"] = -1
    ds.put(dict(expected[moved]))  # refused by shard 0: where the bucket is now is learnt
    assert ds.router.topology.sole_shard is None
    assert ds.get(moved) == expected[moved]
    ds.refresh_placement(force=True)
    assert ds.router.topology.sole_shard is None
    check()
    admin.move_buckets(list(range(4, 8)), to=1, grace=0)
    ds.refresh_placement(force=True)
    assert ds.router.topology.sole_shard == 1
    check()
    ds.close()
    admin.close()


photo_idx = bagstore.Index(
    table="photos_by_user", properties=["user_id", "published"], shard_on="user_id"
)


def test_kind_placed_by_a_shard_key(topo: Topology) -> None:
    photos = topo.open(kind="photos", shard_key="user_id", indexes=[photo_idx], buckets=64)
    ids = {
        u: [photos.put({"user_id": u, "published": p}) for p in range(10)]
        for u in (b"ann", b"bob", b"cy")
    }
    where = buckets_of_rows(photos, "photos")
    for mine in ids.values():
        assert len({where[i] for i in mine}) == 1  # a user's photos together
    fresh = topo.open(kind="photos", shard_key="user_id", indexes=[photo_idx])
    assert fresh.get(ids[b"bob"][3])["published"] == 3  # type: ignore[index]
    for b in fresh.router.backends:
        b.scans = 0
    assert len(photo_idx.get_all(fresh, user_id=b"ann", published__gte=5)) == 5
    assert sum(b.scans for b in fresh.router.backends) == 1
    # changing the shard key moves the entity to the new key's bucket
    moved = ids[b"ann"][0]
    fresh.put({"id": moved, "user_id": b"cy", "published": 99})
    assert buckets_of_rows(fresh, "photos")[moved] == where[ids[b"cy"][0]]
    assert photos.get(moved) == {"id": moved, "user_id": b"cy", "published": 99}
    assert len(photo_idx.get_all(photos, user_id=b"ann")) == 9
    assert fresh.delete(moved) and photos.get(moved) is None
    report = fresh.check()
    assert (report["missing"], report["stale"]) == (0, 0)
    with pytest.raises(bagstore.InvalidEntity, match="placed by 'user_id'"):
        photos.put({"published": 1})
    with pytest.raises(bagstore.ConfigurationError, match="placed by"):
        topo.open(kind="photos", shard_key="album_id")


def test_lookup_rows_are_a_hint_not_the_truth(topo: Topology) -> None:
    photos = topo.open(kind="photos", shard_key="user_id", buckets=64)
    entity_id = photos.put({"user_id": b"ann"})
    for backend in photos.router.backends:  # lose every lookup row
        backend.execute("DELETE FROM bagstore_ids")
    fresh = topo.open(kind="photos", shard_key="user_id")
    assert fresh.get(entity_id) == {"id": entity_id, "user_id": b"ann"}  # searched for
    assert sum(b.count("bagstore_ids") for b in fresh.router.backends) == 1  # and recorded again


def test_directory_assigns_least_loaded_buckets(topo: Topology) -> None:
    users = topo.open(kind="posts", shard_key="user_id", shard_map="directory", buckets=64)
    for u in range(64):
        users.put({"user_id": u})
    assert sorted(buckets_of_rows(users, "posts").values()) == list(range(64))


def test_migrate_key_under_writes(topo: Topology) -> None:
    ds = topo.open(
        kind="posts",
        shard_key="user_id",
        shard_map="directory",
        buckets=64,
        refresh_interval=0.3,
        indexes=[bagstore.Index(table="posts_by_user", properties=["user_id", "n"])],
    )
    ids = [ds.put({"user_id": "ann", "n": n}) for n in range(50)]
    ds.put({"user_id": "bob", "n": 0})
    old = buckets_of_rows(ds, "posts")[ids[0]]
    target = (old + 33) % 64
    acked: dict[bytes, int] = {}
    refused = [0]
    stop = threading.Event()

    def writer() -> None:
        n = 100
        while not stop.is_set():
            try:
                acked[ds.put({"user_id": "ann", "n": n})] = n
                n += 1
            except bagstore.KeyMigrating:
                refused[0] += 1
                time.sleep(0.01)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        time.sleep(0.1)
        moved = ds.migrate_key("ann", target)
    finally:
        time.sleep(0.1)
        stop.set()
        thread.join()
    assert refused[0] > 0  # writes were told to retry while it moved
    assert moved >= 50
    where = buckets_of_rows(ds, "posts")
    assert {where[i] for i in [*ids, *acked]} == {target}
    fresh = topo.open(kind="posts", shard_key="user_id", shard_map="directory")
    got = fresh.get_many([*ids, *acked])
    assert all(e is not None for e in got)
    assert fresh.count() == 51 + len(acked)
    report = fresh.check()
    assert (report["missing"], report["stale"]) == (0, 0)


def test_shard_keyed_kind_survives_rebalance(growth: Growth) -> None:
    photos = growth.open(kind="photos", shard_key="user_id")
    ids = [photos.put({"user_id": f"u{i % 20}", "i": i}) for i in range(200)]
    photos.add_shard(growth.extra)
    photos.rebalance(grace=0)
    fresh = growth.open(kind="photos", shard_key="user_id")
    assert [e["i"] for e in fresh.get_many(ids)] == list(range(200))  # type: ignore[index]
    per_shard = [b.count("bagstore_ids") for b in fresh.router.backends]
    assert sum(per_shard) == 200 and per_shard[2] > 0


@pytest.mark.parametrize("count", [3, 40])  # each row's ownership read by key; a join
def test_fenced_index_insert_refuses_buckets_not_owned(topo: Topology, count: int) -> None:
    """A fenced insert (a writer's few rows, or a backfill's many, which the
    dialect fences in another form) writes only the rows of buckets the shard
    owns and are not frozen, and raises for the others."""
    from bagstore.backends.base import FENCED_ROWS_READ_BY_KEY
    from bagstore.backends.indexsql import IndexRow

    assert (count > FENCED_ROWS_READ_BY_KEY) == (count == 40)
    ds = topo.open(indexes=[link_idx], buckets=64)
    backend = ds.router.backends[0]
    owned = ds.placement.buckets_of_shard(0)
    foreign = next(b for b in range(64) if b not in owned)

    def rows(last_bucket: int) -> list[IndexRow]:
        # the first row in owned[0], the others in owned[1], the last one as told
        buckets = [owned[0]] + [owned[1]] * (count - 2) + [last_bucket]
        return [
            IndexRow((keys.encode_value(f"http://x/{os.urandom(4).hex()}"),), os.urandom(16), b)
            for b in buckets
        ]

    with pytest.raises(bagstore.StalePlacement):
        backend.insert_index_rows("index_link", ["link"], rows(foreign), fenced=True)
    assert backend.count("index_link") == count - 1  # all but the foreign bucket's row
    backend.set_bucket_state(owned[0], 1)  # FROZEN, as a move does
    with pytest.raises(bagstore.KeyMigrating):
        backend.insert_index_rows("index_link", ["link"], rows(owned[0]), fenced=True)
    # written: the rows of owned[1], all but the first and the last
    assert backend.count("index_link") == (count - 1) + (count - 2)
    backend.set_bucket_state(owned[0], 0)
    before = backend.count("index_link")
    assert backend.insert_index_rows("index_link", ["link"], rows(owned[1]), fenced=True) == count
    assert backend.count("index_link") == before + count


def test_the_examples_in_docs_scaleout_md_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = (Path(__file__).resolve().parent.parent / "docs" / "scaleout.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # (its store lands here)
    exec(compile(blocks[0] + blocks[1], "docs/scaleout.md", "exec"), {})
    # the shard-key and directory examples, on a store of their own
    urls = [f"sqlite:///{tmp_path}/keyed_{i}.db" for i in range(2)]
    namespace: dict[str, Any] = {"bagstore": bagstore, "urls": urls}
    exec(compile(blocks[2] + blocks[3], "docs/scaleout.md", "exec"), namespace)
    photos, posts = namespace["photos"], namespace["posts"]
    assert namespace["moved"] == 0  # "ann" has no posts yet
    eid = posts.put({"user_id": "ann", "title": "hello"})  # (in bucket 17 now)
    assert posts.migrate_key("ann", to_bucket=18) == 1
    got = posts.get(eid)
    assert got is not None and got["title"] == "hello"
    photos.close()
    posts.close()


def test_server_advice_names_too_many_purge_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server running more InnoDB purge threads than half its cores (as
    thread_pool_size counts them) is named, by the Mover and by the CLI; one
    that runs few enough is not.  On a mariadbd of the test's own, told it has
    8 cores (thread_pool_size is not settable at run time without the pool)."""
    from click.testing import CliRunner

    from bagstore.cli import cli

    server = servers.MariaDBServer(extra_options=["--thread-pool-size=8"])
    try:
        server.start()
    except servers.ServerUnavailable as exc:
        _need(str(exc))
    url = f"mysql://root@{server.host}:{server.port}/{servers.unique_name('advice')}"

    def purge_threads(n: int) -> None:
        conn = servers._connect(server.host, server.port, "root", "")
        try:
            with conn.cursor() as cur:
                cur.execute(f"SET GLOBAL innodb_purge_threads = {n}")
        finally:
            conn.close()

    ds: bagstore.Datastore | None = None
    try:
        ds = bagstore.Datastore([url], buckets=16)
        purge_threads(4)  # MariaDB's default: fine on 8 cores
        assert Mover(ds).server_advice() == []
        purge_threads(5)
        advice = Mover(ds).server_advice()
        assert len(advice) == 1
        assert f"{server.host}:{server.port}" in advice[0]
        assert "innodb_purge_threads is 5 on a server with 8 cores" in advice[0]
        assert "SET GLOBAL innodb_purge_threads = 4" in advice[0]
        (tmp_path / "bagstore.toml").write_text(f'[bagstore]\nshards = ["{url}"]\n')
        monkeypatch.chdir(tmp_path)
        listed = CliRunner().invoke(cli, ["shard", "list"])
        assert listed.exit_code == 0, listed.output
        assert "innodb_purge_threads is 5" in listed.output
        purge_threads(1)
        assert Mover(ds).server_advice() == []
        listed = CliRunner().invoke(cli, ["shard", "list"])
        assert listed.exit_code == 0 and "innodb_purge_threads" not in listed.output
    finally:
        if ds is not None:
            ds.close()
        server.stop()


def test_no_server_advice_for_sqlite(tmp_path: Path) -> None:
    ds = bagstore.open(str(tmp_path / "store"), shards=2, buckets=16)
    try:
        assert Mover(ds).server_advice() == []
    finally:
        ds.close()


def test_server_advice_without_the_variables_and_on_other_errors(
    mysql_main: servers.MySQLAddress, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server without MariaDB's variables (MySQL has no thread_pool_size)
    gets no advice; any other failure of the same statement is not hidden."""
    topo = _mysql_topology("advice", [(mysql_main, 1)])
    try:
        backend = topo.open(buckets=16).router.backends[0]
        fetchall = backend.fetchall
        monkeypatch.setattr(  # the real server's answer to a variable it lacks
            backend, "fetchall", lambda sql, *a: fetchall(sql.replace("thread_pool", "no_such"))
        )
        assert backend.server_advice() == []
        monkeypatch.setattr(backend, "fetchall", lambda sql, *a: fetchall("SELECT * FROM no_such"))
        with pytest.raises(bagstore.errors.BackendError, match="no_such"):
            backend.server_advice()
    finally:
        topo.close()
