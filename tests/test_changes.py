"""The change feed (issue #26): changes in the write's transaction, cursors,
consumers, bucket moves.  SIGKILL loops: tests/test_changes_kill.py."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

import bagstore
from bagstore import testing
from bagstore.changes import Change
from tests.conftest import Topology


def drain(ds: bagstore.Datastore, since: str | None = None, **kw: Any) -> tuple[list[Change], str]:
    """Every change after ``since``, page by page; the last cursor."""
    out: list[Change] = []
    while True:
        page = ds.changes(since=since, limit=7, **kw)
        out += page
        since = page.cursor
        if not page:
            return out, since


def test_writes_record_changes_in_order(topo: Topology) -> None:
    ds = topo.open(buckets=64)
    ds.feed.enable(bodies=True)
    a = ds.put({"n": 1})
    b_ids = ds.put_many([{"n": i} for i in range(10)])
    ds.put({"id": a, "n": 2})
    assert ds.delete(b_ids[0])
    assert not ds.delete(b_ids[0])  # nothing deleted: no change
    changes, cursor = drain(ds)
    assert len(changes) == 13
    of_a = [(c.op, c.entity) for c in changes if c.id == a]
    assert of_a == [("put", {"n": 1, "id": a}), ("put", {"n": 2, "id": a})]
    first, second = (c.version for c in changes if c.id == a)
    stored = ds.get_with_version(a)
    assert stored is not None and 0 < first < second == stored[1]
    gone = [(c.op, c.version, c.entity) for c in changes if c.id == b_ids[0]]
    (put_op, put_version, put_body), (delete_op, delete_version, delete_body) = gone
    assert (put_op, put_body) == ("put", {"n": 0, "id": b_ids[0]})
    assert (delete_op, delete_body) == ("delete", None)
    assert delete_version == put_version  # a delete records the version it removed
    # per bucket, positions 1, 2, 3... in the order read
    per_bucket: dict[int, list[int]] = {}
    for c in changes:
        per_bucket.setdefault(c.bucket, []).append(c.position)
    assert all(p == list(range(1, len(p) + 1)) for p in per_bucket.values())
    # an empty page still carries a cursor, which reads on from there
    empty = ds.changes(since=cursor)
    assert empty == [] and empty.cursor
    c = ds.put({"n": 3})
    assert [x.id for x in ds.changes(since=empty.cursor)] == [c]


def test_without_bodies_and_off(topo: Topology) -> None:
    ds = topo.open()
    with pytest.raises(bagstore.ConfigurationError, match="is off"):
        ds.changes()
    ds.put({"before": True})  # before the feed is on: never recorded
    ds.feed.enable()
    entity_id = ds.put({"n": 1})
    page = ds.changes()
    stored = ds.get_with_version(entity_id)
    assert stored is not None
    assert [(c.id, c.op, c.version, c.entity) for c in page] == [
        (entity_id, "put", stored[1], None)
    ]
    ds.feed.disable()
    ds.put({"n": 2})
    assert ds.changes(since=page.cursor) == []  # off: nothing more recorded
    assert ds.feed.settings() is None


def test_changes_of_index_writes_and_batches(topo: Topology) -> None:
    """Writes that read the old rows (indexed kinds: the multi-statement path)."""
    idx = bagstore.Index(table="index_tag", properties=["tag"])
    ds = topo.open(indexes=[idx])
    ds.feed.enable(bodies=True)
    ids = ds.put_many([{"tag": f"t{i % 3}"} for i in range(50)])
    ds.put_many([{"id": i, "tag": "x"} for i in ids[:20]])
    ds.delete_many(ids[:5])
    changes, _ = drain(ds)
    assert len(changes) == 75
    for i in ids[:5]:
        (op1, v1), (op2, v2), (op3, v3) = [(c.op, c.version) for c in changes if c.id == i]
        assert (op1, op2, op3) == ("put", "put", "delete")
        assert 0 < v1 < v2 == v3  # a delete records the version it removed


def test_a_process_dead_after_its_commit_leaves_the_change(topo: Topology) -> None:
    """A put that committed, its process dead before it returned: its change
    is there (a write failing before its commit: tests/test_changes_writes.py)."""
    ds = topo.open()
    ds.feed.enable()
    with testing.failpoint("put.after_entity"), pytest.raises(testing.SimulatedCrash):
        ds.put({"n": 1})
    changes, _ = drain(ds)
    assert ds.count() == len(changes) == 1
    stored = ds.get_with_version(changes[0].id)
    assert stored is not None and (changes[0].op, changes[0].version) == ("put", stored[1])


def test_rolled_back_transaction_has_no_change(
    topo: Topology, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write whose transaction fails after its entity statement ran leaves
    no change (and no entity); the same write retried has exactly one."""
    idx = bagstore.Index(table="index_n", properties=["n"])  # the transaction path
    ds = topo.open(indexes=[idx])
    ds.feed.enable()
    entity_id = ds.put({"n": 1})

    def failing(backend: Any, cur: Any, *args: Any) -> None:
        cur.execute("SELECT 1")  # (a read: sends the upsert a pipeline holds back)
        cur.fetchall()
        raise RuntimeError("the connection broke after the upsert")

    from bagstore.indexer import Indexer

    # (the index rows are written in the entity's transaction, after its upsert)
    monkeypatch.setattr(Indexer, "write_in", staticmethod(failing))
    with pytest.raises(RuntimeError):
        ds.put({"id": entity_id, "n": 2})
    monkeypatch.undo()
    stored = ds.get_with_version(entity_id)
    assert stored == ({"id": entity_id, "n": 1}, stored[1] if stored else None)
    assert stored is not None
    changes, _ = drain(ds)
    assert [(c.id, c.version) for c in changes] == [(entity_id, stored[1])]
    ds.put({"id": entity_id, "n": 2})
    again = ds.get_with_version(entity_id)
    assert again is not None and again[1] > stored[1]
    changes, _ = drain(ds)
    assert [(c.id, c.version) for c in changes] == [(entity_id, stored[1]), (entity_id, again[1])]


def test_bad_cursors(topo: Topology, tmp_path: Path) -> None:
    ds = topo.open()
    ds.feed.enable()
    ds.put({"n": 1})
    cursor = ds.changes().cursor
    for bad in ["", "nonsense", "c1.x.y", cursor[:-1] + ("0" if cursor[-1] != "0" else "1"), 7]:
        with pytest.raises(bagstore.InvalidQuery):
            ds.changes(since=bad)  # type: ignore[arg-type]
    other = bagstore.open(str(tmp_path / "other"))
    other.feed.enable()
    other.put({"n": 1})
    with pytest.raises(bagstore.InvalidQuery, match="not one of the change feed"):
        ds.changes(since=other.changes().cursor)
    other.close()
    photos = topo.open(kind="photos")
    photos.feed.enable()
    with pytest.raises(bagstore.InvalidQuery, match="kind 'entities'"):
        ds.changes(since=photos.changes().cursor)
    with pytest.raises(bagstore.InvalidQuery, match="no kind"):
        ds.changes(kind="nope")
    assert ds.changes(kind="photos") == []
    for limit in (0, -1, 10_001, "5"):
        with pytest.raises(bagstore.InvalidQuery, match="limit"):
            ds.changes(limit=limit)  # type: ignore[arg-type]


def test_entity_moved_to_another_bucket_records_one_put(topo: Topology) -> None:
    photos = topo.open(kind="photos", shard_key="user_id", buckets=64)
    photos.feed.enable()
    entity_id = photos.put({"user_id": "u1", "n": 1})
    first = photos.bucket_of_id(entity_id)
    user = next(
        f"u{i}"
        for i in range(2, 200)
        if photos.placer.entity_bucket({"user_id": f"u{i}"}, entity_id) != first
    )
    photos.put({"id": entity_id, "user_id": user, "n": 2})
    changes, _ = drain(photos)
    assert [c.op for c in changes] == ["put", "put"]
    assert changes[1].bucket != changes[0].bucket
    assert photos.get(entity_id) == {"id": entity_id, "user_id": user, "n": 2}
    assert photos.delete(entity_id)
    changes, _ = drain(photos)
    assert [c.op for c in changes] == ["put", "put", "delete"]


def test_a_key_migration_records_no_delete(topo: Topology) -> None:
    """Found by the model test (test_model.py): the old copies' deletion after
    a key migration to another shard recorded a delete with the version of
    the put recorded in the new bucket (a consumer applying it lost the
    entity); within one shard the migration records nothing."""
    photos = topo.open(
        kind="photos", shard_key="user_id", shard_map="directory", buckets=8, refresh_interval=0
    )
    photos.feed.enable()
    ids = photos.put_many([{"user_id": "u1", "n": n} for n in range(3)])
    home = photos.bucket_of_id(ids[0])
    assert home is not None
    shard_of = photos.placement.shard_of_bucket
    near = next(b for b in range(8) if b != home and shard_of[b] == shard_of[home])
    far = next(b for b in range(8) if shard_of[b] != shard_of[home])
    stamps = [photos.get_with_version(i)[1] for i in ids]  # type: ignore[index]
    _, cursor = drain(photos)
    assert photos.migrate_key("u1", near) == 3
    assert drain(photos, cursor)[0] == []  # within its shard: nothing recorded
    assert photos.migrate_key("u1", far) == 3
    changes, _ = drain(photos, cursor)
    assert sorted((c.op, c.id, c.version, c.bucket) for c in changes) == sorted(
        ("put", i, v, far) for i, v in zip(ids, stamps, strict=True)
    )
    assert [photos.get_with_version(i)[1] for i in ids] == stamps  # type: ignore[index]


# -- consumers --------------------------------------------------------------------------
def test_consumer_resumes_and_retries_a_failed_batch(topo: Topology) -> None:
    ds = topo.open(buckets=32)
    ds.feed.enable()
    ids = ds.put_many([{"n": i} for i in range(40)])
    seen: list[bytes] = []
    consumer = ds.subscribe("indexer", lambda cs: seen.extend(c.id for c in cs), batch=5)
    while consumer.poll():
        pass
    assert sorted(seen) == sorted(ids)
    consumer.close()
    more = ds.put_many([{"n": i} for i in range(5)])
    calls: list[int] = []

    def flaky(cs: list[Change]) -> None:
        calls.append(len(cs))
        if len(calls) == 1:
            raise RuntimeError("search index down")
        seen.extend(c.id for c in cs)

    again = ds.subscribe("indexer", flaky, batch=50)
    with pytest.raises(RuntimeError):
        again.poll()
    assert ds.feed.consumers()[0]["lag_changes"] == 5  # not advanced
    while again.poll():
        pass
    assert sorted(seen) == sorted(ids + more)  # the failed batch came again, once handled
    lag = ds.feed.consumers()
    assert lag == [
        {"name": "indexer", "kind": "entities", "lag_changes": 0, "lag_seconds": 0.0,
         "lag_pruned": 0, "processes": 1}
    ]  # fmt: skip
    other: list[bytes] = []
    independent = ds.subscribe("mailer", lambda cs: other.extend(c.id for c in cs))
    while independent.poll():
        pass
    assert sorted(other) == sorted(ids + more)
    again.close()
    ds.feed.reset_consumer("indexer")
    replay: list[bytes] = []
    third = ds.subscribe("indexer", lambda cs: replay.extend(c.id for c in cs), batch=100)
    while third.poll():
        pass
    assert sorted(replay) == sorted(ids + more)
    ds.feed.reset_consumer("indexer", to="end")
    ds.feed.drop_consumer("mailer")
    assert [c["name"] for c in ds.feed.consumers()] == ["indexer"]


def test_consumer_bad_input(topo: Topology) -> None:
    ds = topo.open()
    ds.put({"n": 0})
    # a consumer of a feed that is off (it would wait for ever): refused, not recorded
    with pytest.raises(bagstore.ConfigurationError, match="change feed of kind 'entities' is off"):
        ds.subscribe("early", print)
    assert ds.feed.consumers() == []
    ds.feed.enable()
    with pytest.raises(bagstore.InvalidQuery, match="no consumer 'ghost'"):
        ds.feed.drop_consumer("ghost")
    with pytest.raises(bagstore.InvalidQuery, match="no consumer"):
        ds.feed.reset_consumer("ghost")
    for bad in ("", "a b", "x" * 65, None):
        with pytest.raises(bagstore.ConfigurationError, match="consumer name"):
            ds.subscribe(bad, print)  # type: ignore[arg-type]
    with pytest.raises(bagstore.ConfigurationError, match="batch"):
        ds.subscribe("c", print, batch=0)
    with pytest.raises(bagstore.ConfigurationError, match="callable"):
        ds.subscribe("c", None)  # type: ignore[arg-type]
    photos = topo.open(kind="photos")
    photos.feed.enable()
    ds.subscribe("c", print).close()
    with pytest.raises(bagstore.ConfigurationError, match="follows kind 'entities'"):
        photos.subscribe("c", print)
    ds.subscribe("c", print).close()
    with pytest.raises(bagstore.InvalidQuery, match="'start' or 'end'"):
        ds.feed.reset_consumer("c", to="middle")


def test_a_consumer_process_stops_where_retrying_cannot_help(
    topo: Topology, caplog: pytest.LogCaptureFixture
) -> None:
    """``run()`` retries a handler's failure (InvalidQuery included) and ends,
    raising, when the consumer fell behind retention or was dropped: it
    logged "handler failed" and retried those every second for ever before.
    A process whose consumer was dropped, or that was closed, cannot poll
    (it polled nothing for ever, and a closed one took its ranges again)."""
    ds = topo.open(buckets=4)
    ds.feed.enable(max_age=1, max_changes=2)
    ds.put_many([{"n": i} for i in range(20)])
    calls: list[int] = []
    stop = threading.Event()

    def picky(cs: list[Change]) -> None:
        calls.append(len(cs))
        if len(calls) == 1:
            raise bagstore.InvalidQuery("the handler's own bad query")
        if sum(calls[1:]) >= 20:
            stop.set()

    done = threading.Timer(10.0, stop.set)  # (a run that gives up fails below)
    done.start()
    ds.subscribe("picky", picky, batch=100).run(stop, idle=0.01, retry_wait=0.01)
    done.cancel()
    assert len(calls) > 1 and sum(calls[1:]) == 20  # retried, then all handled
    assert "picky: handler failed" in caplog.text

    behind = ds.subscribe("behind", lambda cs: None)
    assert behind.poll() == 20  # (it has handled batches: it is told what it missed)
    behind.close()
    ds.put_many([{"n": i} for i in range(20)])
    assert bagstore.Cleaner(ds).prune_changes() > 0
    stop = threading.Event()
    killer = threading.Timer(10.0, stop.set)  # (a run that never ends fails below)
    killer.start()
    try:
        with pytest.raises(bagstore.ChangesPruned, match="consumer 'behind'"):
            ds.subscribe("behind", lambda cs: None).run(stop, idle=0.01, retry_wait=0.01)
    finally:
        killer.cancel()
    assert not stop.is_set()

    dropped = ds.subscribe("dropped", lambda cs: None)
    dropped.poll()
    ds.feed.drop_consumer("dropped")
    with pytest.raises(bagstore.InvalidQuery, match="consumer 'dropped' no longer exists"):
        dropped.poll()
    with pytest.raises(bagstore.InvalidQuery, match="no longer exists"):
        dropped.run(threading.Event())
    assert "dropped" not in [c["name"] for c in ds.feed.consumers()]
    members = ds.router.catalog_backend.select_all(
        "bagstore_consumer_members", ("member",), {"name": "dropped"}
    )
    assert members == []  # no heartbeat left behind

    closed = ds.subscribe("closed", lambda cs: None)
    closed.close()
    with pytest.raises(bagstore.InvalidQuery, match="was closed"):
        closed.poll()


def test_two_processes_of_one_consumer_share_the_ranges(topo: Topology) -> None:
    """Two subscribers of one consumer (as two processes would) split the
    ranges: every change handled, none by both while both hold leases."""
    ds = topo.open(buckets=64)
    ds.feed.enable()
    ids = set(ds.put_many([{"n": i} for i in range(300)]))
    handled: dict[str, list[bytes]] = {"a": [], "b": []}
    a = ds.subscribe("shared", lambda cs: handled["a"].extend(c.id for c in cs), batch=10)
    b = ds.subscribe("shared", lambda cs: handled["b"].extend(c.id for c in cs), batch=10)
    a.balance()
    b.balance()
    a.balance()  # a sees b alive and gives back its extra ranges
    b.balance()
    assert len(a.held) == len(b.held) == 8 and not set(a.held) & set(b.held)
    while a.poll() + b.poll():
        pass
    assert set(handled["a"]) | set(handled["b"]) == ids
    assert not set(handled["a"]) & set(handled["b"])
    assert len(handled["a"]) + len(handled["b"]) == 300
    b.close()  # leases given back: a takes them at once
    a.balance()
    assert len(a.held) == 16


def test_consumer_follows_through_a_rebalance(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Writers and a consumer go on while buckets move to a new shard: every
    acknowledged write is handled, per entity in version order, and positions
    stay gapless."""
    for name in ("sqlite", "mysql"):
        _follow_rebalance(name, tmp_path / name, request)


def _follow_rebalance(name: str, root: Path, request: pytest.FixtureRequest) -> None:
    from tests.conftest import _mysql_topology

    if name == "sqlite":
        topo = Topology("sqlite", [f"sqlite:///{root}/s{i}.db" for i in range(2)])
        extra = f"sqlite:///{root}/new.db"
    else:
        from tests import servers

        main = request.getfixturevalue("mysql_main")
        topo = _mysql_topology("feedmove", [(main, 3)])
        extra, topo.urls = topo.urls[2], topo.urls[:2]
    try:
        ds = topo.open(buckets=32)
        ds.feed.enable()
        writer = topo.open(buckets=32, refresh_interval=0.2)
        reader = topo.open(buckets=32, refresh_interval=0.2)
        ids = writer.put_many([{"n": 0} for _ in range(50)])
        acked: list[tuple[bytes, int]] = []
        stop = threading.Event()
        errors: list[BaseException] = []

        def write() -> None:
            try:
                n = 0
                while not stop.is_set():
                    n += 1
                    writer.put({"id": ids[n % 50], "n": n})
                    acked.append((ids[n % 50], n))
            except BaseException as exc:
                errors.append(exc)

        got: list[Change] = []
        consumer = reader.subscribe("follow", got.extend, batch=20)

        def consume() -> None:
            try:
                while not stop.is_set():
                    if not consumer.poll():
                        time.sleep(0.01)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=write), threading.Thread(target=consume)]
        for t in threads:
            t.start()
        try:
            time.sleep(0.3)
            ds.add_shard(extra)
            stats = ds.rebalance(grace=0.3)
        finally:
            stop.set()
            for t in threads:
                t.join()
        assert errors == [] and stats.buckets > 0 and len(acked) > 20
        while consumer.poll():
            pass
        consumer.close()
        by_entity: dict[bytes, list[int]] = {}
        for c in got:
            by_entity.setdefault(c.id, []).append(c.version)
        for versions in by_entity.values():
            assert versions == sorted(versions) and len(set(versions)) == len(versions)
        final = {i: ds.get(i) for i in ids}
        assert all(by_entity[i][-1] == ds.fetch_many([i])[i].version for i in ids if final[i])
        assert len(got) == 50 + len(acked)
        per_bucket: dict[int, list[int]] = {}
        for c in got:
            per_bucket.setdefault(c.bucket, []).append(c.position)
        assert all(p == list(range(1, len(p) + 1)) for p in per_bucket.values())
        # the old shards no longer hold the moved buckets' change rows
        moved = set(ds.placement.buckets_of_shard(2))
        for backend in ds.router.backends[:2]:
            rows = backend.fetchall("SELECT DISTINCT bucket FROM bagstore_changes")
            assert not {int(r[0]) for r in rows} & moved
    finally:
        topo.close()
        if name != "sqlite":
            from tests import servers

            servers.drop_databases("127.0.0.1", 3306, [extra.rsplit("/", 1)[1].split("?")[0]])


# -- retention -----------------------------------------------------------------------------
def test_retention_keeps_what_consumers_need_and_caps(topo: Topology) -> None:
    ds = topo.open(buckets=4)
    ds.feed.enable(max_age=1, max_changes=1000)
    ids = ds.put_many([{"n": i} for i in range(40)])
    handled: list[bytes] = []
    slow = ds.subscribe("slow", lambda cs: handled.extend(c.id for c in cs), batch=10)
    slow.poll()  # some of each range handled, the rest not
    cleaner = bagstore.Cleaner(ds)
    from bagstore.retention import prune_changes

    assert prune_changes(ds.feed, now=time.time_ns() // 1000) == 0  # none older than 1 s
    later = time.time_ns() // 1000 + 5_000_000
    pruned = prune_changes(ds.feed, now=later)
    assert pruned == len(handled) > 0  # old enough and handled: gone; the rest kept
    while slow.poll():
        pass
    assert sorted(handled) == sorted(ids)  # nothing the consumer needed was lost
    slow.close()
    assert prune_changes(ds.feed, now=later) == 40 - pruned
    # the hard cap: a dead consumer does not keep changes for ever ("slow",
    # which has handled batches, is told; "new", which has handled none since
    # it was made, starts at the oldest change kept, as if made now)
    ds.feed.enable(max_age=1, max_changes=2)
    ds.subscribe("new", lambda cs: None).close()
    ds.put_many([{"n": i} for i in range(20)])
    n = cleaner.prune_changes()
    kept = ds.changes(limit=100)
    assert 0 < len(kept) <= 2 * 4 and n == 20 - len(kept)
    time.sleep(0.05)
    lags = {c["name"]: c for c in ds.feed.consumers()}
    # told how many it will never see; its age from the oldest change kept
    assert (lags["slow"]["lag_changes"], lags["slow"]["lag_pruned"]) == (20, n)
    assert (lags["new"]["lag_changes"], lags["new"]["lag_pruned"]) == (len(kept), 0)
    assert 0.05 <= lags["slow"]["lag_seconds"] < 30
    assert lags["new"]["lag_seconds"] == lags["slow"]["lag_seconds"]
    failing = ds.subscribe("slow", lambda cs: None)
    with pytest.raises(bagstore.ChangesPruned, match=r"consumer 'slow' .* consumers reset slow"):
        failing.poll()
    failing.close()
    for name in ("new", "slow"):
        if name == "slow":
            ds.feed.reset_consumer(name)
        again: list[Change] = []
        revived = ds.subscribe(name, again.extend)
        while revived.poll():
            pass
        revived.close()
        assert sorted(c.id for c in again) == sorted(c.id for c in kept)
        assert ds.feed.consumers()[["new", "slow"].index(name)]["lag_changes"] == 0
    with pytest.raises(bagstore.ChangesPruned, match="this cursor"):
        ds.changes(since=ds.feed.cursor({}))


@pytest.mark.parametrize("ending", ["resume", "rollback"])
@pytest.mark.parametrize("point", ["move.after_copy", "move.after_freeze", "move.after_switch"])
def test_a_crashed_move_keeps_the_feed_whole(tmp_path: Path, point: str, ending: str) -> None:
    """A move that crashed at each step, then resumed or rolled back: the feed
    reads every change once, gapless, and the shard left holds no copy."""
    urls = [f"sqlite:///{tmp_path}/s{i}.db" for i in range(2)]
    ds = bagstore.Datastore(urls, buckets=8)
    ds.feed.enable()
    ids = ds.put_many([{"n": i} for i in range(60)])
    bucket = ds.bucket_of_id(ids[0])
    assert bucket is not None
    source = ds.placement.shard_of_bucket[bucket]
    mover = bagstore.Mover(ds, grace=0)
    with testing.failpoint(point), pytest.raises(testing.SimulatedCrash):
        mover.move([bucket], to=1 - source)
    ds.refresh_placement(force=True)
    if ending == "rollback" and point != "move.after_switch":
        mover.rollback(bucket)
    else:
        mover.resume()
    ds.put({"id": ids[0], "n": -1})  # written where the bucket is now
    changes, _ = drain(ds)
    assert sorted(c.id for c in changes) == sorted([*ids, ids[0]])
    mine = [c.position for c in changes if c.bucket == bucket]
    assert mine == list(range(1, len(mine) + 1))
    owner = ds.placement.shard_of_bucket[bucket]
    other = ds.router.backends[1 - owner]
    assert other.fetchall("SELECT pos FROM bagstore_changes WHERE bucket = ?", [bucket]) == []
    assert other.fetchall("SELECT pos FROM bagstore_change_pos WHERE bucket = ?", [bucket]) == []
    ds.close()


def test_module_doctests_pass() -> None:
    import doctest

    from bagstore import changes, consumeradmin, retention, subscriber

    for module in (changes, subscriber, consumeradmin, retention):
        failed, attempted = doctest.testmod(module)
        assert failed == 0 and attempted > 0, module.__name__


def test_a_failover_epoch_refuses_older_cursors_and_positions(topo: Topology) -> None:
    """After ds.feed.new_epoch() (a failover that may have lost writes), a
    cursor or a consumer position from before is refused, clearly; a reset
    consumer and a fresh read go on."""
    ds = topo.open(refresh_interval=0)
    ds.feed.enable()
    ds.put_many([{"n": i} for i in range(5)])
    cursor = ds.changes().cursor
    seen: list[bytes] = []
    consumer = ds.subscribe("search", lambda cs: seen.extend(c.id for c in cs))
    while consumer.poll():
        pass
    assert ds.feed.new_epoch() == 1
    with pytest.raises(bagstore.ChangesLost, match=r"this cursor .* before a failover"):
        ds.changes(since=cursor)
    with pytest.raises(bagstore.ChangesLost, match="consumer 'search'"):
        consumer.poll()  # a process that ran through the failover
    consumer.close()
    late = ds.subscribe("search", print)
    with pytest.raises(bagstore.ChangesLost):
        late.poll()  # a process started after it
    late.close()
    ds.feed.reset_consumer("search", to="end")
    ds.put({"n": 5})
    after = ds.subscribe("search", lambda cs: seen.extend(c.id for c in cs))
    while after.poll():
        pass
    assert len(seen) == 6
    assert len(ds.changes()) == 6  # from the start: a fresh cursor


@contextmanager
def _failover_after(feed: Any, method: str) -> Iterator[None]:
    """Within the block, each call of ``feed.<method>`` is followed by a new
    epoch (another process's failover, seen by this one then)."""
    real = getattr(feed, method)

    def failing_over(*args: Any, **kwargs: Any) -> Any:
        got = real(*args, **kwargs)
        feed.new_epoch()
        return got

    setattr(feed, method, failing_over)
    try:
        yield
    finally:
        setattr(feed, method, real)


def test_a_cursor_keeps_the_epoch_its_page_was_read_in(topo: Topology) -> None:
    """A failover's new epoch seen while a page is read: the page's cursor
    carries the epoch its positions were read in, so the next page is
    refused (ChangesLost), not read on from positions that may be gone."""
    ds = topo.open()
    ds.feed.enable()
    ds.put_many([{"n": i} for i in range(5)])
    with _failover_after(ds.feed, "read"):
        page = ds.changes()
    assert len(page) == 5
    with pytest.raises(bagstore.ChangesLost, match="this cursor"):
        ds.changes(since=page.cursor)
    assert len(ds.changes()) == 5  # from the start: a fresh cursor, read on
    assert ds.changes(since=ds.changes().cursor) == []


def test_positions_read_for_an_end_cursor_or_a_reset_keep_their_epoch(
    topo: Topology,
) -> None:
    """A failover's new epoch seen while the buckets' positions are read for
    ds.feed.end_cursor(), a consumer's reset (to its end, or its start) or
    a new consumer's start: what was read carries the epoch before it, and
    is refused."""
    ds = topo.open()
    ds.feed.enable()
    ds.put_many([{"n": i} for i in range(5)])
    feed = ds.feed
    consumers = {to: ds.subscribe(f"reset-{to}", print) for to in ("end", "start")}
    with _failover_after(feed, "ends"):
        cursor = feed.end_cursor()
        with pytest.raises(bagstore.ChangesLost, match="this cursor"):
            ds.changes(since=cursor)
        for to, consumer in consumers.items():
            feed.reset_consumer(f"reset-{to}", to=to)
            with pytest.raises(bagstore.ChangesLost, match=f"consumer 'reset-{to}'"):
                consumer.poll()
            consumer.close()
        new = ds.subscribe("new", print)
        with pytest.raises(bagstore.ChangesLost, match="consumer 'new'"):
            new.poll()
        new.close()
    feed.reset_consumer("reset-end", to="end")
    ds.put({"n": 5})
    seen: list[Any] = []
    after = ds.subscribe("reset-end", seen.extend)
    while after.poll():
        pass
    assert len(seen) == 1
    after.close()


def test_a_read_from_the_oldest_goes_on_past_pruned_buckets(topo: Topology) -> None:
    """A reader from the oldest change whose first page took no row of a
    bucket whose start was pruned goes on from its cursor: no ChangesPruned
    for a start it never asked for, and nothing skipped."""
    from bagstore.retention import prune_changes
    from bagstore.sharding.hashing import bucket_of

    ds = topo.open(buckets=4)
    ds.feed.enable(max_age=1)

    def in_bucket(bucket: int, n: int) -> list[bytes]:
        out: list[bytes] = []
        while len(out) < n:
            i = bagstore.new_id()
            if bucket_of(i, 4) == bucket:
                out.append(ds.put({"id": i, "b": bucket}))
        return out

    for b in range(4):
        in_bucket(b, 3)
    assert prune_changes(ds.feed, now=time.time_ns() // 1000 + 5_000_000) == 12
    first = in_bucket(1, 3)  # older than bucket 0's below
    then = in_bucket(0, 3)
    page = ds.changes(limit=2)
    assert [c.id for c in page] == first[:2]
    seen = [c.id for c in page]
    while True:
        page = ds.changes(since=page.cursor, limit=2)
        if not page:
            break
        seen += [c.id for c in page]
    assert seen == first + then
