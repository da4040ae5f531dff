"""Consistency report: index rows missing or stale, per index. Changes nothing.

For every index the catalog lists as ``building`` or ``ready``, the rows every
entity should have (computed from its body exactly as the writers do) are
compared with the rows each shard's index table holds:

* *missing*: a row an entity should have that is not on its shard;
* *stale*: a row that no entity accounts for (its entity is gone, no longer has
  that value, or the row sits on the wrong shard).

The check reads every entity and every index row: it is a tool for tests,
operators and the Cleaner, not for a request path.  It holds the expected rows
of one index in memory at a time.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from bagstore import codec
from bagstore.backends.indexsql import Scan

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


def check(ds: Datastore) -> dict[str, Any]:
    """The report ``Datastore.check()`` returns (see its docstring)."""
    registry = ds.registry(refresh=True)
    report: dict[str, Any] = {"missing": 0, "stale": 0, "indexes": {}}
    shards = range(len(ds._backends))
    for index in registry.maintained():
        expected: list[set[tuple[bytes, ...]]] = [set() for _ in shards]

        def collect(backend: Backend, index: Index = index) -> list[tuple[int, tuple[bytes, ...]]]:
            out = []
            for _, entity_id, body, _ in iter_entities(backend, ds.kind):
                entity = codec.decode(body)
                for row in index.rows_or_none(entity, entity_id, ds.placement.buckets):
                    out.append((ds.placement.shard_of_bucket[row.bucket], (*row.keys, entity_id)))
            return out

        for part in ds._map(collect, ds._backends):
            for shard, row in part:
                expected[shard].add(row)

        def held(backend: Backend, index: Index = index) -> set[tuple[bytes, ...]]:
            return set(iter_index_rows(backend, index))

        actual = ds._map(held, ds._backends)
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
