"""Where the change feed finds each bucket's newest changes (``Feed.holders``)
while a bucket's rows lie on two shards, and what a reader going on from its
last page does when its buckets' positions are read afresh (bagstore.feedread's
``_refresh``): both have a path in C loops for the normal case and one a
bucket for the rest, which must agree."""

from __future__ import annotations

from typing import Any

import pytest

import bagstore
from bagstore import feedread
from bagstore.backends import changesql
from tests.conftest import Topology, as_read


def _two_copies(ds: bagstore.Datastore, bucket: int, other: int, top: int) -> None:
    """Plant a copy of ``bucket``'s position row on shard ``other`` with last
    position ``top``, as a move's copy leaves it (before the switch, or the
    old copy after it until the move's clean-up)."""
    changesql.set_positions(ds.feed.router.backends[other], bucket, {ds.kind: (top, 0)})


def test_a_bucket_on_two_shards_is_held_by_its_newest_copy(topo: Topology) -> None:
    """A bucket whose positions are on two shards is held by the one with the
    higher last position, whichever shard comes first; on a tie, by the
    shard the placement names; every other bucket by its own shard."""
    ds = topo.open(buckets=16)
    ds.feed.enable()
    ds.put_many([{"n": i} for i in range(200)])
    feed = ds.feed
    before = feed.holders()
    shards = len(feed.router.backends)
    assert shards > 1 and len(before) == 16
    by_shard: dict[int, list[int]] = {}
    for b, (_, _, s) in sorted(before.items()):
        by_shard.setdefault(s, []).append(b)
    low_b, high_b = by_shard[min(by_shard)][0], by_shard[max(by_shard)][0]
    tie_b = by_shard[max(by_shard)][1]
    # a stale copy on a later shard, a newer one on an earlier shard, and a tie
    _two_copies(ds, low_b, max(by_shard), before[low_b][0] - 1)
    _two_copies(ds, high_b, min(by_shard), before[high_b][0] + 5)
    _two_copies(ds, tie_b, min(by_shard), before[tie_b][0])
    after = feed.holders()
    assert after[low_b] == before[low_b]
    assert after[high_b] == (before[high_b][0] + 5, 0, min(by_shard))
    assert after[tie_b] == before[tie_b]
    rest = set(before) - {low_b, high_b, tie_b}
    assert {b: after[b] for b in rest} == {b: before[b] for b in rest}
    # asked for some buckets only: the same answers, for those buckets alone
    some = feed.holders([high_b, tie_b, 15])
    assert some == {b: after[b] for b in (high_b, tie_b, 15) if b in after}


def test_holders_of_some_buckets_and_of_all_agree(topo: Topology) -> None:
    ds = topo.open(buckets=32)
    ds.feed.enable()
    ds.put_many([{"n": i} for i in range(100)])
    every = ds.feed.holders()
    for wanted in ([0], [3, 1, 2], list(range(0, 32, 5)), list(range(32))):
        assert ds.feed.holders(wanted) == {b: every[b] for b in sorted(wanted) if b in every}


def _session_reader(
    streams: dict[int, list[tuple[Any, ...]]], ends: dict[int, tuple[int, int, int]]
) -> tuple[Any, Any, Any]:
    def holders(wanted: set[int] | None) -> dict[int, tuple[int, int, int]]:
        return {b: e for b, e in ends.items() if wanted is None or b in wanted}

    def read(
        by_shard: dict[int, list[tuple[int, int, int]]],
        _ends: dict[int, tuple[int, int, int]],
        bodies: bool = True,
    ) -> list[tuple[Any, ...]]:
        ranges = [r for rs in by_shard.values() for r in rs]
        rows = [row for b, lo, hi in ranges for row in streams[b] if lo <= row[1] <= hi]
        return as_read(rows, bodies)

    def pruned(bucket: int, at: int, low: int) -> None:
        raise bagstore.ChangesPruned(f"bucket {bucket} read to {at}, pruned to {low}")

    return holders, read, pruned


def _stream(b: int, n: int) -> list[tuple[Any, ...]]:
    return [(b, i + 1, b"id", 0, 1, 1000 * i + b, None) for i in range(n)]


def test_a_reader_going_on_reads_only_buckets_with_new_changes() -> None:
    """Every bucket read (a reader following the feed's end): the positions
    read afresh put on the heap just the buckets with changes after what was
    read, each by its running maximum, and their new rows come next."""
    streams = {b: _stream(b, 3) for b in range(8)}
    ends = {b: (3, 0, b % 2) for b in range(8)}
    holders, read, pruned = _session_reader(streams, ends)
    s = feedread.start(None, {}, False, 0, holders, pruned)
    assert len(feedread.next_rows(s, 100, 16, holders, read, pruned)) == 24
    assert feedread.next_rows(s, 100, 16, holders, read, pruned) == []
    assert s.blocked == [] and set(s.read_to) == set(range(8))
    for b in (2, 5):
        streams[b].append((b, 4, b"id", 0, 2, 9000 + b, None))
        ends[b] = (4, 0, b % 2)
    page = feedread.next_rows(s, 100, 16, holders, read, pruned)
    assert [(r[0], r[1]) for r in page] == [(2, 4), (5, 4)]
    assert s.after == {b: 4 if b in (2, 5) else 3 for b in range(8)}


@pytest.mark.parametrize("read_before", [True, False])
def test_a_bucket_pruned_past_a_readers_position_is_refused(read_before: bool) -> None:
    """Retention that deleted changes a reader had not read yet: the next read
    raises ChangesPruned, whether every bucket had been read before (the
    reader going on) or one had not (a bucket new to it)."""
    streams = {b: _stream(b, 5) for b in range(4)}
    ends = {b: (5, 0, 0) for b in range(4)}
    if not read_before:
        del ends[3]
    holders, read, pruned = _session_reader(streams, ends)
    s = feedread.start(None, {}, False, 0, holders, pruned)
    assert len(feedread.next_rows(s, 1, 16, holders, read, pruned)) == 1
    while feedread.next_rows(s, 100, 16, holders, read, pruned):
        pass
    assert s.read_to[1] == (5, 4001)
    # more changes, and those up to 7 of bucket 1 pruned: the reader, at 5,
    # had not read 6 and 7; rows are still returned by `read`, so only the
    # positions read afresh can tell
    streams[1] += [(1, 6, b"id", 0, 2, 9001, None), (1, 7, b"id", 0, 3, 9002, None)]
    streams[1].append((1, 8, b"id", 0, 4, 9003, None))
    ends[1] = (8, 7, 0)
    if not read_before:
        ends[3] = (5, 0, 0)
    with pytest.raises(bagstore.ChangesPruned, match="bucket 1 read to 5, pruned to 7"):
        feedread.next_rows(s, 100, 16, holders, read, pruned)


def test_a_reader_at_the_feeds_end_gets_the_same_cursor_again(topo: Topology) -> None:
    """A page that read nothing new carries the same cursor text as the one it
    was read from (made once, not encoded and signed again at every poll),
    until a change comes or the feed's epoch moves on; each reads on."""
    ds = topo.open(buckets=1024)
    ds.feed.enable()
    ds.put_many([{"n": i} for i in range(50)])
    page = ds.changes(limit=100)
    assert len(page) == 50
    idle = ds.changes(since=page.cursor)
    assert idle == [] and idle.cursor == page.cursor
    entity_id = ds.put({"n": 50})
    more = ds.changes(since=idle.cursor)
    assert [c.id for c in more] == [entity_id] and more.cursor != page.cursor
    ds.feed.new_epoch()
    with pytest.raises(bagstore.ChangesLost):
        ds.changes(since=more.cursor)
    fresh = ds.changes()
    assert len(fresh) == 51 and fresh.cursor != more.cursor
    assert ds.changes(since=fresh.cursor) == []


def test_a_cursor_of_positions_at_0_reads_as_one_without_them(topo: Topology) -> None:
    """Positions of 0 are left out of a cursor's text, and the positions kept
    for the cursor just made keep them: both read the same changes, from the
    cursor's own store or from another opened on the same shards (merged by
    time: changes of one time may come in another order from a fresh read)."""
    ds = topo.open(buckets=64)
    ds.feed.enable()
    ds.put_many([{"n": i} for i in range(40)])
    page = ds.changes(limit=15)
    rest = sorted(c.id for c in ds.changes(since=page.cursor))
    assert len(rest) == 25
    at = ds.feed.positions_of(page.cursor)
    zeros = {b: at.get(b, 0) for b in range(64)}
    assert 0 in zeros.values()
    cursor = ds.feed.cursor(zeros)
    assert ds.feed.positions_of(cursor) is zeros  # kept as made, zeros and all
    assert sorted(c.id for c in ds.changes(since=cursor)) == rest
    other = topo.open(buckets=64)
    assert other.feed.positions_of(cursor) == {b: p for b, p in zeros.items() if p}
    assert sorted(c.id for c in other.changes(since=cursor)) == rest


def test_positions_polled_are_taken_again_while_their_sums_hold(
    topo: Topology, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader polling the feed's end reads each shard's positions whole only
    when their sums moved, or once they are older than ``_POLLED_TRUST``
    seconds: a change whose positions add up as before (buckets leaving a
    shard and others arriving in one poll's time, made here by hand) is seen
    that much later, never lost; rows missing where positions said read
    them whole again."""
    from bagstore import changes as changes_module

    monkeypatch.setattr(changes_module, "_POLLED_TRUST", 3600.0)
    ds = topo.open(buckets=16)
    ds.feed.enable()
    ids = ds.put_many([{"n": i} for i in range(60)])
    page = ds.changes(limit=1000)
    assert len(page) == 60 and ds.changes(since=page.cursor) == []
    feed = ds.feed
    read_at = {s: entry[2] for s, entry in feed._polled.items()}
    assert read_at and ds.changes(since=page.cursor) == []
    assert {s: entry[2] for s, entry in feed._polled.items()} == read_at  # not read whole
    _, up, down, top, backend = _same_sums_change(ds)
    p = backend.dialect.param
    if not topo.is_mysql:
        # SQLite's reader reads each shard's rows as they lie (in commit
        # order), not where positions say: a row is seen once it is there
        late = ds.changes(since=page.cursor)
        assert [(c.bucket, c.position) for c in late] == [(up, top + 1)]
        return
    assert ds.changes(since=page.cursor) == []  # its sums held: not read whole yet
    monkeypatch.setattr(changes_module, "_POLLED_TRUST", 0.0)
    late = ds.changes(since=page.cursor)
    assert [(c.bucket, c.position) for c in late] == [(up, top + 1)]
    assert late[0].id in ids
    # a range read that comes back short drops what was polled
    monkeypatch.setattr(changes_module, "_POLLED_TRUST", 3600.0)
    assert ds.changes(since=late.cursor) == [] and feed._polled
    backend.execute(
        f"UPDATE {changesql.POSITIONS} SET pos = pos + 2 WHERE kind = {p} AND bucket = {p}",
        [ds.kind, down],
    )  # one past what was read, with no change row there: the sums moved, the
    # positions are read whole, and the row they promise is missing
    assert ds.changes(since=late.cursor) == []
    assert feed._polled == {}


def _same_sums_change(ds: bagstore.Datastore) -> tuple[int, int, int, int, Any]:
    """On one shard, one bucket's last position up by one (its change row
    added) and another's down by one: positions that add up as before.
    ``(shard, the bucket with the new change, the other, the first's last
    position before, the shard's backend)``."""
    feed = ds.feed
    holders = feed.holders()
    # the shard with the most buckets of two changes or more (bucket 0 may
    # have none: 60 entities leave one of 16 buckets empty ~2% of the time)
    by_shard: dict[int, list[int]] = {}
    for b, (top, _, s) in holders.items():
        if top >= 2:
            by_shard.setdefault(s, []).append(b)
    shard = max(by_shard, key=lambda s: len(by_shard[s]))
    mine = sorted(by_shard[shard])
    assert len(mine) >= 2
    up, down = mine[0], mine[1]
    backend: Any = feed.router.backends[shard]
    p = backend.dialect.param
    top = holders[up][0]
    (last,) = changesql.bucket_change_rows(backend, ds.kind, up, top - 1, 1)
    later = last._replace(pos=top + 1, version=last.version + 1, updated=last.updated + 1)
    changesql.copy_change_rows(backend, [later])
    for bucket, step in ((up, 1), (down, -1)):
        backend.execute(
            f"UPDATE {changesql.POSITIONS} SET pos = pos + {p} WHERE kind = {p} AND bucket = {p}",
            [step, ds.kind, bucket],
        )
    return shard, up, down, top, backend


def test_positions_polled_are_read_whole_after_the_placement_changed(
    topo: Topology, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Positions kept from a poll are not taken again once the placement has
    moved on (a bucket moved between two other shards), however their sums
    stand."""
    from bagstore import changes as changes_module

    monkeypatch.setattr(changes_module, "_POLLED_TRUST", 3600.0)
    ds = topo.open(buckets=16)
    ds.feed.enable()
    ds.put_many([{"n": i} for i in range(60)])
    page = ds.changes(limit=1000)
    assert len(page) == 60 and ds.changes(since=page.cursor) == []
    shard, up, _, top, _ = _same_sums_change(ds)
    if not topo.is_mysql:  # read in commit order: seen once it is there
        late = ds.changes(since=page.cursor)
        assert [(c.bucket, c.position) for c in late] == [(up, top + 1)]
        return
    assert ds.changes(since=page.cursor) == []  # its sums held: not read whole yet
    others = [s for s in range(len(ds.router.backends)) if s != shard]
    moved = ds.placement.buckets_of_shard(others[0])[0]
    version = ds.placement.version
    ds.move_buckets([moved], to=others[1])
    assert ds.feed.router.refresh().version != version
    late = ds.changes(since=page.cursor)
    assert [(c.bucket, c.position) for c in late] == [(up, top + 1)]
