"""Repair removes unique rows left by crashes, as the claim rules allow (issue #21, 3)."""

from __future__ import annotations

import time

import pytest

import bagstore
from bagstore import testing
from bagstore.errors import DuplicateValue
from tests.conftest import Topology

email_idx = bagstore.Index(table="index_ru_email", properties=["email"], unique=True)
LEASE = 0.3  # seconds a claim without its entity counts as a write in flight


def open_store(topo: Topology) -> bagstore.Datastore:
    return topo.open(indexes=[email_idx], unique_lease=LEASE)


def past_the_lease() -> None:
    time.sleep(LEASE + 0.05)


def problems(ds: bagstore.Datastore) -> tuple[int, int]:
    report = ds.check()
    return report["missing"], report["stale"]


def test_repair_removes_the_unique_row_of_a_crashed_delete(topo: Topology) -> None:
    ds = open_store(topo)
    entity_id = ds.put({"email": "a@x"})
    kept = ds.put({"email": "b@x"})
    with pytest.raises(testing.SimulatedCrash), testing.failpoint("delete.after_entity"):
        ds.delete(entity_id)
    assert ds.get(entity_id) is None
    assert problems(ds) == (0, 1)
    past_the_lease()
    stats = bagstore.Cleaner(ds, settle=0).repair()
    assert stats.removed == 1
    assert problems(ds) == (0, 0)
    assert bagstore.Cleaner(ds, settle=0).repair().removed == 0
    assert email_idx.get(ds, email="a@x") is None
    assert email_idx.get(ds, email="b@x") == {"id": kept, "email": "b@x"}
    # the value is free again; the other one is still held
    newcomer = ds.put({"email": "a@x"})
    assert email_idx.get(ds, email="a@x") == {"id": newcomer, "email": "a@x"}
    with pytest.raises(DuplicateValue):
        ds.put({"email": "b@x"})
    assert problems(ds) == (0, 0)


def test_repair_keeps_a_claim_whose_write_may_be_in_flight(topo: Topology) -> None:
    """A claim is written before its entity: a claim without its entity is left
    alone until the lease runs out (a put may still be writing it)."""
    ds = open_store(topo)
    pending = bagstore.new_id()
    with pytest.raises(testing.SimulatedCrash), testing.failpoint("put.before_entity"):
        ds.put({"id": pending, "email": "c@x"})
    cleaner = bagstore.Cleaner(ds, settle=0)
    assert cleaner.repair().removed == 0  # right after the claim: maybe in flight
    with pytest.raises(DuplicateValue, match="in progress"):
        ds.put({"email": "c@x"})
    past_the_lease()
    assert cleaner.repair().removed == 1
    assert problems(ds) == (0, 0)
    other = ds.put({"email": "c@x"})
    assert email_idx.get(ds, email="c@x") == {"id": other, "email": "c@x"}


def test_repair_after_a_put_that_changed_the_unique_value_crashed(topo: Topology) -> None:
    ds = open_store(topo)
    entity_id = ds.put({"email": "old@x", "n": 1})
    bystander = ds.put({"email": "other@x", "n": 2})
    with pytest.raises(testing.SimulatedCrash), testing.failpoint("put.after_entity"):
        ds.put({"id": entity_id, "email": "new@x", "n": 1})
    assert ds.get(entity_id) == {"id": entity_id, "email": "new@x", "n": 1}
    assert problems(ds) == (0, 1)  # the old value's row
    # The entity was written after its new claim: the old row is not a write in
    # flight, so no lease to wait for.
    stats = bagstore.Cleaner(ds, settle=0).repair()
    assert (stats.written, stats.removed) == (0, 1)
    assert problems(ds) == (0, 0)
    rows = [
        bytes(r[0])
        for b in ds.router.backends
        for r in b.fetchall("SELECT entity_id FROM index_ru_email")
    ]
    assert sorted(rows) == sorted([entity_id, bystander])  # one row each, nothing else
    assert email_idx.get(ds, email="new@x") == {"id": entity_id, "email": "new@x", "n": 1}
    assert email_idx.get(ds, email="old@x") is None
    with pytest.raises(DuplicateValue):
        ds.put({"email": "new@x"})
    taker = ds.put({"email": "old@x"})  # the old value is free again
    assert email_idx.get(ds, email="old@x") == {"id": taker, "email": "old@x"}
    assert problems(ds) == (0, 0)


def test_sweep_removes_a_unique_row_whose_entity_moved_on(topo: Topology) -> None:
    """A unique row whose entity exists but holds another value is removed by
    the sweep too (a repair limited to recent entities does not read it)."""
    ds = open_store(topo)
    entity_id = ds.put({"email": "first@x"})
    with pytest.raises(testing.SimulatedCrash), testing.failpoint("put.after_entity"):
        ds.put({"id": entity_id, "email": "second@x"})
    future = time.time_ns() // 1000 + 60_000_000  # no entity updated since: sweep only
    stats = bagstore.Cleaner(ds, settle=0).repair(since=future)
    assert (stats.entities, stats.removed) == (0, 1)
    assert problems(ds) == (0, 0)


def test_repair_keeps_the_new_claim_of_an_existing_entity_in_flight(topo: Topology) -> None:
    """A put changing an entity's unique value claims the new value before it
    writes the entity: a repair reading the old body meanwhile must not take
    the claim away (another entity could then take the value: two owners)."""
    ds = open_store(topo)
    entity_id = ds.put({"email": "was@x"})
    with pytest.raises(testing.SimulatedCrash), testing.failpoint("put.before_entity"):
        ds.put({"id": entity_id, "email": "will@x"})
    cleaner = bagstore.Cleaner(ds, settle=0)
    assert cleaner.repair().removed == 0
    with pytest.raises(DuplicateValue, match="in progress"):
        ds.put({"email": "will@x"})
    past_the_lease()  # the put never finished: its claim is dead now
    assert cleaner.repair().removed == 1
    assert problems(ds) == (0, 0)
    assert email_idx.get(ds, email="was@x") == {"id": entity_id, "email": "was@x"}
    assert ds.put({"email": "will@x"})
