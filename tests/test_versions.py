"""Versions never go back for an id: across delete and re-create, bucket moves,
key migration, a key change that moves the entity, and on tables made by an
older bagstore (MariaDB's INT column widened)."""

from __future__ import annotations

import pymysql
import pytest

import bagstore
from bagstore.sharding.hashing import bucket_of
from bagstore.versions import clock, next_version
from tests import servers
from tests.conftest import Topology


def _version(ds: bagstore.Datastore, entity_id: bytes) -> int:
    return ds.fetch_many([entity_id])[entity_id].version


def test_next_version_is_above_the_one_found_and_the_clock() -> None:
    before = clock()
    assert next_version(None) >= before
    ahead = clock() + 10**12  # a version written by a clock far ahead
    assert next_version(ahead) == ahead + 1
    assert clock() >= before  # never below a value it returned


@pytest.mark.parametrize("indexed", [False, True])
def test_delete_and_recreate_grows_the_version(topo: Topology, indexed: bool) -> None:
    indexes = [bagstore.Index(table="index_n", properties=["n"])] if indexed else []
    ds = topo.open(indexes=indexes)
    entity_id = ds.put({"n": 1})
    seen = [_version(ds, entity_id)]
    for n in range(2, 5):
        ds.put({"id": entity_id, "n": n})
        seen.append(_version(ds, entity_id))
    assert ds.delete(entity_id)
    ds.put({"id": entity_id, "n": 9})
    seen.append(_version(ds, entity_id))
    ds.put_many([{"id": entity_id, "n": 10}])
    seen.append(_version(ds, entity_id))
    assert seen == sorted(set(seen)), seen  # strictly increasing


def test_put_reports_the_version_it_wrote(topo: Topology) -> None:
    """put_entities fills ``versions`` (the cache markers and a change feed
    read it) with exactly what the row holds afterwards."""
    ds = topo.open()
    entity_id = ds.put({"n": 1})
    backend = ds.router.topology.backend_of(bucket_of(entity_id, ds.placement.buckets))
    versions: dict[bytes, int] = {}
    from bagstore.backends import EntityRow

    row = EntityRow(entity_id, bucket_of(entity_id, ds.placement.buckets), 1, b"x")
    backend.put_entities("entities", [row], read_old=False, versions=versions)
    assert versions == {entity_id: backend.versions("entities", [entity_id])[entity_id][0]}
    gone: dict[bytes, int] = {}
    backend.delete_entities("entities", [entity_id], [row.bucket], read_old=False, versions=gone)
    assert gone == versions


def test_a_bucket_move_keeps_the_version(topo: Topology) -> None:
    ds = topo.open(buckets=16)
    entity_id = ds.put({"n": 1})
    ds.put({"id": entity_id, "n": 2})
    before = _version(ds, entity_id)
    bucket = bucket_of(entity_id, 16)
    to = (ds.placement.shard_of_bucket[bucket] + 1) % len(ds.shards)
    ds.move_buckets([bucket], to=to, grace=0)
    assert ds.placement.shard_of_bucket[bucket] == to
    assert _version(ds, entity_id) == before
    ds.delete(entity_id)
    ds.put({"id": entity_id, "n": 3})
    assert _version(ds, entity_id) > before


def test_key_migration_and_key_change_keep_versions_growing(topo: Topology) -> None:
    ds = topo.open(kind="posts", shard_key="user_id", shard_map="directory", buckets=16)
    entity_id = ds.put({"user_id": "ann", "n": 1})
    before = _version(ds, entity_id)
    old = ds.bucket_of_id(entity_id)
    assert old is not None
    ds.migrate_key("ann", (old + 5) % 16, wait=0)
    assert ds.bucket_of_id(entity_id) == (old + 5) % 16
    assert _version(ds, entity_id) == before  # the copy keeps it
    ds.put({"id": entity_id, "user_id": "bob", "n": 2})  # to bob's bucket
    moved = _version(ds, entity_id)
    assert moved > before
    ds.delete(entity_id)
    ds.put({"id": entity_id, "user_id": "ann", "n": 3})
    assert _version(ds, entity_id) > moved


def test_an_older_mariadb_table_gets_a_wide_version_column(mysql_main: object) -> None:
    name = servers.unique_name("ver")
    url = f"mysql://root@127.0.0.1:3306/{name}"
    try:
        bagstore.Datastore([url], buckets=4).close()
        conn = pymysql.connect(host="127.0.0.1", port=3306, user="root", database=name)
        try:
            with conn.cursor() as cur:  # as bagstore made it before
                cur.execute("ALTER TABLE entities MODIFY version INT UNSIGNED NOT NULL DEFAULT 1")
        finally:
            conn.close()
        with bagstore.Datastore([url]) as ds:
            entity_id = ds.put({"n": 1})
            assert _version(ds, entity_id) >= 2**32  # a clock version fits now
            assert ds.get(entity_id) == {"id": entity_id, "n": 1}
    finally:
        servers.drop_databases("127.0.0.1", 3306, [name], "root", "")
