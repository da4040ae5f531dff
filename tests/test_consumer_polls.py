"""What a consumer's poll costs the catalog and the shards
(bagstore.subscriber): every bucket's positions read once for all the
ranges it holds, its leases renewed in one statement, and nothing lost or
handled twice for it."""

from __future__ import annotations

from typing import Any

from bagstore.subscriber import RANGE_ROWS
from tests.conftest import Topology


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
    real = catalog.execute
    sent: list[str] = []

    def recorded(sql: str, *args: Any, **kwargs: Any) -> Any:
        sent.append(sql)
        return real(sql, *args, **kwargs)

    def leases() -> dict[int, tuple[str, int]]:
        rows = catalog.select_all(
            RANGE_ROWS, ("range_no", "owner", "lease_until"), {"name": "renewed"}
        )
        return {int(no): (str(owner), int(until)) for no, owner, until in rows}

    before = leases()
    catalog.execute = recorded  # type: ignore[method-assign]
    consumer.balance()
    renewals = [s for s in sent if s.startswith("UPDATE") and "lease_until" in s]
    assert len(renewals) == 1, sent
    after = leases()
    assert all(after[no][1] > before[no][1] for no in range(16))
    # range 3 taken by another process meanwhile
    catalog.update(
        RANGE_ROWS, {"owner": "elsewhere", "lease_until": 2**62}, {"name": "renewed", "range_no": 3}
    )
    sent.clear()
    consumer.balance()
    assert sorted(consumer.held) == [no for no in range(16) if no != 3]
    now = leases()
    assert now[3] == ("elsewhere", 2**62)
    assert all(now[no][1] > after[no][1] for no in range(16) if no != 3)
    catalog.execute = real  # type: ignore[method-assign]
    consumer.close()
