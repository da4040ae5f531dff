"""Retention against consumers made or reset while it prunes: a pass that
read the consumers before one was made keeps the changes it starts from
(bagstore.retention), and a range not yet read starts at the
oldest change kept when its start was pruned all the same (by the cap); a
bucket moved while a pass prunes it keeps no row below its mark."""

from __future__ import annotations

import time

import pytest

import bagstore
from bagstore import retention, testing
from bagstore.changes import Change, Feed
from tests.conftest import Topology


@pytest.mark.parametrize("made", ["made", "reset"])
def test_a_consumer_made_while_a_pass_prunes_keeps_its_start(
    topo: Topology, monkeypatch: pytest.MonkeyPatch, made: str
) -> None:
    ds = topo.open(buckets=4)
    ds.feed.enable(max_age=1)
    ids = ds.put_many([{"n": i} for i in range(20)])
    done = ds.subscribe("done", lambda cs: None)
    while done.poll():
        pass
    done.close()
    if made == "reset":  # read to its end, then set back to the oldest change kept
        ds.subscribe("late", lambda cs: None).close()
        ds.feed.reset_consumer("late", to="end")
    read, calls = retention._handled, []

    def consumers_then_one_more(feed: Feed) -> list[dict[int, int]]:
        """The consumers as the pass first reads them; then "late" made (or
        reset to its start) before the pass marks what it deletes."""
        seen = read(feed)
        if not calls:
            if made == "made":
                ds.subscribe("late", lambda cs: None).close()
            else:
                ds.feed.reset_consumer("late", to="start")
        calls.append(seen)
        return seen

    monkeypatch.setattr(retention, "_handled", consumers_then_one_more)
    later = time.time_ns() // 1000 + 5_000_000
    assert retention.prune_changes(ds.feed, now=later) == 0
    assert len(calls) == 2  # (read again after the marks)
    got: list[Change] = []
    late = ds.subscribe("late", got.extend)
    while late.poll():
        pass
    late.close()
    assert sorted(c.id for c in got) == sorted(ids)  # from where it was made: nothing skipped
    assert retention.prune_changes(ds.feed, now=later) == 20  # handled by both now


def test_a_range_not_yet_read_starts_at_the_oldest_kept(topo: Topology) -> None:
    """The cap pruned a new consumer's start before it read: it starts at the
    oldest change kept (it had handled none); once read, it is told what the
    cap deletes (a range with nothing to handle too: tests/test_changes_cli.py)."""
    ds = topo.open(buckets=4)
    ds.feed.enable(max_changes=3)
    ds.subscribe("new", lambda cs: None).close()
    ds.put_many([{"n": i} for i in range(40)])
    pruned = bagstore.Cleaner(ds).prune_changes()
    kept = ds.changes()
    assert pruned == 40 - len(kept) > 0
    (lag,) = ds.feed.consumers()
    assert (lag["lag_changes"], lag["lag_pruned"]) == (len(kept), 0)
    got: list[Change] = []
    new = ds.subscribe("new", got.extend)
    while new.poll():
        pass
    assert sorted(c.id for c in got) == sorted(c.id for c in kept)
    ds.put_many([{"n": i} for i in range(40)])
    new.close()
    pruned = bagstore.Cleaner(ds).prune_changes()
    (lag,) = ds.feed.consumers()
    assert (lag["lag_changes"], lag["lag_pruned"]) == (40, pruned - len(kept))
    with pytest.raises(bagstore.ChangesPruned, match="consumer 'new'"):
        ds.subscribe("new", got.extend).poll()


@pytest.mark.parametrize("when", ["before", "between"])
def test_a_bucket_moved_as_a_pass_prunes_it_keeps_no_row_below_its_mark(
    topo: Topology, when: str
) -> None:
    """A pass marked a bucket's oldest changes (its rows not deleted yet)
    before a move's copy of it, or between the copy and the move's last
    sync: the moved bucket holds none of them, and the feed reads every
    change above the mark once."""
    from bagstore.backends import changesql

    ds = topo.open(buckets=8)
    ds.feed.enable()
    ds.put_many([{"n": i} for i in range(80)])
    page = ds.changes(limit=1000)
    bucket = page[0].bucket
    source = ds.placement.shard_of_bucket[bucket]
    to = (source + 1) % len(ds.router.backends)
    positions = sorted(c.position for c in page if c.bucket == bucket)
    mark = positions[len(positions) // 2]

    def marked() -> None:  # (the pass's rows not deleted yet)
        changesql.mark_pruned(ds.router.backends[source], ds.kind, bucket, mark, None)

    mover = bagstore.Mover(ds, grace=0)
    if when == "before":
        marked()
        mover.move([bucket], to=to)
    else:
        with testing.failpoint("move.after_copy"), pytest.raises(testing.SimulatedCrash):
            mover.move([bucket], to=to)
        marked()
        mover.resume()
    ds.refresh_placement(force=True)
    assert ds.placement.shard_of_bucket[bucket] == to
    held = ds.router.backends[to].fetchall(
        f"SELECT pos FROM bagstore_changes WHERE bucket = {'%s' if topo.is_mysql else '?'} "
        "ORDER BY pos",
        [bucket],
    )
    above = [p for p in positions if p > mark]
    assert [int(p) for (p,) in held] == above
    read = [c.position for c in ds.changes(limit=1000) if c.bucket == bucket]
    assert read == above


def test_ranges_moved_on_to_buckets_new_to_them_checkpoint_every_bucket(topo: Topology) -> None:
    """Ranges of several buckets, made when few of their buckets had changes,
    moved on past the cap's deletions to buckets their positions did not
    hold: each handles the changes kept once, and their checkpoints hold
    every bucket (nothing again, nothing told, after more writes)."""
    ds = topo.open(buckets=64)
    ds.feed.enable(max_changes=2)
    ds.put({"n": -1})
    ds.subscribe("new", lambda cs: None).close()
    ds.put_many([{"n": i} for i in range(400)])
    assert bagstore.Cleaner(ds).prune_changes() > 0
    kept = ds.changes()
    got: list[Change] = []
    new = ds.subscribe("new", got.extend)
    while new.poll():
        pass
    new.close()
    assert sorted(c.id for c in got) == sorted(c.id for c in kept)
    assert [(c["lag_changes"], c["lag_pruned"]) for c in ds.feed.consumers()] == [(0, 0)]
    more = ds.put_many([{"n": i} for i in range(100)])
    got.clear()
    again = ds.subscribe("new", got.extend)
    while again.poll():
        pass
    again.close()
    assert sorted(c.id for c in got) == sorted(more)
