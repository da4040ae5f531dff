"""What :meth:`bagstore.Datastore.count` and :meth:`~bagstore.Datastore.status`
report, read through the router (this module sits below the facade).

A bucket in an unfinished move is counted once, on the shard that owns it
(see :mod:`bagstore.owners`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from bagstore.colocated import atomicity

if TYPE_CHECKING:
    from bagstore.cache import CacheLayer
    from bagstore.index import Registry
    from bagstore.sharding.router import Router

__all__ = ["shard_counts", "store_status"]


def shard_counts(router: Router, kind: str) -> list[int]:
    """Entities of ``kind`` per shard, each bucket counted on its owner only."""
    from bagstore.owners import unfinished_moves

    moves = unfinished_moves(router)
    backends = router.backends

    def on(shard: int) -> int:
        backend = backends[shard]
        n = backend.count(kind)
        return n - len(moves.ids_on(backend, shard, kind)) if moves else n

    return router.map(on, range(len(backends)))


def store_status(
    router: Router,
    kind: str,
    counts: list[int],
    registry: Callable[[], Registry],
    shard_key: str | None,
    cache_layer: CacheLayer,
) -> dict[str, Any]:
    """The ``status()`` of kind ``kind`` given its ``counts`` per shard (see
    :func:`shard_counts`): ``registry()`` gives its indexes, ``shard_key`` is
    what places it, ``cache_layer`` its cache."""
    topology = router.topology
    library: dict[str, Any] = {}
    if any(b.dialect.name == "sqlite" for b in topology.backends):
        from bagstore.backends.sqlite import sqlite_library

        library["sqlite"] = sqlite_library()
    return {
        "kind": kind,
        "buckets": topology.buckets,
        "shards": [
            {
                "shard": i,
                "name": b.name,
                "buckets": topology.shard_of_bucket.count(i),
                "entities": counts[i],
                "ownership_gate": b.gated,
            }
            for i, b in enumerate(topology.backends)
        ],
        "entities": sum(counts),
        "index_writes": atomicity(
            registry().maintained(), shard_key, topology.sole_shard is not None
        ),
        **({"cache": cache_layer.status()} if cache_layer.cache is not None else {}),
        **library,
    }


def gate_notes(shards: list[dict[str, Any]]) -> list[str]:
    """A line for people about each shard of ``store_status``'s ``shards``
    that has no ownership gate (backends/gate.py)."""
    return [
        f"shard {s['shard']} has no ownership gate (its login may not create triggers): "
        "writes of many buckets lock each bucket's row (docs/scaleout.md)"
        for s in shards
        if not s["ownership_gate"]
    ]
