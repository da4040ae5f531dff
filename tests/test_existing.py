"""``Datastore.existing``: which ids exist, read from their shards with no
body (the Cleaner's sweep of a non-unique index asks it), wherever the
placement puts them: by the id's hash over several shards, by a shard
key's directory, and after a bucket moved."""

from __future__ import annotations

import bagstore
from bagstore.sharding.hashing import bucket_of
from tests.conftest import Topology


def test_existing_names_the_ids_that_exist_on_every_shard(topo: Topology) -> None:
    ds = topo.open(buckets=16)
    ids = ds.put_many([{"n": n} for n in range(40)])
    gone = ids[::5]
    for entity_id in gone:
        assert ds.delete(entity_id)
    never = [bagstore.new_id() for _ in range(5)]
    assert len({ds.placement.shard_of_bucket[bucket_of(i, 16)] for i in ids}) > 1
    assert ds.existing(ids + never) == set(ids) - set(gone)
    assert ds.existing([]) == set()
    assert ds.existing(never) == set()


def test_existing_follows_a_shard_key_and_a_moved_bucket(topo: Topology) -> None:
    posts = topo.open(
        kind="posts", shard_key="user", shard_map="directory", buckets=8, refresh_interval=0
    )
    ids = posts.put_many([{"user": f"u{n % 3}", "n": n} for n in range(12)])
    assert posts.existing(ids) == set(ids)
    home = posts.bucket_of_id(ids[0])
    assert home is not None
    shard_of = posts.placement.shard_of_bucket
    far = next(s for s in set(shard_of) if s != shard_of[home])
    posts.move_buckets([home], to=far, grace=0)
    assert posts.placement.shard_of_bucket[home] == far
    assert posts.existing([*ids, bagstore.new_id()]) == set(ids)
