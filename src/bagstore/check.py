"""Consistency report: index rows missing or stale, per index. Changes nothing.

For every index the catalog lists as ``building`` or ``ready``, the rows every
entity should have (computed from its body exactly as the writers do) are
compared with the rows each shard's index table holds:

* *missing*: a row an entity should have that is not on its shard;
* *stale*: a row that no entity accounts for (its entity is gone, no longer has
  that value, or the row sits on the wrong shard).

A bucket in an unfinished bucket move is read once, from the shard that owns it
(see :mod:`bagstore.owners`): the other copy's entities and index rows (the
target's before the switch, the source's after it) are neither counted nor
reported; the mover makes or deletes them.

The check reads every entity and every index row: it is a tool for tests,
operators and the Cleaner, not for a request path.  It holds the expected rows
of one index in memory at a time.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from bagstore import codec
from bagstore.backends.scansql import Scan
from bagstore.names import clashes
from bagstore.owners import unfinished_moves

if TYPE_CHECKING:
    from bagstore.backends import Backend
    from bagstore.datastore import Datastore
    from bagstore.index import Index

__all__ = ["check", "iter_entities", "iter_index_rows"]

PAGE = 2000
EXAMPLES = 5


def iter_entities(backend: Backend, kind: str) -> Iterator[tuple[int, bytes, bytes, int]]:
    """Every ``(added_id, id, body, updated)`` of one shard, in ``added_id`` pages."""
    after = 0
    while True:
        rows = backend.scan_entities(kind, after, PAGE)
        yield from rows
        if len(rows) < PAGE:
            return
        after = rows[-1][0]


def iter_index_rows(backend: Backend, index: Index) -> Iterator[tuple[bytes, ...]]:
    """Every ``(key..., entity_id)`` of one shard's index table, in key order."""
    scan = Scan(index.table, index.properties, limit=PAGE)
    while True:
        rows = backend.scan_index(scan)
        yield from rows
        if len(rows) < PAGE:
            return
        scan.after = rows[-1]


def check(ds: Datastore, progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """The report ``Datastore.check()`` returns (see its docstring).

    ``progress(done, total)`` is called every ``PAGE`` entities read: each
    index reads every entity, so ``total`` is the kind's entity count times the
    number of indexes checked.
    """
    registry = ds.registry(refresh=True)
    report: dict[str, Any] = {"missing": 0, "stale": 0, "indexes": {}, "clashes": _clashes(ds)}
    ds.refresh_placement(force=True)
    moves = unfinished_moves(ds.router)  # copies that are not their bucket's owner's: unseen
    shards = range(len(ds.router.backends))
    maintained = registry.maintained()
    total = ds.count() * len(maintained) if progress is not None and maintained else 0
    done, lock = [0], threading.Lock()

    def advance(n: int) -> None:
        if progress is not None and n:
            with lock:
                done[0] += n
                progress(done[0], max(total, done[0]))

    for index in maintained:
        expected: list[set[tuple[bytes, ...]]] = [set() for _ in shards]

        def collect(shard: int, index: Index = index) -> list[tuple[int, tuple[bytes, ...]]]:
            out = []
            read = 0
            backend = ds.router.backends[shard]
            unseen = moves.ids_on(backend, shard, ds.kind)
            for _, entity_id, body, _ in iter_entities(backend, ds.kind):
                entity = codec.decode(body) if entity_id not in unseen else None
                for row in index.rows_or_none(entity, entity_id, ds.placement.buckets):
                    out.append((ds.placement.shard_of_bucket[row.bucket], (*row.keys, entity_id)))
                read += 1
                if read == PAGE:
                    advance(read)
                    read = 0
            advance(read)
            return out

        for part in ds.router.map(collect, shards):
            for shard, row in part:
                expected[shard].add(row)

        def held(shard: int, index: Index = index) -> set[tuple[bytes, ...]]:
            backend = ds.router.backends[shard]
            return set(iter_index_rows(backend, index)) - moves.index_rows_on(backend, shard, index)

        actual = ds.router.map(held, shards)
        missing = [(s, r) for s in shards for r in expected[s] - actual[s]]
        stale = [(s, r) for s in shards for r in actual[s] - expected[s]]
        report["indexes"][index.table] = {
            "state": registry.state(index.table),
            "missing": len(missing),
            "stale": len(stale),
            "examples": [
                {
                    "problem": kind,
                    "shard": s,
                    "entity_id": r[-1].hex(),
                    "keys": [k.hex() for k in r[:-1]],
                }
                for kind, rows in (("missing", missing), ("stale", stale))
                for s, r in sorted(rows)[:EXAMPLES]
            ],
        }
        report["missing"] += len(missing)
        report["stale"] += len(stale)
    return report


def _clashes(ds: Datastore) -> list[dict[str, Any]]:
    """Names the catalog records that meet another's (bagstore.names), and this
    kind's indexes whose table on some shard is not theirs: each set aside."""
    found = clashes(ds.catalog.kinds(), ds.index_catalog.all_entries())
    named = {c["name"] for c in found}
    for table in sorted(ds.index_tables.clashing - named):
        found.append(
            {
                "name": table,
                "sort": "index",
                "kind": ds.kind,
                "with": "a table of that name, not this index's, on some shard",
                "remedy": f"bagstore index rename {table} NEW_NAME (kind {ds.kind})",
            }
        )
    return found
