"""Retention of the change feed: which changes the Cleaner deletes.

A bucket's changes are deleted, oldest first, when both

* older than the kind's ``max_age`` (seconds), and
* handled by every consumer of the kind (below each one's checkpoint);

and, whatever the consumers, beyond the newest ``max_changes`` of the bucket
(the hard cap: a consumer that died cannot keep every change for ever).  A
consumer (or cursor) whose position is below what was deleted is told so by
:class:`bagstore.ChangesPruned` when it reads next, with the way out
(``bagstore consumers reset NAME``).

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
        names = feed.catalog.select_all(CONSUMERS, ("name",), {"kind": str(kind)})
        consumers = [consumer_positions(of_kind, str(n)) for (n,) in names]
        backends = feed.router.backends
        cutoff = now - int(max_age) * 1_000_000
        for b, (top, _, shard) in of_kind.holders().items():
            handled = min((c.get(b, 0) for c in consumers), default=top)
            backend = backends[shard]
            deleted += sql.prune(backend, str(kind), b, handled, cutoff, batch)[0]
            deleted += sql.prune(backend, str(kind), b, top - int(max_changes), None, batch)[0]
    return deleted
