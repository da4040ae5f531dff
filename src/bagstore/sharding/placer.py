"""Where an entity lives: the bucket of its id, or of its shard key.

By default a kind is placed by the hash of each entity's ``id``.  A kind may be
placed by another property instead (``shard_key="user_id"``: all of a user's
photos in one bucket, as Yupoo kept them), hashed or looked up in the
directory (``shard_map="directory"``).  Then ``get(id)`` needs the id's bucket
without the key: every shard keeps ``bagstore_ids`` rows (id -> bucket of the
entity), each on the bucket of its id's hash, written before the entity, cached
in-process; an id that is not found there is looked for on every shard (and
its row written again), so the lookup table is a fast path, never the truth.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from bagstore import keys
from bagstore.errors import InvalidEntity
from bagstore.sharding.directory import Directory
from bagstore.sharding.hashing import bucket_of, buckets_of
from bagstore.sharding.home import check_global

if TYPE_CHECKING:
    from bagstore.backends import Backend
    from bagstore.sharding.router import Router

__all__ = ["Placer"]

_CACHE = 100_000


class Placer:
    """Bucket of entities and ids for one kind of one datastore."""

    def __init__(self, router: Router, kind: str, shard_key: str | None, shard_map: str) -> None:
        check_global(shard_map, shard_key, None)
        self.router = router
        self.kind = kind
        self.shard_key = shard_key
        self.directory = (
            Directory(
                router.catalog_backend, kind, router.placement.buckets, router.refresh_interval
            )
            if shard_map == "directory"
            else None
        )
        self._known: OrderedDict[bytes, int] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def keyed(self) -> bool:
        return self.shard_key is not None

    # -- entities ------------------------------------------------------------------
    def key_of(self, entity: Mapping[str, Any]) -> bytes:
        """The encoded shard key of an entity (InvalidEntity if it has none)."""
        assert self.shard_key is not None
        value = entity.get(self.shard_key)
        if value is None or isinstance(value, list):
            raise InvalidEntity(
                f"kind {self.kind!r} is placed by {self.shard_key!r}: every entity needs "
                "one (a str, bytes, int, float, bool or datetime)"
            )
        try:
            return keys.encode_value(value)
        except keys.UnindexableValue as exc:
            raise InvalidEntity(f"shard key {self.shard_key!r}: {exc}") from None

    def bucket_of_key(self, key: bytes, *, for_write: bool) -> int | None:
        if self.directory is None:
            return bucket_of(key, self.router.placement.buckets)
        if for_write:
            return self.directory.bucket_for_write(key)
        found = self.directory.lookup(key)
        return found[0] if found else None

    def entity_bucket(self, entity: Mapping[str, Any], entity_id: bytes) -> int:
        """The bucket an entity is written to (may assign a directory entry)."""
        if self.shard_key is None:
            return bucket_of(entity_id, self.router.placement.buckets)
        bucket = self.bucket_of_key(self.key_of(entity), for_write=True)
        assert bucket is not None
        return bucket

    # -- ids -------------------------------------------------------------------------
    def id_bucket(self, entity_id: bytes) -> int:
        """The bucket where an id's lookup row lives (the hash of the id)."""
        return bucket_of(entity_id, self.router.placement.buckets)

    def locate(self, ids: Iterable[bytes]) -> dict[bytes, int]:
        """``{id: bucket}`` of the ids whose entity's bucket is known (by hash,
        cache or lookup rows); ids not recorded anywhere are left out."""
        if self.shard_key is None:
            return buckets_of(ids, self.router.placement.buckets)
        out: dict[bytes, int] = {}
        missing: list[bytes] = []
        with self._lock:
            for i in ids:
                hit = self._known.get(i)
                if hit is None:
                    missing.append(i)
                else:
                    out[i] = hit
        if missing:
            found = self.router.by_bucket(
                list(dict.fromkeys(missing)),
                self.id_bucket,
                lambda b, part: b.lookup_ids(self.kind, part),
            )
            for part in found:
                out.update(part)
            self.remember(out)
        return out

    def search(self, ids: Sequence[bytes]) -> dict[bytes, int]:
        """Find ids on every shard (when the lookup rows do not know them) and
        record what is found again."""

        def on(backend: Backend) -> list[tuple[bytes, int]]:
            rows = backend.entity_rows(self.kind, ids)
            return [(r[0], r[1]) for r in rows]

        found = dict(pair for part in self.router.on_all(on) for pair in part)
        if found and self.keyed:
            self.record(found)
        return found

    def remember(self, pairs: Mapping[bytes, int]) -> None:
        if self.shard_key is None:
            return
        with self._lock:
            for i, b in pairs.items():
                self._known[i] = b
                self._known.move_to_end(i)
            while len(self._known) > _CACHE:
                self._known.popitem(last=False)

    def record(self, pairs: Mapping[bytes, int]) -> None:
        """Write lookup rows ``id -> entity bucket`` (before the entities)."""
        if self.shard_key is None or not pairs:
            return
        kind = self.kind
        self.router.by_bucket(
            list(pairs.items()),
            lambda item: self.id_bucket(item[0]),
            lambda b, part: b.record_ids(kind, [(i, self.id_bucket(i), eb) for i, eb in part]),
        )
        self.remember(pairs)

    def forget(self, ids: Sequence[bytes]) -> None:
        if self.shard_key is None or not ids:
            return
        self.router.by_bucket(
            list(ids), self.id_bucket, lambda b, part: b.forget_ids(self.kind, part)
        )
        with self._lock:
            for i in ids:
                self._known.pop(i, None)

    def group(self, ids: Iterable[bytes]) -> dict[int, list[bytes]]:
        """Ids by bucket (unknown ids searched for on every shard)."""
        wanted = list(dict.fromkeys(ids))
        where = self.locate(wanted)
        unknown = [i for i in wanted if i not in where]
        if unknown and self.keyed:
            where.update(self.search(unknown))
        grouped: dict[int, list[bytes]] = defaultdict(list)
        for i in wanted:
            if i in where:
                grouped[where[i]].append(i)
        return grouped
