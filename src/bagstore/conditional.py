"""Conditional writes and read-modify-write: no lost updates.

``ds.get_with_version(id)`` reads an entity and its version from the shard
that holds it (never from a cache level); ``ds.put(entity,
expect_version=v)`` writes only if the stored version is still ``v`` (0: only
if the id does not exist), checked in the transaction that writes, else
raises :class:`bagstore.Conflict` and changes nothing;
``ds.delete(id, expect_version=v)`` likewise.  ``ds.update(id, fn)`` puts it
together: read with the version, ``fn(entity)``, conditional put, and on a
``Conflict`` read again and retry (after a short, jittered pause).

    >>> import bagstore, tempfile
    >>> ds = bagstore.open(tempfile.mkdtemp())
    >>> entity_id = ds.put({"likes": 0})
    >>> entity, version = ds.get_with_version(entity_id)
    >>> ds.put({**entity, "likes": 1}, expect_version=version) == entity_id
    True
    >>> try:
    ...     ds.put({**entity, "likes": 5}, expect_version=version)  # stale version
    ... except bagstore.Conflict as exc:
    ...     print(exc.id == entity_id, exc.found > version)
    True True
    >>> ds.update(entity_id, lambda e: {**e, "likes": e["likes"] + 1})["likes"]
    2
    >>> ds.close()
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from bagstore import codec
from bagstore.errors import (
    BagstoreError,
    Conflict,
    InvalidEntity,
    InvalidQuery,
    ShardTimeout,
)
from bagstore.sharding.hashing import bucket_of
from bagstore.writes import check_id

if TYPE_CHECKING:
    from bagstore.sharding.placer import Placer
    from bagstore.writes import Writes

__all__ = ["DEFAULT_RETRIES", "Conditional", "check_expect", "expectations", "expecting"]

log = logging.getLogger(__name__)

#: How many times ``update`` tries again after a Conflict, by default.
DEFAULT_RETRIES = 20
#: The longest pause between two tries of ``update`` (seconds).
MAX_PAUSE = 0.05
_MAX_VERSION = 2**63 - 1


def check_expect(value: object, error: type[BagstoreError], what: str = "expect_version") -> int:
    """``value`` if it is a version one may expect (an int, 0 or more)."""
    if type(value) is not int:
        raise error(f"{what} must be an int (0: only if absent), not {type(value).__name__}")
    if not 0 <= value <= _MAX_VERSION:
        raise error(f"{what} must be 0 or more (0: only if absent), not {value}")
    return value


def expecting(entity_id: bytes, expect_version: object) -> dict[bytes, int] | None:
    """The ``{id: version}`` a ``delete(id, expect_version=...)`` asks for."""
    if expect_version is None:
        return None
    return {entity_id: check_expect(expect_version, InvalidQuery)}


def expectations(
    entities: Sequence[Mapping[str, Any]],
    expect_version: object = None,
    expect_versions: object = None,
) -> dict[bytes, int] | None:
    """The ``{id: version}`` a ``put`` (one entity, ``expect_version``) or a
    ``put_many`` (``expect_versions``) asks for, checked: ``InvalidEntity``
    for anything that is not an id among the entities mapped to a version."""
    if expect_version is not None:
        v = check_expect(expect_version, InvalidEntity)
        entity = entities[0] if entities else None
        if not isinstance(entity, Mapping):
            return None  # Writes.row says what is wrong with it
        entity_id = entity.get("id")
        if entity_id is None:
            if v != 0:
                raise InvalidEntity(
                    f"an entity without an id is new: expect_version must be 0, not {v}"
                )
            return {}  # a new id: absent by construction, written under the condition
        return {check_id(entity_id, InvalidEntity): v}
    if expect_versions is None:
        return None
    if not isinstance(expect_versions, Mapping):
        raise InvalidEntity(
            f"expect_versions must be a dict {{id: version}}, not {type(expect_versions).__name__}"
        )
    ids = {e["id"] for e in entities if isinstance(e, Mapping) and type(e.get("id")) is bytes}
    out: dict[bytes, int] = {}
    for entity_id, v in expect_versions.items():
        check_id(entity_id, InvalidEntity)
        if entity_id not in ids:
            raise InvalidEntity(
                f"expect_versions names {entity_id.hex()}, which is not among the entities"
            )
        out[entity_id] = check_expect(v, InvalidEntity, f"expect_versions[{entity_id.hex()}]")
    return out


class Conditional:
    """``get_with_version`` and ``update`` of one kind, over its writes."""

    def __init__(
        self,
        writes: Writes,
        placer: Placer,
        fetch_one: Callable[[bytes, int | None], tuple[bytes, int] | None],
    ) -> None:
        self.writes = writes
        self.placer = placer
        #: ``(body, version)`` of an entity as its shard holds it now, past
        #: every cache level (given its id's bucket where the id names it,
        #: else None)
        self.fetch_one = fetch_one

    def get_with_version(self, entity_id: bytes) -> tuple[dict[str, Any], int] | None:
        """``(entity, version)`` as the shard holding it has it now, or None."""
        stored = self.fetch_one(entity_id, None)
        return None if stored is None else (codec.decode(stored[0]), stored[1])

    def _read_settled(self, entity_id: bytes) -> tuple[bytes, int] | None:
        """``(body, version)`` read with the row locked: a write whose outcome
        was unknown has committed or rolled back by then."""
        where = [(i, b) for b, ids in self.placer.group([entity_id]).items() for i in ids]
        if not where:
            return None
        entity_id, bucket = where[0]
        found = self.writes.router.on_bucket(
            bucket, lambda backend: backend.read_locked(self.writes.kind, [entity_id], [bucket])
        ).get(entity_id)
        return None if found is None else (found.body, found.version)

    def update(
        self,
        entity_id: bytes,
        fn: Callable[[dict[str, Any] | None], dict[str, Any] | None],
        retries: int = DEFAULT_RETRIES,
    ) -> dict[str, Any] | None:
        """Read, ``fn``, conditional put; again on ``Conflict`` (up to
        ``retries`` more times); return the entity stored.

        ``fn`` gets the entity (None if absent) and returns the new one (its
        id is set to ``entity_id``), or None to write nothing.  After a
        ``ShardTimeout`` (the put may or may not have been applied) the entity
        is read again with its row locked: if it holds what was written the
        update is done; if it is unchanged the put is tried again; otherwise
        the ShardTimeout is raised (another writer came after: whether this
        put was applied cannot be told)."""
        if type(entity_id) is not bytes or len(entity_id) != 16:
            check_id(entity_id, InvalidQuery)  # raises, saying what is wrong
        if not callable(fn):
            raise InvalidQuery(f"update needs a function of the entity, not {type(fn).__name__}")
        if type(retries) is not int or retries < 0:
            raise InvalidQuery(f"retries must be an int, 0 or more, not {retries!r}")
        writes = self.writes
        kind = writes.kind
        keyed = self.placer.shard_key is not None
        bucket = None  # the id's, once hashed (a kind placed by its id)
        conflicts = 0
        for attempt in range(retries + 1):
            # The row's shard, where its write is the row alone (rowalone.RowAlone.alone):
            # read there and written there in one statement each (Writes.put's
            # short path, without its frames); else the read and put of any
            # kind.  One shard holding every bucket needs no hash of the id.
            backend, route = (None, ()) if keyed else writes.alone_route()
            if backend is None and not keyed:
                if bucket is None:
                    bucket = bucket_of(entity_id, writes.buckets)
                if route:
                    backend = route[bucket]
            if backend is not None:
                stored = backend.get_versioned(kind, entity_id)
            else:
                stored = self.fetch_one(entity_id, bucket)
            current = None if stored is None else codec.decode(stored[0])
            version = 0 if stored is None else stored[1]
            new = fn(current)
            if new is None:
                return current
            if not isinstance(new, dict):
                raise InvalidEntity(
                    f"update's function must return a dict or None, not {type(new).__name__}"
                )
            if new.get("id", entity_id) != entity_id:
                raise InvalidEntity("update's function returned an entity with another id")
            new["id"] = entity_id
            try:
                if backend is not None and version:
                    body = codec.encode(new)
                    if len(body) > writes.max_body_bytes:
                        raise writes.too_big(entity_id, body)
                    if writes.update_row(backend, entity_id, bucket, body, version):
                        return new
                # (no row, a bucket not owned here, or more to write than the row)
                writes.put([new], {entity_id: version})
                return new
            except Conflict:
                conflicts += 1
            except ShardTimeout as exc:
                if self._applied(entity_id, new, version, exc):
                    return new
            if attempt < retries:
                time.sleep(random.uniform(0, min(MAX_PAUSE, 0.001 * 2**attempt)))
        found = self.get_with_version(entity_id)
        raise Conflict(
            f"update of {entity_id.hex()}: {conflicts} conflicts, gave up after "
            f"{retries + 1} tries (retries={retries})",
            id=entity_id,
            found=found[1] if found is not None else 0,
        )

    def _applied(
        self, entity_id: bytes, new: dict[str, Any], version: int, timeout: ShardTimeout
    ) -> bool:
        """After a put whose outcome is unknown: True if it was applied, False
        if it was not (safe to try again); raises the timeout otherwise."""
        now = self._read_settled(entity_id)
        if now is not None and now[0] == codec.encode(new):
            return True
        if (now[1] if now is not None else 0) == version:
            log.info("update of %s: the put that timed out was not applied; again", entity_id.hex())
            return False
        raise ShardTimeout(
            f"update of {entity_id.hex()}: a put timed out and another write came after it; "
            "whether it was applied cannot be told (read the entity before writing again)",
            shard=timeout.shard,
        ) from timeout
