"""The flat-out backfill's own paths: one-transaction fenced inserts, the
stamps check answered from what a batch read, and batches read ahead while
the previous one is written."""

from __future__ import annotations

import os

import pytest

import bagstore
from bagstore import keys
from bagstore.backends.indexsql import IndexRow
from tests.conftest import Topology

link_idx = bagstore.Index(table="index_link", properties=["link"], shard_on="link")


def consistent(ds: bagstore.Datastore) -> bool:
    report = ds.check()
    return (report["missing"], report["stale"]) == (0, 0)


def _rows(buckets: list[int]) -> list[IndexRow]:
    return [
        IndexRow((keys.encode_value(f"http://x/{os.urandom(4).hex()}"),), os.urandom(16), b)
        for b in buckets
    ]


def test_bulk_insert_is_fenced_and_all_or_nothing(topo: Topology) -> None:
    """A bulk insert with one row of a bucket this shard does not own (or has
    frozen) raises and writes none of its rows; of owned buckets it writes
    every row once, and again leaves them alone."""
    ds = topo.open(indexes=[link_idx], buckets=64)
    backend = ds.router.backends[0]
    owned = ds.placement.buckets_of_shard(0)
    foreign = next(b for b in range(64) if b not in owned)
    with pytest.raises(bagstore.StalePlacement):
        backend.bulk_insert_index_rows("index_link", ["link"], _rows([owned[0]] * 30 + [foreign]))
    assert backend.count("index_link") == 0
    backend.set_bucket_state(owned[1], 1)  # FROZEN, as a move does
    with pytest.raises(bagstore.KeyMigrating):
        backend.bulk_insert_index_rows("index_link", ["link"], _rows([owned[0], owned[1]]))
    assert backend.count("index_link") == 0
    backend.set_bucket_state(owned[1], 0)
    backend.bulk_rows_per_statement = 7  # several statements in the one transaction
    rows = _rows([owned[0], owned[1]] * 20)
    assert backend.bulk_insert_index_rows("index_link", ["link"], rows) == 40
    assert backend.bulk_insert_index_rows("index_link", ["link"], rows) == 0
    assert backend.count("index_link") == 40


@pytest.mark.parametrize("packed", [False, True])
def test_stamps_text_tells_a_changed_range(topo: Topology, packed: bool) -> None:
    """``scan_bodies`` reads bodies and their stamps in one go; ``stamps_text``
    gives the same text until a row of the range changes, goes or comes, and
    then says which."""
    from bagstore.backfill import parse_stamps

    ds = topo.open()
    ds.put_many([{"link": f"l{i}"} for i in range(60)])
    backend = max(ds.router.backends, key=lambda b: b.count(ds.kind))
    rows, text = backend.scan_bodies(ds.kind, 0, 1000, packed=packed)
    stamps = parse_stamps(text)
    assert [i for i, _ in rows] == list(stamps)  # in added_id order, one each
    assert {i for i, _ in rows} == set(backend.get_bodies(ds.kind, list(stamps)))
    last = max(a for a, _ in stamps.values())
    assert backend.stamps_text(ds.kind, 0, last, packed=packed) == text
    assert backend.stamps_text(ds.kind, 0, last, packed=not packed) == text
    five, five_text = backend.scan_bodies(ds.kind, 0, 5, packed=packed)
    assert five == rows[:5] and five_text == ",".join(text.split(",")[:5])
    changed, gone = rows[1][0], rows[2][0]
    ds.put({"id": changed, "link": "changed"})
    ds.delete(gone)
    now = parse_stamps(backend.stamps_text(ds.kind, 0, last, packed=packed))
    assert now[changed][1] != stamps[changed][1] and gone not in now
    assert {i for i in stamps if now.get(i) != stamps[i]} == {changed, gone}
    assert backend.scan_bodies(ds.kind, last, 10, packed=packed) == ([], "")


@pytest.mark.parametrize("batch", [7, None])
def test_flat_out_backfill_stopped_and_resumed(topo: Topology, batch: int | None) -> None:
    """A flat-out backfill (batches read ahead of the writes) stopped halfway
    leaves checkpoints; the next run resumes from them and finishes."""
    ds = topo.open()
    ds.put_many([{"link": f"l{i % 97}"} for i in range(600)])
    ds.add_index(link_idx)
    cleaner = bagstore.Cleaner(ds, duty=0, settle=0, batch=batch)

    def stop_halfway(done: int, total: int) -> None:
        if done >= total // 2:
            cleaner.stop()

    first = cleaner.backfill("index_link", progress=stop_halfway)
    assert ds.indexes()["index_link"][1] == "building"
    assert 0 < first.entities < 600 or batch is None
    second = bagstore.Cleaner(ds, duty=0, settle=0, batch=batch).backfill("index_link")
    assert first.entities + second.entities >= 600
    assert ds.indexes()["index_link"][1] == "ready"
    assert len(link_idx.get_all(ds, link__gte="l")) == 600
    assert consistent(ds)


def test_flat_out_batch_default_and_bad_batch(topo: Topology) -> None:
    ds = topo.open()
    assert bagstore.Cleaner(ds).batch == 1000
    assert bagstore.Cleaner(ds).bulk_batch == 5000
    assert bagstore.Cleaner(ds, batch=50).bulk_batch == 50
    with pytest.raises(bagstore.ConfigurationError):
        bagstore.Cleaner(ds, batch=0)


@pytest.mark.parametrize("unique", [False, True])
def test_backfill_rows_are_the_writers_rows(topo: Topology, unique: bool) -> None:
    """The backfill's inline row building (one property) gives the rows a
    writer gives, for every kind of value: lists, values with no index
    encoding, values too long for a unique index, missing properties."""
    index = bagstore.Index(table="index_v", properties=["v"], unique=unique)
    ds = topo.open()
    values: list[object] = [
        "s",
        b"b",
        3,
        2.5,
        True,
        None,
        {"a": 1},
        "x" * 400,
        ["l1", "l2"],
        [],
        float("nan"),
    ]
    ds.put_many([{"v": v} for v in values] + [{"other": 1}])
    ds.add_index(index)
    assert bagstore.Cleaner(ds, duty=0, settle=0).backfill("index_v").entities == 12
    assert consistent(ds)
