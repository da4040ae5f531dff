"""The short put (bagstore.putone): one entity whose whole write is one
transaction on one shard skips the general path's grouping, and writes what
the general path writes; other puts keep the general path."""

from __future__ import annotations

import os
from typing import Any

import pytest

import bagstore
from bagstore import testing
from bagstore.errors import StalePlacement
from bagstore.sharding.router import Router
from tests.conftest import Topology

BY_USER = bagstore.Index(table="posts_by_user", properties=["user_id"])
BY_EMAIL = bagstore.Index(table="posts_by_email", properties=["email"], unique=True)


@pytest.fixture
def grouped(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many writes went through the router's grouping by shard (the
    general path), counted."""
    calls: list[int] = []
    original = Router.by_bucket

    def counting(self: Router, *args: Any) -> Any:
        calls.append(1)
        return original(self, *args)

    monkeypatch.setattr(Router, "by_bucket", counting)
    return calls


def _one_shard(topo: Topology, **kwargs: Any) -> bagstore.Datastore:
    ds = bagstore.Datastore(topo.urls[:1], kind="posts", **kwargs)
    topo._open.append(ds)
    return ds


def test_a_one_shard_put_is_one_transaction_and_keeps_its_index(
    topo: Topology, grouped: list[int]
) -> None:
    ds = _one_shard(topo, indexes=[BY_USER])
    post = {"user_id": 1, "title": "a"}
    entity_id = ds.put(post)
    assert post["id"] == entity_id  # a new id is set in the dict, as by the general path
    ds.put({"id": entity_id, "user_id": 2, "title": "b"})  # the old row goes, the new comes
    assert grouped == []
    assert BY_USER.get_all(ds, user_id=1) == []
    assert BY_USER.get_all(ds, user_id=2) == [{"id": entity_id, "user_id": 2, "title": "b"}]
    got = ds.get_with_version(entity_id)
    assert got is not None and got[1] > 0
    report = ds.check()
    assert (report["missing"], report["stale"]) == (0, 0)


def test_a_crash_after_the_short_put_leaves_entity_and_row_together(
    topo: Topology, grouped: list[int]
) -> None:
    ds = _one_shard(topo, indexes=[BY_USER])
    with testing.failpoint("put.after_entity"), pytest.raises(testing.SimulatedCrash):
        ds.put({"id": bytes(range(16)), "user_id": 5})
    with testing.failpoint("put.before_entity"), pytest.raises(testing.SimulatedCrash):
        ds.put({"id": bytes(range(1, 17)), "user_id": 6})
    assert grouped == []
    assert [e["id"] for e in BY_USER.get_all(ds, user_id=5)] == [bytes(range(16))]
    assert ds.get(bytes(range(1, 17))) is None and BY_USER.get_all(ds, user_id=6) == []
    report = ds.check()
    assert (report["missing"], report["stale"]) == (0, 0)


def test_bad_input_on_the_short_path_changes_nothing(topo: Topology) -> None:
    ds = _one_shard(topo, indexes=[BY_USER], max_body_bytes=1000)
    for bad in (
        {"id": b"short"},
        {"blob": os.urandom(2000)},
        {"when": object()},
        ["not", "a", "dict"],
    ):
        with pytest.raises(bagstore.InvalidEntity):
            ds.put(bad)  # type: ignore[arg-type]
    assert ds.count() == 0 and ds.check()["indexes"]["posts_by_user"]["stale"] == 0


@pytest.mark.parametrize("shape", ["unique", "keyed", "spread index", "put_many", "expect"])
def test_other_puts_keep_the_general_path(topo: Topology, grouped: list[int], shape: str) -> None:
    if shape == "unique":
        ds = _one_shard(topo, indexes=[BY_EMAIL])
    elif shape == "keyed":
        ds = topo.open(kind="posts", shard_key="user_id")
    elif shape == "spread index":
        ds = topo.open(kind="posts", indexes=[BY_USER])  # rows on other shards
    else:
        ds = _one_shard(topo, indexes=[BY_USER])
    post = {"user_id": 1, "email": "a@example.com"}
    if shape == "put_many":
        ds.put_many([post, {"user_id": 2}])  # (a put_many of one is a put)
    elif shape == "expect":
        ds.put(post, expect_version=0)
    else:
        ds.put(post)
    assert grouped, "the general path was not taken"
    assert ds.get(post["id"]) == post
    report = ds.check()
    assert (report["missing"], report["stale"]) == (0, 0)


def test_the_short_path_follows_the_indexes_as_they_change(
    topo: Topology, grouped: list[int]
) -> None:
    """What the short path works out once per registry (putone.Plan) is
    worked out again for an index added after its first put: a plain one
    is written in the entity's transaction, a unique one sends the put to
    the general path (its claim first)."""
    ds = _one_shard(topo)
    ds.put({"user_id": 1, "email": "a@example.com"})
    ds.add_index(BY_USER)  # building (the kind has an entity): maintained from now on
    second = ds.put({"user_id": 1, "email": "b@example.com"})
    assert grouped == []
    assert [e["id"] for e in BY_USER.get_all(ds, user_id=1, allow_partial=True)] == [second]
    ds.add_index(BY_EMAIL)
    third = ds.put({"user_id": 2, "email": "c@example.com"})
    assert grouped, "a unique index's put took the short path"
    assert [e["id"] for e in BY_EMAIL.get_all(ds, email="c@example.com", allow_partial=True)] == [
        third
    ]


def test_a_put_without_indexes_takes_the_short_path_on_many_shards(
    topo: Topology, grouped: list[int]
) -> None:
    ds = topo.open(kind="posts")
    ids = [ds.put({"n": n}) for n in range(20)]
    assert grouped == []
    assert [e["n"] for e in ds.get_many(ids)] == list(range(20))  # type: ignore[index]


def test_the_module_doctest_runs() -> None:
    import doctest

    from bagstore import putone

    failed, attempted = doctest.testmod(putone)
    assert (failed, attempted) == (0, 7)


@pytest.mark.parametrize("fenced", [0, 1, 3, 5])
@pytest.mark.parametrize("state", ["owned", "frozen", "gone"])
def test_a_write_checks_every_bucket_it_fences(topo: Topology, fenced: int, state: str) -> None:
    """The locked read counts the buckets a transaction writes in (its
    entity's and its index rows'), however few (SQLite sums a search a
    bucket up to four, counts over a list beyond): one bucket frozen or let
    go refuses the whole write."""
    from bagstore.backends import EntityRow
    from bagstore.sharding.hashing import bucket_of

    ds = topo.open(kind="posts")
    backend = ds.router.backends[0]
    mine = [b for b, s in enumerate(ds.placement.shard_of_bucket) if s == 0]
    entity_id = next(
        i
        for i in (bytes([k]) * 16 for k in range(256))
        if bucket_of(i, len(ds.placement.shard_of_bucket)) in mine
    )
    bucket = bucket_of(entity_id, len(ds.placement.shard_of_bucket))
    fence = [b for b in mine if b != bucket][:fenced]
    if state == "frozen":
        backend.set_bucket_state((fence or [bucket])[-1], 1)
    elif state == "gone":
        backend.release_bucket((fence or [bucket])[-1])
    row = EntityRow(entity_id, bucket, 1, bagstore.codec.encode({"id": entity_id}))
    write = lambda: backend.put_entities("posts", [row], read_old=True, fence=fence)  # noqa: E731
    if state == "owned":
        write()
        assert ds.get(entity_id) == {"id": entity_id}
    else:
        with pytest.raises(bagstore.KeyMigrating if state == "frozen" else StalePlacement):
            write()
        assert backend.get_bodies("posts", [entity_id]) == {}


def _row(ds: bagstore.Datastore, body: dict[str, Any]) -> Any:
    """An EntityRow of a new id for ``body`` on shard 0 of ``ds``."""
    from bagstore.backends import EntityRow
    from bagstore.sharding.hashing import bucket_of

    buckets = len(ds.placement.shard_of_bucket)
    entity_id = next(
        i
        for i in (os.urandom(16) for _ in range(10_000))
        if ds.placement.shard_of_bucket[bucket_of(i, buckets)] == 0
    )
    return EntityRow(entity_id, bucket_of(entity_id, buckets), 1, bagstore.codec.encode(body))


def test_a_failed_write_is_rolled_back_and_its_shard_goes_on(topo: Topology) -> None:
    """``Backend.write``: the work's statements are one transaction; an
    error inside rolls it back and is raised as it is, and the shard's next
    writes and reads go on (on SQLite, the thread's kept connection and
    cursor are given back)."""
    ds = topo.open(kind="posts")
    backend = ds.router.backends[0]
    row, other = _row(ds, {"n": 1}), _row(ds, {"n": 2})

    def fails(cur: Any, old: Any) -> None:
        raise ValueError("within fails")

    with pytest.raises(ValueError, match="within fails"):
        backend.put_entities("posts", [row], read_old=True, within=fails)
    assert backend.get_bodies("posts", [row.id]) == {}
    seen: list[Any] = []
    assert backend.write(lambda cur, *args: seen.append(args) or "done", 1, 2) == "done"
    assert seen == [(1, 2)]
    backend.put_entities("posts", [other], read_old=True, within=lambda cur, old: None)
    assert ds.get(other.id) == {"n": 2}
    if topo.name == "sqlite":
        assert backend._local.cur is backend._local.kept  # idle again, kept for the next


def test_a_sqlite_write_runs_again_after_a_busy_error_the_handler_left(topo: Topology) -> None:
    """A ``SQLITE_BUSY`` that SQLite's busy handler did not wait on (a stale
    WAL snapshot's) rolls the write back and runs it again; one that it
    waited on for ``busy_timeout`` is the shard's lock timeout."""
    import sqlite3

    if topo.name != "sqlite":
        pytest.skip("SQLite's busy handling")
    ds = topo.open(kind="posts")
    backend = ds.router.backends[0]
    backend.write(lambda cur: None)  # (the thread's connection made and kept)
    row = _row(ds, {"n": 1})
    runs: list[int] = []

    def busy_once(code: int) -> Any:
        def work(cur: Any, old: Any) -> None:
            runs.append(code)
            if len(runs) == 1:
                exc = sqlite3.OperationalError("database is locked")
                exc.sqlite_errorcode = code  # type: ignore[attr-defined]
                raise exc

        return work

    backend.put_entities("posts", [row], read_old=True, within=busy_once(517))  # BUSY_SNAPSHOT
    assert runs == [517, 517]
    assert ds.get(row.id) == {"n": 1}
    runs.clear()
    again = _row(ds, {"n": 2})
    with pytest.raises(bagstore.ShardTimeout, match="busy_timeout"):
        backend.put_entities("posts", [again], read_old=True, within=busy_once(5))  # SQLITE_BUSY
    assert runs == [5]
    assert backend.get_bodies("posts", [again.id]) == {}
    assert backend._local.cur is backend._local.kept
