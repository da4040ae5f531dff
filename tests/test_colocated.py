"""One commit when the rows live together: an entity's index rows (indexes that
are not unique) and its lookup row on its own shard are written in its
transaction; rows on other shards keep the old order.  Each failpoint, for the
co-located and the cross-shard case, on both backends."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import pytest

import bagstore
from bagstore import testing
from bagstore.colocated import AFTER, ATOMIC, PARTLY
from tests.conftest import Topology

BY_USER = bagstore.Index(table="posts_by_user", properties=["user_id", "n"])
BY_TAG = bagstore.Index(table="posts_by_tag", properties=["tag"])
BY_EMAIL = bagstore.Index(table="posts_by_email", properties=["email"], unique=True)


def _store(topo: Topology, **kwargs: Any) -> bagstore.Datastore:
    return topo.open(kind="posts", shard_key="user_id", indexes=[BY_USER, BY_TAG], **kwargs)


def _away_tags(ds: bagstore.Datastore, user: str) -> tuple[str, str]:
    """Two tags whose posts_by_tag rows live on other shards than ``user``'s
    posts (for the cross-shard case)."""
    topology = ds.router.topology
    shard_of = topology.shard_of_bucket
    home = shard_of[ds.placer.entity_bucket({"user_id": user}, bytes(16))]
    found = [
        tag
        for tag in (f"tag{k}" for k in range(200))
        if all(
            shard_of[r.bucket] != home
            for r in BY_TAG.rows_for({"tag": tag}, bytes(16), topology.buckets)
        )
    ]
    return found[0], found[1]


def _lookup_rows(ds: bagstore.Datastore) -> int:
    return sum(b.count("bagstore_ids") for b in ds.router.backends)


def _counts(ds: bagstore.Datastore, table: str) -> tuple[int, int]:
    report = ds.check()["indexes"][table]
    return report["missing"], report["stale"]


def test_status_says_which_indexes_are_atomic(topo: Topology, tmp_path: Path) -> None:
    ds = topo.open(kind="posts", shard_key="user_id", indexes=[BY_USER, BY_TAG, BY_EMAIL])
    writes = ds.status()["index_writes"]
    assert writes["posts_by_user"] == ATOMIC  # shard_on is the kind's shard key
    assert writes["posts_by_tag"] == PARTLY
    assert writes["posts_by_email"].startswith(AFTER)
    with bagstore.open(tmp_path / "one", shards=1, indexes=[BY_TAG]) as one:
        assert one.status()["index_writes"] == {"posts_by_tag": ATOMIC}


@pytest.mark.parametrize("point", ["put.after_entity", "put.after_index_delete"])
def test_a_crash_after_the_commit_leaves_colocated_rows_whole(topo: Topology, point: str) -> None:
    ds = _store(topo)
    a, b = _away_tags(ds, "ann")  # posts_by_tag: rows on other shards
    old = {"user_id": "ann", "n": 1, "tag": a}
    new = {"user_id": "ann", "n": 2, "tag": b}
    entity_id = ds.put(dict(old))
    with testing.failpoint(point), pytest.raises(testing.SimulatedCrash):
        ds.put({"id": entity_id, **new})
    assert ds.get(entity_id) == {"id": entity_id, **new}
    assert _counts(ds, "posts_by_user") == (0, 0)  # written with the entity
    assert [e["id"] for e in BY_USER.get_all(ds, user_id="ann", n=2)] == [entity_id]
    # the cross-shard index: the old order, rows missing and (before the deletes) stale
    assert _counts(ds, "posts_by_tag") == ((1, 1) if point == "put.after_entity" else (1, 0))


def test_a_crash_after_a_delete_leaves_colocated_rows_gone(topo: Topology) -> None:
    ds = _store(topo)
    entity_id = ds.put({"user_id": "ann", "n": 1, "tag": _away_tags(ds, "ann")[0]})
    with testing.failpoint("delete.after_entity"), pytest.raises(testing.SimulatedCrash):
        ds.delete(entity_id)
    assert ds.get(entity_id) is None
    assert _counts(ds, "posts_by_user") == (0, 0)
    assert _counts(ds, "posts_by_tag") == (0, 1)


def test_on_one_shard_every_plain_index_is_atomic(topo: Topology) -> None:
    ds = topo.open(indexes=[BY_TAG, BY_EMAIL], buckets=8)
    ds.move_buckets(list(range(8)), to=0, grace=0)  # every bucket on shard 0
    entity_id = ds.put({"tag": "a", "email": "a@x"})
    assert ds.status()["index_writes"]["posts_by_tag"] == ATOMIC
    with testing.failpoint("put.after_entity"), pytest.raises(testing.SimulatedCrash):
        ds.put({"id": entity_id, "tag": "b", "email": "b@x"})
    report = ds.check()
    assert report["indexes"]["posts_by_tag"]["missing"] == 0
    assert report["indexes"]["posts_by_tag"]["stale"] == 0
    assert report["indexes"]["posts_by_email"]["stale"] == 1  # unique: claimed, old one left
    assert [e["id"] for e in BY_TAG.get_all(ds, tag="b")] == [entity_id]


def test_a_failed_transaction_writes_no_colocated_row(topo: Topology) -> None:
    """The rows are in the entity's transaction: a refused (conditional) write
    leaves none of them, and neither does a crash before the entity."""
    ds = _store(topo)
    entity_id = ds.put({"user_id": "ann", "n": 1, "tag": "a"})
    _, version = ds.get_with_version(entity_id)  # type: ignore[misc]
    with pytest.raises(bagstore.Conflict):
        ds.put({"id": entity_id, "user_id": "ann", "n": 5, "tag": "a"}, expect_version=version + 1)
    assert BY_USER.get_all(ds, user_id="ann", n=5) == []
    assert _counts(ds, "posts_by_user") == (0, 0)
    lookups = _lookup_rows(ds)
    fresh = {"user_id": "bob", "n": 1, "tag": "z"}
    with testing.failpoint("put.before_entity"), pytest.raises(testing.SimulatedCrash):
        ds.put(fresh)
    assert ds.count() == 1 and _counts(ds, "posts_by_user") == (0, 0)
    assert _lookup_rows(ds) - lookups in (0, 1)  # only a lookup row on another shard


def test_the_lookup_row_commits_with_its_entity_on_one_shard(topo: Topology) -> None:
    ds = topo.open(kind="posts", shard_key="user_id", buckets=8)
    ds.move_buckets(list(range(8)), to=0, grace=0)
    with testing.failpoint("put.before_entity"), pytest.raises(testing.SimulatedCrash):
        ds.put({"user_id": "ann", "n": 1})
    assert _lookup_rows(ds) == 0  # nothing written before the entity any more
    entity_id = ds.put({"user_id": "ann", "n": 1})
    assert _lookup_rows(ds) == 1
    fresh = topo.open(kind="posts", shard_key="user_id")
    assert fresh.get(entity_id) == {"id": entity_id, "user_id": "ann", "n": 1}


def test_put_many_writes_each_shards_rows_with_its_entities(topo: Topology) -> None:
    ds = _store(topo)
    bodies = [{"user_id": f"u{k % 7}", "n": k, "tag": f"t{k % 3}"} for k in range(60)]
    ids = ds.put_many(bodies)
    with testing.failpoint("put.after_entity"), pytest.raises(testing.SimulatedCrash):
        ds.put_many([{**b, "id": i, "n": b["n"] + 100} for b, i in zip(bodies, ids, strict=True)])
    assert _counts(ds, "posts_by_user") == (0, 0)
    missing, stale = _counts(ds, "posts_by_tag")
    assert missing == stale == 0  # the tags did not change
    assert len(BY_USER.get_all(ds, user_id="u1", n__gte=100)) == len(
        [b for b in bodies if b["user_id"] == "u1"]
    )
    ds.delete_many(ids)
    assert ds.check()["stale"] == 0 and ds.count() == 0


def test_one_shard_put_many_of_new_and_old_entities_keeps_rows_and_cache_right(
    topo: Topology,
) -> None:
    """On one shard, the rows of a put_many's entities that had no row are
    written as one change per index (not one per entity): the rows, a
    reader's cached index pages (shared cache) and a conditional put_many
    refused on the shard are as with one change per entity."""
    cache = f"memory://coloc{os.getpid()}x{uuid.uuid4().hex}"
    ds = bagstore.Datastore(topo.urls[:1], kind="posts", indexes=[BY_TAG], cache=cache)
    reader = bagstore.Datastore(topo.urls[:1], kind="posts", indexes=[BY_TAG], cache=cache)
    try:
        _new_and_old(ds, reader)
    finally:
        ds.close()
        reader.close()


def _new_and_old(ds: bagstore.Datastore, reader: bagstore.Datastore) -> None:
    first = ds.put_many([{"tag": "a", "n": k} for k in range(3)])

    def tagged(tag: str) -> list[bytes]:
        return sorted(e["id"] for e in BY_TAG.get_all(reader, tag=tag))

    assert tagged("a") == sorted(first)  # the page cached
    assert tagged("a") == sorted(first)
    more = ds.put_many([{"tag": "a", "n": 5}, {"tag": "a", "n": 6}])  # new entities alone
    assert tagged("a") == sorted([*first, *more])
    first += more
    mixed = [{"tag": "a", "n": 10}, {"id": first[0], "tag": "b", "n": 0}, {"tag": "b", "n": 11}]
    made = ds.put_many(mixed)
    assert made[1] == first[0]
    assert tagged("a") == sorted([*first[1:], made[0]])
    assert tagged("b") == sorted(made[1:])
    assert _counts(ds, "posts_by_tag") == (0, 0)
    _, version = ds.get_with_version(first[1])  # type: ignore[misc]
    with pytest.raises(bagstore.Conflict):
        ds.put_many(
            [{"tag": "c", "n": 20}, {"id": first[1], "tag": "c", "n": 1}],
            expect_versions={first[1]: version + 1},
        )
    assert tagged("c") == [] and _counts(ds, "posts_by_tag") == (0, 0)
    assert ds.count() == 7
