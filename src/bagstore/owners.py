"""Who owns what, as whole-store readers must see it.

*A bucket in a half-finished move.*  While a move is unfinished (the catalog's
``bagstore_moves`` has a row for the bucket), the bucket has two copies: the
source's and the target's.  Its *owner* is the shard the catalog's placement
points the bucket at: the source until the switch, the target from then on
(the placement changes before the move's phase becomes ``switched``).  The
other copy is not the owner's: a copy still being filled (the target's, before
the switch) or a leftover the mover deletes after its grace period (the
source's, after the switch), which a killed mover can leave for as long as
nobody resumes it.  ``count()``, ``check()`` and the Cleaner's repair read
such a bucket once, from its owner: the other copy's entities and index rows
are invisible to them, and a repair never deletes a row on the strength of it.

*A unique value.*  A unique index row is its entity's claim on the value; it
may be taken over by another entity, or removed by a repair, only when
:func:`claim_is_dead` says so: its entity does not hold the value and no write
of it can still be in flight (the claim is older than its entity's last write,
or older than the lease).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from bagstore import codec

if TYPE_CHECKING:
    from bagstore.backends import Backend
    from bagstore.backends.base import Stored
    from bagstore.backends.indexsql import IndexRow
    from bagstore.index import Index
    from bagstore.sharding.router import Router

__all__ = ["Moves", "claim_is_dead", "drop_dead_claims", "unfinished_moves"]


@dataclass(frozen=True)
class Moves:
    """The copies unfinished moves hide: ``hidden[shard]`` holds the buckets
    whose copy on ``shard`` is not their owner's."""

    hidden: Mapping[int, frozenset[int]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.hidden)

    def hides(self, shard: int, bucket: int) -> bool:
        """Whether the copy of ``bucket`` on ``shard`` is not the owner's."""
        return bucket in self.hidden.get(shard, ())

    def ids_on(self, backend: Backend, shard: int, kind: str) -> set[bytes]:
        """Ids of the entities of ``kind`` in the hidden copies on ``shard``."""
        out: set[bytes] = set()
        for bucket in sorted(self.hidden.get(shard, ())):
            out.update(backend.bucket_stamps(kind, bucket))
        return out

    def index_rows_on(self, backend: Backend, shard: int, index: Index) -> set[tuple[bytes, ...]]:
        """``(key..., entity_id)`` of the index rows in the hidden copies on ``shard``."""
        out: set[tuple[bytes, ...]] = set()
        for bucket in sorted(self.hidden.get(shard, ())):
            rows = backend.bucket_index_rows(index.table, index.properties, index.unique, bucket)
            out.update((*r.keys, r.entity_id) for r in rows)
        return out


def unfinished_moves(router: Router) -> Moves:
    """The copies hidden by the catalog's unfinished moves, as it holds them now.

    The moves are read first, then where the placement puts their buckets (so
    a move that switches in between is seen switched); ``router`` learns those
    owners, so that its routing agrees.  One catalog read when no move is
    unfinished."""
    if router.pinned:  # a global kind: no bucket move concerns its one database
        return Moves()
    moves = router.catalog.moves()
    if not moves:
        return Moves()
    owners = router.catalog.shards_of(sorted(moves))
    moved = any(router.placement.shard_of_bucket[b] != s for b, s in owners.items())
    if moved and not router.learn(owners):  # a shard this process has not opened
        router.refresh(force=True)
    hidden: dict[int, set[int]] = {}
    for bucket, (source, target, _) in moves.items():
        owner = owners.get(bucket, source)
        for shard in (source, target):
            if shard != owner and shard < len(router.backends):
                hidden.setdefault(shard, set()).add(bucket)
    return Moves({s: frozenset(b) for s, b in hidden.items()})


def claim_is_dead(
    index: Index,
    keys: tuple[bytes, ...],
    owner: bytes,
    claimed: int,
    stored: Stored | None,
    now: int,
    lease_us: int,
    buckets: int,
) -> bool:
    """Whether the unique row ``keys`` -> ``owner``, claimed at ``claimed`` (µs),
    may be taken over or removed: ``owner`` (``stored``: its row as its owner
    shard holds it, None if it does not exist) does not hold the value, and no
    write of it can be in flight — a claim is written before its entity, so a
    claim newer than the entity's last write (or an entity not written yet) is
    a write in progress until the lease (``lease_us``) has run out."""
    if stored is not None:
        body = codec.decode(stored.body)
        if any(r.keys == keys for r in index.rows_or_none(body, owner, buckets)):
            return False
    in_flight = (stored is None or claimed > stored.updated) and now - claimed < lease_us
    return not in_flight


def drop_dead_claims(
    router: Router,
    lease: int,
    index: Index,
    rows: Iterable[tuple[int, IndexRow]],
    stored: Mapping[bytes, Stored | None],
) -> tuple[int, list[IndexRow]]:
    """Delete the unique rows among ``(shard, row)`` whose claims are dead (see
        :func:`claim_is_dead`; ``stored``: each entity as its owner holds it, absent
        or None when it does not exist); return how many went, and the rows tried
    (for the cache to forget).  A row is deleted
        only as it was judged (same entity, same claim time), on a shard that owns
        its bucket and is not moving it; the others stay for a later pass."""
    by_shard: dict[int, set[IndexRow]] = {}
    for shard, row in rows:
        by_shard.setdefault(shard, set()).add(row)
    now = time.time_ns() // 1000
    buckets = router.placement.buckets
    removed, tried = 0, []
    for shard, wanted in by_shard.items():
        backend = router.backends[shard]
        ids = sorted({r.entity_id for r in wanted})
        dead = [
            (row, claimed)
            for row, claimed in backend.claims_of_entities(index.table, index.properties, ids)
            if row in wanted
            and claim_is_dead(
                index,
                row.keys,
                row.entity_id,
                claimed,
                stored.get(row.entity_id),
                now,
                lease,
                buckets,
            )
        ]
        if dead:
            removed += backend.drop_claims(index.table, index.properties, dead)
            tried += [row for row, _ in dead]
    return removed, tried
