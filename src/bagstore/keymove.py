"""Whole-key migration: one shard key's entities, of every kind it places, to
another bucket (Yupoo moves a whole user).

Every kind of the store placed by the same shard key through the directory
shard map (``shard_map="directory"``) has its own directory entry for the key;
a migration moves them all, as one operation:

1. **freeze**: every kind's entry for the key is marked ``MIGRATING`` (writes
   to the key, of any of those kinds, get the retryable ``KeyMigrating``), then
   the migration waits out the directory cache's lifetime, so that no process
   still writes by an entry it read before;
2. **copy**: each kind's entities of the key are copied from the old bucket to
   the new one (version and ``updated`` kept), in batches, each batch's id
   lookup rows switched to the new bucket as it is copied;
3. **flip**: every kind's directory entry points at the new bucket, ``NORMAL``
   again (and the directory's per-bucket key counts follow);
4. **delete**: the old copies are deleted, recording no change (the change
   feed, when on, holds a put of each entity copied to another shard, in its
   new bucket, with the version it had; a copy within one shard records
   nothing: the entity's changes so far stay in its old bucket).

Index rows stay where they are: an index row lives on the bucket of its
``shard_on`` value's hash (never a directory bucket), and the entity ids do
not change, so every row still points at its entity.  Re-running a migration
that a crash interrupted finishes it: a kind whose entry already names the new
bucket (``NORMAL``) is done, the others are frozen again and copied (copies are
idempotent).  Kinds placed by the same property through the hash map have no
entry to move: their bucket is the key's hash.

Used through :meth:`bagstore.Mover.migrate_key` (and ``bagstore key migrate``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from bagstore import codec, keys
from bagstore.errors import ConfigurationError
from bagstore.sharding.directory import MIGRATING, NORMAL, Directory
from bagstore.sharding.placer import Placer

if TYPE_CHECKING:
    from bagstore.sharding.router import Router

__all__ = ["KeyMigration"]

log = logging.getLogger("bagstore.scaleout")


@dataclass
class _Kind:
    """One kind placed by the key: its placer and where the key is now."""

    kind: str
    placer: Placer
    directory: Directory
    old: int


class KeyMigration:
    """The migration of one shard key (``key``: its encoding) to ``to_bucket``,
    over the kinds of ``placers`` (placed by one shard key, directory map).

    ``batch``: entities copied per step; ``step(phase, rows)`` and
    ``progress(done, total)`` as the Mover reports them.
    """

    def __init__(
        self,
        router: Router,
        placers: list[Placer],
        key: bytes,
        to_bucket: int,
        *,
        batch: int,
        step: Callable[[str, int], None],
        progress: Callable[[int, int], None] | None,
    ) -> None:
        self.router = router
        self.placers = placers
        self.key = key
        self.to_bucket = to_bucket
        self.batch = batch
        self.step = step
        self.progress = progress

    def run(self, wait: float | None) -> dict[str, int]:
        """Freeze, copy, flip, delete; ``{kind: entities moved}``."""
        to_bucket = self.to_bucket
        kinds: list[_Kind] = []
        for placer in self.placers:
            directory = placer.directory
            assert directory is not None
            found = directory.lookup(self.key)
            if found is None:  # the key's first write of this kind goes there
                directory.set(self.key, to_bucket, NORMAL)
            elif found != (to_bucket, NORMAL):
                kinds.append(_Kind(placer.kind, placer, directory, found[0]))
        moved = {p.kind: 0 for p in self.placers}
        if not kinds:
            return moved
        for k in kinds:  # 1. freeze every kind's entry
            k.directory.set(self.key, k.old, MIGRATING)
        self.step("wait", 0)
        ttl = max(k.directory.ttl for k in kinds)
        time.sleep(ttl + 0.2 if wait is None else wait)
        placement = self.router.refresh(force=True)
        copied: dict[str, list[bytes]] = {}
        for k in kinds:  # 2. copy
            copied[k.kind] = self._copy(k, placement.shard_of_bucket)
            moved[k.kind] = len(copied[k.kind])
        for k in kinds:  # 3. flip
            k.directory.set(self.key, to_bucket, NORMAL)
            if k.old != to_bucket:
                k.directory.moved(k.old, to_bucket)
        for k in kinds:  # 4. delete the old copies
            src = self.router.backends[placement.shard_of_bucket[k.old]]
            dst = self.router.backends[placement.shard_of_bucket[to_bucket]]
            if src is not dst:  # (no delete in the feed: the entity lives on)
                src.delete_entities(k.kind, copied[k.kind], [k.old], read_old=False, record=False)
        log.info(
            "key moved to bucket %d: %s",
            to_bucket,
            ", ".join(f"{k.kind} {moved[k.kind]} entities from bucket {k.old}" for k in kinds),
        )
        return moved

    def _copy(self, k: _Kind, shard_of_bucket: tuple[int, ...]) -> list[bytes]:
        """Copy the key's entities of one kind into the new bucket (their lookup
        rows switched batch by batch); the ids copied."""
        src = self.router.backends[shard_of_bucket[k.old]]
        dst = self.router.backends[shard_of_bucket[self.to_bucket]]
        dst.ensure_kind(k.kind)
        ids = list(src.bucket_stamps(k.kind, k.old)) if src.table_columns(k.kind) else []
        copied: list[bytes] = []
        for start in range(0, len(ids), self.batch):
            rows = src.entity_rows(k.kind, ids[start : start + self.batch])
            mine = [r for r in rows if k.placer.key_of(codec.decode(r[4])) == self.key]
            dst.copy_entity_rows(
                k.kind, [(i, self.to_bucket, u, v, body) for i, _, u, v, body in mine]
            )
            k.placer.record({r[0]: self.to_bucket for r in mine})
            copied += [r[0] for r in mine]
            self.step("copy", len(mine))
            if self.progress is not None:
                self.progress(min(start + self.batch, len(ids)), len(ids))
        return copied


def placers_of_key(
    router: Router, first: Placer, placements: dict[str, tuple[str, str]]
) -> list[Placer]:
    """The placers of every kind placed by ``first``'s shard key through the
    directory map (``placements``: ``{kind: (shard_key, shard_map)}`` as the
    catalog records them), ``first`` first."""
    out = [first]
    for kind, (shard_key, shard_map) in sorted(placements.items()):
        if kind != first.kind and shard_key == first.shard_key and shard_map == "directory":
            out.append(Placer(router, kind, shard_key, shard_map))
    return out


def encode_key(value: object) -> bytes:
    """A shard key as the directory stores it (ConfigurationError if it has none)."""
    try:
        return keys.encode_value(value)
    except keys.UnindexableValue as exc:
        raise ConfigurationError(f"bad shard key {value!r}: {exc}") from None
