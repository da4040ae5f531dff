"""The administration of a change feed's named consumers (``bagstore
consumers``): where each stands, its lag, dropping and resetting it.  The
consumers themselves are :class:`bagstore.subscriber.Subscriber`.

    >>> import bagstore, tempfile
    >>> ds = bagstore.open(tempfile.mkdtemp())
    >>> ds.feed.enable()
    >>> _ = ds.put_many([{"n": i} for i in range(3)])
    >>> ds.subscribe("example", lambda changes: None).close()
    >>> [(c["name"], c["lag_changes"], c["lag_pruned"]) for c in ds.feed.consumers()]
    [('example', 3, 0)]
    >>> ds.feed.reset_consumer("example", to="end")
    >>> ds.feed.consumers()[0]["lag_changes"]
    0
    >>> ds.close()
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bagstore.backends import changesql
from bagstore.changes import Feed
from bagstore.errors import InvalidQuery
from bagstore.subscriber import (
    CONSUMERS,
    MEMBERS,
    RANGE_ROWS,
    _known,
    _loaded,
    _now,
    _stored,
    lifted,
    range_buckets,
)

__all__ = [
    "consumer_lags",
    "consumer_positions",
    "drop_consumer",
    "pruned_note",
    "reset_consumer",
]


def consumer_positions(feed: Feed, name: str) -> dict[int, int]:
    """Every bucket's position as the consumer's checkpoints hold it."""
    out: dict[int, int] = {}
    for (text,) in feed.catalog.select_all(RANGE_ROWS, ("positions",), {"name": name}):
        out.update(_loaded(str(text))[1])
    return out


def consumer_lags(feeds: Callable[[str], Feed], catalog_feed: Feed) -> list[dict[str, Any]]:
    """Each consumer: name, kind, changes not yet handled, the age in seconds
    of the oldest of them kept (0 when none), how many of them retention
    deleted (its next poll raises :class:`bagstore.ChangesPruned`), live
    processes.  A range not yet checkpointed since the consumer was made or
    reset counts from the oldest change kept, where it will start
    (:meth:`bagstore.subscriber.Subscriber._lift`)."""
    out: list[dict[str, Any]] = []
    now = _now()
    for name, kind, ranges in catalog_feed.catalog.select_all(
        CONSUMERS, ("name", "kind", "ranges")
    ):
        feed = feeds(str(kind))
        ends = feed.ends()
        buckets = feed.router.placement.buckets
        positions: dict[int, int] = {}
        columns = ("range_no", "positions", "checkpointed")
        for no, text, checkpointed in feed.catalog.select_all(RANGE_ROWS, columns, {"name": name}):
            at = _loaded(str(text))[1]
            if not int(checkpointed):  # from the oldest change kept
                at = lifted(at, ends, range_buckets(buckets, int(ranges), int(no)))
            positions.update(at)
        behind = {
            b: positions.get(b, 0) for b, (top, _) in ends.items() if top > positions.get(b, 0)
        }
        changes = sum(ends[b][0] - at for b, at in behind.items())
        lost = sum(max(0, ends[b][1] - at) for b, at in behind.items())
        oldest = _oldest(feed, {b: max(at, ends[b][1]) for b, at in behind.items()})
        members = feed.catalog.select_all(MEMBERS, ("seen",), {"name": name})
        out.append(
            {
                "name": str(name),
                "kind": str(kind),
                "lag_changes": changes,
                "lag_seconds": round(max(0, now - oldest) / 1e6, 3) if oldest else 0.0,
                "lag_pruned": lost,
                "processes": sum(1 for (s,) in members if int(s) > now - 60_000_000),
            }
        )
    return sorted(out, key=lambda d: d["name"])


def pruned_note(lag: dict[str, Any]) -> str:
    """What a consumer whose unhandled changes were pruned (``lag_pruned``)
    is told at the command line."""
    return (
        f"{lag['lag_pruned']} of its changes were pruned before it handled them "
        f"(retention's cap); its next poll fails until `bagstore consumers reset {lag['name']}`"
    )


def _oldest(feed: Feed, behind: dict[int, int]) -> int | None:
    """The ``updated`` of the oldest change after ``behind``'s positions."""
    placement = feed.router.placement
    by_shard: dict[int, list[tuple[int, int]]] = {}
    for b, at in behind.items():
        by_shard.setdefault(placement.shard_of_bucket[b], []).append((b, at + 1))
    backends = feed.router.backends
    firsts: list[int] = []
    for shard, where in by_shard.items():
        firsts += changesql.first_updated(backends[shard], feed.kind, where).values()
    return min(firsts) if firsts else None


def drop_consumer(feed: Feed, name: str) -> None:
    """Forget a consumer (its positions and leases)."""
    _known(feed, name)
    for table in (RANGE_ROWS, MEMBERS, CONSUMERS):
        feed.catalog.delete_where(table, {"name": name})


def reset_consumer(feeds: Callable[[str], Feed], catalog_feed: Feed, name: str, *, to: str) -> None:
    """Move a consumer to the oldest change kept (``to="start"``) or after the
    newest (``to="end"``); its leases are given up."""
    kind, ranges = _known(catalog_feed, name)
    if to not in ("start", "end"):
        raise InvalidQuery(f"reset to 'start' or 'end', not {to!r}")
    feed = feeds(kind)
    epoch = feed.epoch()  # (before the positions are read, as for a new consumer)
    ends = feed.ends()
    buckets = feed.router.placement.buckets
    for no in range(ranges):
        mine = range_buckets(buckets, ranges, no)
        positions = {b: (ends[b][0] if to == "end" else ends[b][1]) for b in mine if b in ends}
        # leases given up; not yet read since (checkpointed 0: Subscriber._lift)
        anew = {"positions": _stored(epoch, positions), "owner": "", "lease_until": 0}
        anew["checkpointed"] = 0
        feed.catalog.update(RANGE_ROWS, anew, {"name": name, "range_no": no})
