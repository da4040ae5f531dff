"""Whole-key migration: every kind placed by the shard key moves, under a writer."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

import bagstore
from bagstore.keymove import encode_key
from bagstore.sharding.directory import MIGRATING, NORMAL
from tests.conftest import Topology, buckets_of_rows

DIRECTORY = {"shard_key": "user_id", "shard_map": "directory", "buckets": 64}


def _clean(ds: bagstore.Datastore) -> bool:
    report = ds.check()
    return (report["missing"], report["stale"]) == (0, 0)


def test_whole_key_migration_under_a_writer(topo: Topology) -> None:
    """A writer keeps writing the key's posts and photos while the key
    migrates: writes are refused (retryably) for a while, none is lost, every
    entity of the key, of both kinds, ends in the new bucket, the indexes stay
    complete, and other keys and kinds placed by hash are left alone."""
    posts = topo.open(
        kind="posts",
        refresh_interval=0.3,
        indexes=[bagstore.Index(table="posts_by_user", properties=["user_id", "n"])],
        **DIRECTORY,
    )
    photos = topo.open(
        kind="photos",
        refresh_interval=0.3,
        indexes=[bagstore.Index(table="photos_by_n", properties=["n"])],
        **DIRECTORY,
    )
    notes = topo.open(kind="notes", shard_key="user_id", buckets=64)  # the hash map
    ids = {
        "posts": [posts.put({"user_id": "ann", "n": n}) for n in range(30)],
        "photos": [photos.put({"user_id": "ann", "n": n}) for n in range(20)],
    }
    bob = posts.put({"user_id": "bob", "n": 0})
    bob_bucket = buckets_of_rows(posts, "posts")[bob]
    note = notes.put({"user_id": "ann", "n": 0})
    olds = {
        buckets_of_rows(posts, "posts")[ids["posts"][0]],
        buckets_of_rows(posts, "photos")[ids["photos"][0]],
    }
    target = next(b for b in range(64) if b not in olds)
    acked: dict[str, list[bytes]] = {"posts": [], "photos": []}
    refused = [0]
    stop = threading.Event()

    def writer() -> None:
        n = 100
        while not stop.is_set():
            for kind, ds in (("posts", posts), ("photos", photos)):
                try:
                    acked[kind].append(ds.put({"user_id": "ann", "n": n}))
                except bagstore.KeyMigrating:
                    refused[0] += 1
                    time.sleep(0.01)
                n += 1

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        time.sleep(0.1)
        moved = bagstore.Mover(posts).migrate_key_by_kind("ann", target)
        time.sleep(0.1)
    finally:
        stop.set()
        thread.join()
    assert refused[0] > 0  # writes were told to retry while it moved
    assert set(moved) == {"posts", "photos"}  # notes is placed by hash: not a candidate
    assert moved["posts"] >= 30 and moved["photos"] >= 20
    for kind in ("posts", "photos"):
        fresh = topo.open(kind=kind, **DIRECTORY)
        every = ids[kind] + acked[kind]
        assert all(e is not None for e in fresh.get_many(every)), kind  # nothing lost
        where = buckets_of_rows(fresh, kind)
        assert {where[i] for i in every} == {target}, kind
        assert fresh.count() == len(every) + (1 if kind == "posts" else 0)
        assert _clean(fresh), kind
        assert fresh.placer.directory is not None
        assert fresh.placer.directory.lookup(encode_key("ann")) == (target, NORMAL)
    assert buckets_of_rows(posts, "posts")[bob] == bob_bucket  # other keys stay put
    assert posts.get(bob) == {"id": bob, "user_id": "bob", "n": 0}
    assert notes.get(note) == {"id": note, "user_id": "ann", "n": 0}
    again = bagstore.Mover(photos).migrate_key_by_kind("ann", target, wait=0)
    assert again == {"photos": 0, "posts": 0}  # already there: nothing to do


def test_migrate_key_finishes_a_migration_a_crash_left(topo: Topology) -> None:
    """One kind's entry flipped and the other still frozen (a crash between
    the two): running it again moves what is left and unfreezes the key."""
    posts = topo.open(kind="posts", **DIRECTORY)
    photos = topo.open(kind="photos", **DIRECTORY)
    post = posts.put({"user_id": "ann"})
    photo = photos.put({"user_id": "ann"})
    assert photos.placer.directory is not None
    key = encode_key("ann")
    old = buckets_of_rows(photos, "photos")[photo]
    target = (old + 1) % 64
    photos.placer.directory.set(key, old, MIGRATING)
    with pytest.raises(bagstore.KeyMigrating):
        photos.put({"user_id": "ann"})
    assert posts.migrate_key("ann", target, wait=0) == 2
    assert buckets_of_rows(posts, "posts")[post] == target
    assert buckets_of_rows(photos, "photos")[photo] == target
    fresh = topo.open(kind="photos", **DIRECTORY)  # (photos caches the frozen entry)
    assert fresh.get(fresh.put({"user_id": "ann", "n": 1})) is not None


def test_migrate_key_refuses_bad_input(topo: Topology) -> None:
    posts = topo.open(kind="posts", **DIRECTORY)
    plain = topo.open(kind="plain")
    with pytest.raises(bagstore.ConfigurationError):
        posts.migrate_key("ann", 64)
    with pytest.raises(bagstore.ConfigurationError):
        posts.migrate_key("ann", True)  # type: ignore[arg-type]
    with pytest.raises(bagstore.ConfigurationError):
        posts.migrate_key({"a": 1}, 3)
    with pytest.raises(bagstore.ConfigurationError):
        plain.migrate_key("ann", 3)


def test_cli_key_migrate_moves_every_kind_of_the_key(tmp_path: Path) -> None:
    """``bagstore key migrate --kind posts`` moves the key's photos too, and
    says how many of each kind (text and ``--json``)."""
    from click.testing import CliRunner

    from bagstore.cli import cli

    store = tmp_path / "s"
    opts = {"shard_key": "user", "shard_map": "directory", "buckets": 16}
    with bagstore.open(store, kind="posts", **opts) as posts:
        post_ids = [posts.put({"user": "ann", "n": i}) for i in range(3)]
    with bagstore.open(store, kind="photos", **opts) as photos:
        photo_ids = [photos.put({"user": "ann", "n": i}) for i in range(2)]
    args = ["--store", str(store), "key", "migrate", "--kind", "posts", "--shard-key", "user"]
    result = CliRunner().invoke(cli, [*args, "--wait", "0", '"ann"', "9"])
    assert result.exit_code == 0, result.output
    assert "moved 5 entities" in result.output and "photos 2" in result.output
    for kind, ids in (("posts", post_ids), ("photos", photo_ids)):
        with bagstore.open(store, kind=kind, **opts) as ds:
            assert {ds.bucket_of_id(i) for i in ids} == {9}
    again = CliRunner().invoke(cli, [*args, "--wait", "0", "--json", '"ann"', "3"])
    assert again.exit_code == 0, again.output
    doc = json.loads(again.output)
    assert doc["moved"] == 5 and doc["kinds"] == {"posts": 3, "photos": 2}
