"""What a consumer's poll costs the catalog and the shards
(bagstore.subscriber): every bucket's positions read once for all the
ranges it holds, its leases renewed in one statement, a batch's checkpoint
written with the next batch's lease (one write a batch), and nothing lost
or handled twice for it: leases lost between batches, a read that fails,
a failover's epoch during a poll."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

import bagstore
from bagstore import subscriber
from bagstore.subscriber import RANGE_ROWS, RANGES, _loaded, range_buckets
from tests.conftest import Topology


@contextmanager
def _statements(catalog: Any) -> Iterator[list[str]]:
    """The statements the catalog runs (``execute``) while in the block."""
    real = catalog.execute
    sent: list[str] = []

    def recorded(sql: str, *args: Any, **kwargs: Any) -> Any:
        sent.append(sql)
        return real(sql, *args, **kwargs)

    catalog.execute = recorded
    try:
        yield sent
    finally:
        catalog.execute = real


def test_a_poll_reads_positions_once_for_all_its_ranges(topo: Topology) -> None:
    """A poll of a process holding all 16 ranges reads the buckets'
    positions once, not once a range; a change committed during the poll
    (by its own handler, in another range) comes at a later poll: every
    change handled once."""
    ds = topo.open(buckets=64)
    ds.feed.enable()
    ids = set(ds.put_many([{"n": i} for i in range(300)]))
    feed = ds.feed
    real = feed.holders
    reads: list[Any] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        reads.append(args)
        return real(*args, **kwargs)

    feed.holders = counted  # type: ignore[method-assign]
    handled: list[bytes] = []

    def handler(changes: list[Any]) -> None:
        handled.extend(c.id for c in changes)
        if len(ids) == 300:  # the first batch: a write in the middle of a poll
            ids.add(ds.put({"n": 300}))

    consumer = ds.subscribe("counted", handler, batch=1000)
    consumer.balance()
    assert len(consumer.held) == 16
    polls = []
    while True:
        reads.clear()
        n = consumer.poll()
        polls.append((n, len(reads)))
        if n == 0:
            break
    assert [r for _, r in polls] == [1] * len(polls), polls
    assert polls[0][0] >= 300 and sum(n for n, _ in polls) == 301
    assert sorted(handled) == sorted(ids) and len(ids) == 301
    consumer.close()
    # a new consumer over ranges of which all but one have no change: its
    # ranges' new sessions read no positions of their own either
    ds.feed.disable()
    one = topo.open(buckets=64, kind="lonely")
    one.feed.enable()
    one.put({"n": 1})
    real_one = one.feed.holders

    def counted_one(*args: Any, **kwargs: Any) -> Any:
        reads.append(args)
        return real_one(*args, **kwargs)

    one.feed.holders = counted_one  # type: ignore[method-assign]
    lonely = one.subscribe("lonely", lambda changes: None, batch=1000)
    reads.clear()  # (a new consumer's start: the oldest positions kept)
    assert (lonely.poll(), len(reads)) == (1, 1)
    reads.clear()
    assert (lonely.poll(), len(reads)) == (0, 1)
    lonely.close()


def test_balance_renews_the_leases_in_one_statement_and_finds_those_lost(
    topo: Topology,
) -> None:
    """balance() renews every lease the process holds with one statement;
    when one of them was taken meanwhile (another process, its lease
    lapsed), it is found and given up, and the others are still renewed."""
    ds = topo.open(buckets=64)
    ds.feed.enable()
    ds.put_many([{"n": i} for i in range(50)])
    consumer = ds.subscribe("renewed", lambda changes: None)
    consumer.balance()
    assert len(consumer.held) == 16
    catalog = ds.feed.catalog

    def leases() -> dict[int, tuple[str, int]]:
        rows = catalog.select_all(
            RANGE_ROWS, ("range_no", "owner", "lease_until"), {"name": "renewed"}
        )
        return {int(no): (str(owner), int(until)) for no, owner, until in rows}

    before = leases()
    with _statements(catalog) as sent:
        consumer.balance()
    renewals = [s for s in sent if s.startswith("UPDATE") and "lease_until" in s]
    assert len(renewals) == 1, sent
    after = leases()
    assert all(after[no][1] > before[no][1] for no in range(16))
    # range 3 taken by another process meanwhile
    _steal(ds, "renewed", 3)
    consumer.balance()
    assert sorted(consumer.held) == [no for no in range(16) if no != 3]
    now = leases()
    assert now[3] == ("elsewhere", 2**62)
    assert all(now[no][1] > after[no][1] for no in range(16) if no != 3)
    consumer.close()


def _range_of(change: Any) -> int:
    """The range (of a store of 64 buckets) that holds the change's bucket."""
    (found,) = [no for no in range(RANGES) if change.bucket in range_buckets(64, RANGES, no)]
    return found


def _checkpoints(ds: Any, name: str) -> dict[int, dict[int, int]]:
    """Each range's positions as the catalog holds them."""
    rows = ds.feed.catalog.select_all(RANGE_ROWS, ("range_no", "positions"), {"name": name})
    return {int(no): _loaded(str(text))[1] for no, text in rows}


def _steal(ds: Any, name: str, no: int) -> None:
    """Range ``no`` of consumer ``name`` taken by another process, for good."""
    ds.feed.catalog.update(
        RANGE_ROWS, {"owner": "elsewhere", "lease_until": 2**62}, {"name": name, "range_no": no}
    )


def test_a_batch_is_checkpointed_with_the_next_batch_s_lease_one_write_a_batch(
    topo: Topology,
) -> None:
    """A poll writes each batch's checkpoint in the statement that renews the
    next batch's lease (SQLite, its ranges read together: each batch renews
    its ranges' leases, and the poll, within a second, checkpoints them at
    its end): one write of the ranges' rows a batch (and one more), not two;
    afterwards every range's checkpoint is where the poll left it, and a
    new process of the consumer has nothing left to handle."""
    ds = topo.open(buckets=64)
    ds.feed.enable()
    ids = set(ds.put_many([{"n": i} for i in range(300)]))
    handled: list[Any] = []
    calls: list[int] = []

    def handler(changes: list[Any]) -> None:
        calls.append(len(changes))
        handled.extend(changes)

    # (MariaDB: a batch a range; SQLite: the ranges read together, 120 a batch)
    consumer = ds.subscribe("one-write", handler, batch=1000 if topo.is_mysql else 120)
    consumer.balance()
    with _statements(ds.feed.catalog) as sent:
        assert consumer.poll() == 300
    batches = len(calls)
    assert batches == (len({_range_of(c) for c in handled}) if topo.is_mysql else 3)
    writes = [s for s in sent if s.startswith("UPDATE") and RANGE_ROWS in s]
    # the poll's renewal of every lease, the first batch's, one a batch after
    assert len(writes) == 1 + 1 + batches, (batches, sent)
    assert {c.id for c in handled} == ids
    assert _checkpoints(ds, "one-write") == consumer.held
    consumer.close()
    again: list[Any] = []
    other = ds.subscribe("one-write", again.extend, batch=1000)
    assert other.poll() == 0 and again == []
    other.close()


def test_a_lease_lost_between_batches_costs_neither_batch_its_guarantee(
    topo: Topology,
) -> None:
    """Leases taken by another process while a poll runs: the next range's
    (taken during the batch before it) is not handled and is given up, the
    batch before it still checkpointed; a handled range's own (taken during
    its handler) is not checkpointed (its batch comes again to whoever
    holds it), the next batch still handled."""
    ds = topo.open(buckets=64)
    ds.feed.enable()
    ds.put_many([{"n": i} for i in range(300)])
    calls: list[int] = []
    if not topo.is_mysql:
        _lease_lost_in_a_poll_together(ds)
        return

    def next_handler(changes: list[Any]) -> None:
        calls.append(_range_of(changes[0]))
        if len(calls) == 1:
            _steal(ds, "next", calls[0] + 1)  # the next range's lease, before its batch

    consumer = ds.subscribe("next", next_handler, batch=1000)
    consumer.balance()
    before = _checkpoints(ds, "next")
    consumer.poll()
    first = calls[0]
    assert first + 1 not in calls and first + 1 not in consumer.held
    assert _checkpoints(ds, "next")[first] == consumer.held[first] != before[first]
    assert _checkpoints(ds, "next")[first + 1] == before[first + 1]  # for its holder
    consumer.close()

    calls.clear()

    def own_handler(changes: list[Any]) -> None:
        calls.append(_range_of(changes[0]))
        if len(calls) == 1:
            _steal(ds, "own", calls[0])  # its own lease, during its handler

    consumer = ds.subscribe("own", own_handler, batch=1000)
    consumer.balance()
    before = _checkpoints(ds, "own")
    consumer.poll()
    first = calls[0]
    assert first not in consumer.held and calls[1] == first + 1
    assert _checkpoints(ds, "own")[first] == before[first]  # delivered again to its holder
    assert _checkpoints(ds, "own")[first + 1] == consumer.held[first + 1] != before[first + 1]
    consumer.close()


def _lease_lost_in_a_poll_together(ds: Any) -> None:
    """SQLite (a feed in commit order: a consumer's ranges read together, a
    batch spanning them): a range's lease taken during a batch's handler is
    given up at the next batch's renewal; that range's changes of the batch
    handled are not checkpointed (delivered again to its new holder) and
    those of the next batch are not handled; every other range's batch is
    handled and checkpointed, and nothing is handled twice."""
    handled: list[list[Any]] = []
    stolen: list[int] = []

    def handler(changes: list[Any]) -> None:
        handled.append(list(changes))
        if len(handled) == 1:
            stolen.append(_range_of(changes[0]))
            _steal(ds, "together", stolen[0])  # during the first batch

    consumer = ds.subscribe("together", handler, batch=50)
    consumer.balance()
    before = _checkpoints(ds, "together")
    while consumer.poll():
        pass
    (lost,) = stolen
    assert len(handled) > 2 and lost not in consumer.held
    assert all(_range_of(c) != lost for batch in handled[1:] for c in batch)
    assert _checkpoints(ds, "together")[lost] == before[lost]  # delivered again to its holder
    seen = [c.id for batch in handled for c in batch if _range_of(c) != lost]
    assert (
        len(seen)
        == len(set(seen))
        == 300 - sum(1 for c in ds.changes(limit=1000) if _range_of(c) == lost)
    )
    after = _checkpoints(ds, "together")
    assert {no: after[no] for no in consumer.held} == consumer.held
    consumer.close()


def test_a_read_that_fails_after_a_batch_keeps_that_batch_s_checkpoint(
    topo: Topology,
) -> None:
    """A poll whose read of a range fails (a shard unreachable) raises, and
    the batch handled before it is checkpointed all the same: it is not
    handled again."""
    ds = topo.open(buckets=64)
    ds.feed.enable()
    ds.put_many([{"n": i} for i in range(300)])
    handled: list[Any] = []
    consumer = ds.subscribe("failing", handled.extend, batch=1000)
    consumer.balance()
    feed = consumer.feed
    real = feed.read
    reads: list[int] = []

    # SQLite's feed is in commit order: a poll reads its ranges together,
    # once (its one read fails, before any batch); MariaDB's a range at a time
    fails_at = 2 if topo.is_mysql else 1

    def failing(*args: Any, **kwargs: Any) -> Any:
        reads.append(1)
        if len(reads) == fails_at:
            raise bagstore.ShardUnavailable("the second range's shard is down")
        return real(*args, **kwargs)

    feed.read = failing  # type: ignore[method-assign]
    before = _checkpoints(ds, "failing")
    with pytest.raises(bagstore.ShardUnavailable):
        consumer.poll()
    feed.read = real  # type: ignore[method-assign]
    if not topo.is_mysql:
        assert handled == [] and _checkpoints(ds, "failing") == before
        while consumer.poll():
            pass
        assert len(handled) == 300 and len({c.id for c in handled}) == 300
        consumer.close()
        return
    first = {_range_of(c) for c in handled}
    assert len(first) == 1
    (no,) = first
    assert _checkpoints(ds, "failing")[no] == consumer.held[no]
    count = len(handled)
    while consumer.poll():
        pass
    assert len(handled) == 300 and len({c.id for c in handled}) == 300 and count < 300
    consumer.close()


def test_a_handler_that_raises_keeps_the_checkpoints_of_the_batches_before_it(
    topo: Topology,
) -> None:
    """A handler raising at its third batch: the poll raises, the two batches
    handled before it are checkpointed (on SQLite all three came from one
    read of the ranges together), and the next polls deliver every other
    change once, the failed batch's among them."""
    ds = topo.open(buckets=64)
    ds.feed.enable()
    ds.put_many([{"n": i} for i in range(300)])
    handled: list[list[Any]] = []
    calls = iter(range(1, 10**6))

    def handler(changes: list[Any]) -> None:
        handled.append(list(changes))
        if next(calls) == 3:
            raise RuntimeError("the handler fails")

    consumer = ds.subscribe("raising", handler, batch=20)
    consumer.balance()
    with pytest.raises(RuntimeError, match="the handler fails"):
        consumer.poll()
    assert len(handled) == 3
    kept = {c.id for batch in handled[:2] for c in batch}
    assert len(kept) == len(handled[0]) + len(handled[1])  # (MariaDB: a range's batch)
    failed = [c.id for c in handled[2]]
    del handled[:]
    while consumer.poll():
        pass
    again = [c.id for batch in handled for c in batch]
    assert set(failed) <= set(again)  # (in no set order among changes of one time)
    assert len(again) == len(set(again)) == 300 - len(kept)
    assert not kept & set(again)
    consumer.close()


def test_a_checkpoint_keeps_the_epoch_its_batch_was_read_in(topo: Topology) -> None:
    """A failover's new epoch during a poll (here: during the first batch's
    handler): the next range's read raises ChangesLost, and the batch
    handled before it is checkpointed in the epoch it was read in, so that
    its range too is refused until the consumer is reset, not taken on
    as if read after the failover."""
    ds = topo.open(buckets=64)
    ds.feed.enable()
    ds.put_many([{"n": i} for i in range(300)])
    old = ds.feed.epoch()
    calls: list[int] = []

    def handler(changes: list[Any]) -> None:
        calls.append(_range_of(changes[0]))
        if ds.feed.epoch() == old:  # once
            ds.feed.new_epoch()

    consumer = ds.subscribe("failed-over", handler, batch=1000)
    consumer.balance()
    if not topo.is_mysql:
        # SQLite's feed is in commit order: the poll read its ranges together,
        # before the failover, as one batch, checkpointed in the epoch it was
        # read in; the next poll is refused
        assert consumer.poll() == 300 and len(calls) == 1
        with pytest.raises(bagstore.ChangesLost):
            consumer.poll()
        touched = set(range(RANGES))
    else:
        with pytest.raises(bagstore.ChangesLost):
            consumer.poll()
        touched = set(calls)
        assert len(calls) == 1
    rows = ds.feed.catalog.select_all(
        RANGE_ROWS, ("range_no", "positions"), {"name": "failed-over"}
    )
    epochs = {int(no): _loaded(str(text))[0] for no, text in rows}
    for first in touched:
        assert epochs[first] == old < ds.feed.epoch()
        assert _checkpoints(ds, "failed-over")[first] == consumer.held[first]  # checkpointed
    consumer.close()
    again = ds.subscribe("failed-over", handler, batch=1000)
    with pytest.raises(bagstore.ChangesLost):
        again.poll()
    ds.feed.reset_consumer("failed-over", to="start")
    calls.clear()
    while again.poll():
        pass
    assert len(calls) == (16 if topo.is_mysql else 1)  # (SQLite: one batch of them all)
    again.close()


def test_a_poll_goes_on_while_young_and_ends_at_a_read_s_end(
    topo: Topology, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A poll handles a batch a range held, then goes on while it has run
    less than POLL_SECONDS (a quarter of the lease at most), and what it
    began is handled to its end: on SQLite a read (up to 1,000 changes;
    rows read are never dropped), on MariaDB a round of a batch of each
    range whose last batch was whole."""
    ds = topo.open(buckets=64)
    ds.feed.enable()
    for start in range(0, 1600, 400):  # ~100 changes a range, 30 at least
        ds.put_many([{"n": i} for i in range(start, start + 400)])
    batches: list[int] = []
    slow = {33: 0.5}  # seconds the handler takes at its nth batch (the 2nd poll's 17th)

    def handler(changes: list[Any]) -> None:
        batches.append(len(changes))
        time.sleep(slow.get(len(batches), 0))

    consumer = ds.subscribe("young", handler, batch=10)
    consumer.balance()
    assert len(consumer.held) == RANGES
    monkeypatch.setattr(subscriber, "POLL_SECONDS", 0.0)
    assert consumer.poll() == 160 and batches == [10] * 16  # a batch a range held
    monkeypatch.setattr(subscriber, "POLL_SECONDS", 0.4)
    # young after its 16 batches: SQLite reads 1,000 more changes, MariaDB
    # reads a batch of each range again, each handled to its end though the
    # poll grew old at its 17th batch
    assert consumer.poll() == (320 if topo.is_mysql else 1160)
    assert batches == [10] * len(batches)
    consumer.close()

    # a lease of 0.2 s: a poll goes on for 0.05 s at most
    del batches[:]
    slow.clear()
    monkeypatch.setattr(subscriber, "POLL_SECONDS", 3600.0)
    short = ds.subscribe("young-short", lambda c: (batches.append(len(c)), time.sleep(0.004)),
                         batch=10, lease=0.2)  # fmt: skip
    short.balance()
    assert short.poll() == 160 and batches == [10] * 16
    short.close()


def test_a_long_poll_of_one_range_reads_on_from_its_last_batch(
    topo: Topology, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every change in one range: a poll that goes on reads that range's next
    batch from after the last one handled, though its checkpoint waits for
    the next batch's renewal (MariaDB: a round of one range after another).
    Each change handled once."""
    from bagstore.sharding.hashing import bucket_of

    ds = topo.open(buckets=64)
    ds.feed.enable()
    ids: list[bytes] = []
    while len(ids) < 45:
        i = bagstore.new_id()
        if bucket_of(i, 64) < 64 // RANGES:  # range 0
            ids.append(ds.put({"id": i}))
    handled: list[bytes] = []
    consumer = ds.subscribe("one-range", lambda c: handled.extend(x.id for x in c), batch=10)
    consumer.balance()
    monkeypatch.setattr(subscriber, "POLL_SECONDS", 3600.0)
    assert consumer.poll() == 45
    assert sorted(handled) == sorted(ids) and len(set(handled)) == 45
    assert consumer.poll() == 0
    consumer.close()


def test_a_lease_lost_while_a_poll_goes_on(topo: Topology, monkeypatch: pytest.MonkeyPatch) -> None:
    """A range's lease taken by another process during the 17th batch's
    handler (a poll going on past its batch a range): none of that range's
    changes is handled after it, its checkpoint keeps none of that batch's
    (delivered again to its holder), and every other change is handled once."""
    ds = topo.open(buckets=64)
    ds.feed.enable()
    for start in range(0, 1600, 400):
        ds.put_many([{"n": i} for i in range(start, start + 400)])
    handled: list[list[Any]] = []
    stolen: list[int] = []

    def handler(changes: list[Any]) -> None:
        handled.append(list(changes))
        if len(handled) == 17:
            stolen.append(_range_of(changes[0]))
            _steal(ds, "stolen", stolen[0])

    monkeypatch.setattr(subscriber, "POLL_SECONDS", 3600.0)
    consumer = ds.subscribe("stolen", handler, batch=10)
    consumer.balance()
    while consumer.poll():
        pass
    (lost,) = stolen
    assert len(handled) > 17 and lost not in consumer.held
    assert all(_range_of(c) != lost for batch in handled[17:] for c in batch)
    kept = _checkpoints(ds, "stolen")[lost]
    for c in handled[16]:
        if _range_of(c) == lost:
            assert kept.get(c.bucket, 0) < c.position
    others = [c.id for batch in handled for c in batch if _range_of(c) != lost]
    everything = ds.changes(limit=2000)
    assert len(others) == len(set(others)) == sum(1 for c in everything if _range_of(c) != lost)
    consumer.close()
