"""Retention of the change feed: which changes the Cleaner deletes.

A bucket's changes are deleted, oldest first, when both

* older than the kind's ``max_age`` (seconds), and
* handled by every consumer of the kind (below each one's checkpoint);

and, whatever the consumers, beyond the newest ``max_changes`` of the bucket
(the hard cap: a consumer that died cannot keep every change for ever).  A
consumer (or cursor) whose position is below what was deleted is told so by
:class:`bagstore.ChangesPruned` when it reads next, with the way out
(``bagstore consumers reset NAME``).

A consumer made (or reset) while changes are pruned starts at the oldest
change kept before or after them, never in a hole: what is deleted by age
is marked first (every bucket's ``pruned``), the consumers are read again,
and a bucket where one stands below its mark (made or reset since they were
first read, or still being made: no positions yet) is marked back and
keeps those changes.  A consumer's range not yet read since it was made or
reset that finds its start pruned all the same (by the cap) starts at the
oldest change kept (:meth:`bagstore.subscriber.Subscriber.poll`).

    >>> import bagstore, tempfile
    >>> ds = bagstore.open(tempfile.mkdtemp(), shards=1, buckets=1)
    >>> ds.feed.enable(max_changes=2)
    >>> _ = ds.put_many([{"n": i} for i in range(5)])
    >>> bagstore.Cleaner(ds).prune_changes()
    3
    >>> [c.entity for c in ds.changes()]
    [None, None]
    >>> ds.close()
"""

from __future__ import annotations

import time

from bagstore.backends import changesql as sql
from bagstore.changes import Feed
from bagstore.consumeradmin import consumer_positions
from bagstore.subscriber import CONSUMERS

__all__ = ["prune_changes"]


def prune_changes(feed: Feed, *, now: int | None = None, batch: int = 1000) -> int:
    """Delete the changes retention allows, of every kind whose feed is on
    (``feed``: any kind's feed of the store); the number of change rows deleted."""
    now = time.time_ns() // 1000 if now is None else now
    deleted = 0
    rows = feed.catalog.select_all("bagstore_feeds", ("kind", "max_age", "max_changes"))
    for kind, max_age, max_changes in rows:
        of_kind = feed.other(str(kind))
        backends = feed.router.backends
        cutoff = now - int(max_age) * 1_000_000
        holders = of_kind.holders()
        handled = _handled(of_kind)
        marked = []
        for b, (top, _, shard) in holders.items():
            upto = min((c.get(b, 0) for c in handled), default=top)
            low, upto = sql.mark_pruned(backends[shard], str(kind), b, upto, cutoff)
            if upto > low:
                marked.append((b, shard, low, upto))
        again = _handled(of_kind)  # (after the marks: see the module's text)
        now_at = of_kind.holders()  # (a bucket moved meanwhile took its mark along)
        for b, shard, low, upto in marked:
            backend = backends[now_at[b][2] if b in now_at else shard]
            keep = max(low, min((c.get(b, 0) for c in again), default=upto))
            if keep < upto and sql.lower_mark(backend, str(kind), b, upto, keep):
                upto = keep
            deleted += sql.delete_pruned(backend, str(kind), b, low, upto, batch)
        for b, (top, _, shard) in holders.items():  # the cap, whatever the consumers
            cap = top - int(max_changes)
            deleted += sql.prune(backends[shard], str(kind), b, cap, None, batch)[0]
    return deleted


def _handled(feed: Feed) -> list[dict[int, int]]:
    """Each consumer of ``feed``'s kind: its positions (none yet while it is
    being made: it holds every change)."""
    names = feed.catalog.select_all(CONSUMERS, ("name",), {"kind": feed.kind})
    return [consumer_positions(feed, str(n)) for (n,) in names]
