"""Large bodies over many buckets: a reader whose memory budget has no room
for each bucket's next changes with their bodies reads them without, and
reads the bodies of the changes a page returns (bagstore.feedread); the
pages are the same whatever the budget, on SQLite and MariaDB."""

from __future__ import annotations

import random
import tracemalloc
from typing import Any

import pytest

import bagstore
from bagstore import feedread, feedstream
from tests.conftest import Topology, same_pages


def _fill(ds: bagstore.Datastore, n: int, size: int, seed: int) -> None:
    """``n`` entities of ``size`` random (incompressible) bytes, then a tenth
    of them updated and a tenth deleted."""
    rng = random.Random(seed)
    ids: list[bytes] = []
    for start in range(0, n, 50):
        ids += ds.put_many([{"blob": rng.randbytes(size)} for _ in range(min(50, n - start))])
    for i in ids[: n // 10]:
        ds.put({"id": i, "blob": rng.randbytes(size)})
    for i in ids[-(n // 10) :]:
        ds.delete(i)


def _seen(c: bagstore.Change) -> tuple[Any, ...]:
    """A change as a test keeps it: its body as a hash (the bodies kept
    would weigh on the memory measured)."""
    entity = c.entity
    body = None if entity is None else hash(entity["blob"])
    return (c.bucket, c.position, c.id, c.op, c.version, body)


def _read_all(ds: bagstore.Datastore, budget: int, limit: int) -> tuple[list[Any], int]:
    """Every change (:func:`_seen`), in the order read, pages of ``limit``;
    the peak memory traced meanwhile."""
    ds.feed.read_ahead_bytes = budget
    got: list[Any] = []
    since = None
    tracemalloc.start()
    try:
        while page := ds.changes(since=since, limit=limit):
            got += map(_seen, page)
            since = page.cursor
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return got, peak


def test_large_bodies_over_many_buckets_stay_within_the_budget(topo: Topology) -> None:
    """400 changes of 20 kB over 256 buckets (~8 MB of bodies, one or two
    changes a bucket): with the budget allowing it, a read holds most of
    them at once; with 1 MiB it holds each bucket's next changes without
    their bodies (~2 MB at most, the page of 10 and the driver's buffers
    included), and with none at all the same; the pages are the same, every
    body as stored; a consumer under that budget handles the same changes."""
    ds = topo.open(buckets=256)
    ds.feed.enable(bodies=True)
    _fill(ds, 400, 20_000, seed=26)
    _read_all(ds, 0, 10)  # the feed has measured its rows
    whole, whole_peak = _read_all(ds, 64 * 2**20, 10)
    bounded, bounded_peak = _read_all(ds, 2**20, 10)
    least, least_peak = _read_all(ds, 0, 10)
    assert len(whole) == 480
    same_pages(topo, whole, bounded, least)
    assert sum(1 for c in whole if c[5] is not None) == 440  # puts with their bodies
    assert whole_peak > 6_000_000, whole_peak  # most of the bodies held at once
    assert bounded_peak < 2_500_000 and least_peak < 2_500_000, (bounded_peak, least_peak)

    handled: list[Any] = []
    ds.feed.read_ahead_bytes = 2**20
    sub = ds.subscribe(
        "bounded",
        lambda changes: handled.extend(map(_seen, changes)),
        batch=10,
    )
    while sub.poll():
        pass
    sub.close()
    assert sorted(handled, key=lambda c: c[:2]) == sorted(whole, key=lambda c: c[:2])


def _held_bodiless(ds: bagstore.Datastore) -> list[tuple[int, int]]:
    """(bucket, position) of the rows the feed's reading session of every
    bucket holds without their bodies (MariaDB's reader; SQLite's reads its
    rows in commit order with their bodies, bagstore.feedstream)."""
    session = ds.feed._sessions[None]
    assert isinstance(session, feedread.Session)
    return [(r[0], r[1]) for r in session.rows if type(r[6]) is int]


def _held(ds: bagstore.Datastore) -> list[tuple[int, int]]:
    """(bucket, position) of the rows read ahead and held: MariaDB's, those
    held without their bodies; SQLite's, every one (read with them)."""
    session = ds.feed._sessions[None]
    if isinstance(session, feedread.Session):
        return _held_bodiless(ds)
    assert isinstance(session, feedstream.Stream)
    return [(r[0], r[1]) for r in session.held]


def test_a_bucket_moved_after_its_changes_were_read_ahead(topo: Topology) -> None:
    """A page's changes read ahead (on MariaDB without their bodies), their
    bucket moved to another shard before the page that returns them: the
    bodies are read where the bucket is now (MariaDB), or the rows held
    are returned and the bucket's next ones read where it is now (SQLite);
    every change comes once, in its bucket's order, whole."""
    ds = topo.open(buckets=8)
    ds.feed.enable(bodies=True)
    rng = random.Random(7)
    bodies = {ds.put({"blob": rng.randbytes(3000)}): None for _ in range(60)}
    ds.feed.read_ahead_bytes = 0  # every row read ahead without its body
    first = ds.changes(limit=5)
    held = _held(ds)
    assert held, "rows read ahead"
    bucket = held[0][0]
    source = ds.placement.shard_of_bucket[bucket]
    bagstore.Mover(ds, grace=0).move([bucket], to=(source + 1) % len(ds.router.backends))
    old = ds.router.backends[source]
    p = old.dialect.param
    assert old.fetchall(f"SELECT pos FROM bagstore_changes WHERE bucket = {p}", [bucket]) == []
    for _ in range(3):  # more changes of the bucket, where it is now
        ds.put({"blob": rng.randbytes(3000)})
    rest: list[bagstore.Change] = []
    since = first.cursor
    while page := ds.changes(since=since, limit=5):
        rest += page
        since = page.cursor
    got = [*first, *rest]
    assert {c.id for c in got} >= set(bodies)
    assert all(ds.get(c.id) == c.entity for c in got)
    for b in range(8):
        positions = [c.position for c in got if c.bucket == b]
        assert positions == list(range(1, len(positions) + 1)), (b, positions)
    ds.close()


def test_changes_pruned_after_they_were_read_ahead(topo: Topology) -> None:
    """Changes read ahead (on MariaDB without their bodies), then pruned by
    retention: MariaDB's next page raises ChangesPruned, as a read from its
    cursor afresh does, rather than return changes it cannot read whole;
    SQLite's returns those it holds, read whole before they went, and
    raises once it reaches the first one gone."""
    ds = topo.open(buckets=4)
    ds.feed.enable(bodies=True)
    ids = ds.put_many([{"n": i, "pad": "x" * 500} for i in range(40)])
    for i in ids:
        ds.put({"id": i, "n": -1})
    ds.feed.read_ahead_bytes = 0
    first = ds.changes(limit=2)
    held = _held(ds)
    assert held
    ds.feed.enable(bodies=True, max_changes=1)
    assert bagstore.Cleaner(ds).prune_changes() > 0
    since = first.cursor
    returned: list[bagstore.Change] = []
    with pytest.raises(bagstore.ChangesPruned, match="fell behind the changes kept"):
        while page := ds.changes(since=since):
            returned += page
            since = page.cursor
    if topo.is_mysql:
        assert returned == []
    assert {(c.bucket, c.position) for c in returned} <= set(held)
    assert all(c.entity is not None for c in returned)
    with pytest.raises(bagstore.ChangesPruned, match="fell behind the changes kept"):
        ds.changes(since=first.cursor)  # afresh: the same
    ds.close()


def test_a_body_gone_though_neither_pruned_nor_moved_is_changes_lost() -> None:
    """A change read without its body that is then nowhere to be found (its
    shard lost it: a failover that lost writes) is refused clearly, not
    returned without its body."""
    rows = {1: [(1, 1, b"id", 0, 1, 10, b"body")]}
    ends = {1: (1, 0, 0)}

    def holders(wanted: set[int] | None) -> dict[int, tuple[int, int, int]]:
        return dict(ends)

    def read(by_shard: Any, _ends: Any, bodies: bool = True) -> list[tuple[Any, ...]]:
        if bodies:
            return []  # gone
        return [(*r[:6], len(r[6])) for r in rows[1]]

    def pruned(bucket: int, at: int, low: int) -> None:
        raise AssertionError("nothing is pruned here")

    s = feedread.start(None, {}, False, 0, holders, pruned)
    s.budget = 0
    with pytest.raises(bagstore.ChangesLost, match="change 1 of bucket 1 was read, then"):
        feedread.next_rows(s, 10, 16, holders, read, pruned)
