"""The caching logic the datastore calls: entities by id, query pages by revision.

Keys (``P`` is the datastore's prefix -- store id and kind by default -- and,
in memcached and Redis, the store's current cache token: ``P = bs:<store>:<kind>:<token>:``)::

    P e:<entity id hex>           an entity entry or a writer's marker
    P r:<hash of index + scope>   a revision counter (decimal)
    P l:<hash of query + revs>    a query page: ids and next cursor

**Entities.**  A read looks in level 1 (the open request, if any), then asks
level 2 for the rest in one multi-get (grouped per server), then the database
for what is still missing.  A key that was *absent* is filled with ``add``
(stored only if still absent).  After its commit, a writer does not delete the
key: it *sets* it to a marker carrying the entity's new version (a delete: a
"gone" marker whose version is the deleted one + 1), with a short TTL.  So a
reader that read the database before the write committed and fills afterwards
finds the marker there and its ``add`` fails (python-ndb #651-#653: the stale
fill).  A reader that finds a marker reads the database and replaces the marker
only by compare-and-set (memcached ``gets``/``cas``, Redis a Lua script, the
memory cache its lock), and only with a version at least the marker's.

**Query pages** (:mod:`bagstore.cache.pages`): id lists under the revisions
of their scopes, which every write that changes index rows bumps.

**Failures.**  Every level-2 call is guarded: the client's errors are counted,
logged (at the 1st, 10th, 100th... error) and answered from the database.  An
invalidation (marker or bump) that was not confirmed is kept and sent again (at
most twice a second); until it lands no datastore of this process reads those
keys from level 2, and the store's shared cache state is turned ``suspect``
(:mod:`bagstore.cache.shared`): no process trusts level 2 until a new token,
under which nothing old is stored, is in use.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from hashlib import blake2b
from typing import TYPE_CHECKING, Any, TypeVar

from bagstore import codec
from bagstore.backends.base import Stored
from bagstore.cache.base import (
    Cache,
    CacheStats,
    Marker,
    decode_value,
    encode_entity,
    encode_marker,
)
from bagstore.cache.pages import _FAILED, MAX_VALUE, PageReads, _Failed, _now_us
from bagstore.cache.request import _current, copy_entity, current, entity_copy
from bagstore.cache.shared import RETRY_INTERVAL, Cell, State, shared_for
from bagstore.index import READY
from bagstore.indexer import Change

if TYPE_CHECKING:
    from bagstore.backends.base import EntityRow
    from bagstore.backends.indexsql import IndexRow
    from bagstore.index import Index, Registry
    from bagstore.indexer import Claim

__all__ = ["CacheLayer"]

log = logging.getLogger("bagstore.cache")

T = TypeVar("T")

#: The version of a writer's lease taken before its commit: no fill replaces it.
LEASE = 2**63 - 1


_NO_ENTITY: list[Any] = [None]


class CacheLayer(PageReads):
    """Level 1 and level 2 for one datastore (one store, one kind).

    ``cache`` is the level-2 client, or None for level 1 only.  ``cell`` is
    where the store's cache state is shared between processes (the catalog;
    None for an in-process cache, whose keys then carry no token) and ``store``
    the store's id: every datastore of the process on that store and cache
    server set shares one :class:`~bagstore.cache.shared.Shared`.
    ``before_fill`` is a test hook: called as ``before_fill(what, keys)`` after a
    reader's database read and before its cache fill (``what`` is
    ``"entities"`` or ``"list"``), to force the read-fill race.
    """

    def __init__(
        self,
        cache: Cache | None,
        prefix: str,
        *,
        ttl: int = 3600,
        list_ttl: int = 600,
        marker_ttl: int = 60,
        revision_ttl: int = 86_400,
        owns_cache: bool = True,
        cell: Cell | None = None,
        store: str | None = None,
    ) -> None:
        self.cache = cache
        self.prefix = prefix
        self.ttl = ttl
        self.list_ttl = list_ttl
        self.marker_ttl = marker_ttl
        self.revision_ttl = max(revision_ttl, 2 * list_ttl)
        self.stats = CacheStats()
        self.before_fill: Callable[[str, list[Any]], None] | None = None
        self._owns_cache = owns_cache
        self._ekey = prefix + "e:"
        self._lock = threading.Lock()
        self._memo = OrderedDict()
        self._cell = cell if cache is not None else None
        self._shared = shared_for(_servers_of(cache), store if self._cell is not None else None)

    # -- keys ------------------------------------------------------------------------
    def _kp(self, token: str | None = None) -> str:
        """The level-2 key prefix under a token (None: the last one this process
        knows of).  Level 1 keys carry no token (``_ekey``)."""
        if token is None:
            snap = self._shared.snapshot
            token = snap[0].token if snap is not None else ""
        return f"{self.prefix}{token}:" if token else self.prefix

    def entity_key(self, entity_id: bytes) -> str:
        """The level-2 key of an entity (under the token this process knows of)."""
        return self._kp() + "e:" + entity_id.hex()

    def _hashed(self, tag: str, *parts: bytes, kp: str | None = None) -> str:
        h = blake2b(digest_size=12)
        for p in parts:
            h.update(len(p).to_bytes(4, "big"))
            h.update(p)
        return f"{self._kp() if kp is None else kp}{tag}:{h.hexdigest()}"

    def _state(self) -> State | None:
        """The shared cache state to go by now (None: not known, level 2 not
        trusted); see :mod:`bagstore.cache.shared`."""
        return self._shared.view(self._cell, self._probe)

    def _probe(self) -> bool:
        """Whether every cache server answers now (before a ``suspect`` state ends)."""
        if self.cache is None:
            return False
        ping = getattr(self.cache, "ping", None)
        if callable(ping):
            return self._l2("probe", ping) is True
        failed = self._l2("probe", self.cache.set_many, {self.prefix + "probe": b"1"}, 10)
        return failed == []

    # -- guarded level-2 calls -----------------------------------------------------------
    def _l2(self, what: str, fn: Callable[..., T], *args: Any) -> T | _Failed:
        """``fn(*args)``, or ``_FAILED`` after counting and logging a client error."""
        assert self.cache is not None
        try:
            return fn(*args)
        except self.cache.errors as exc:
            self._error(what, f"{type(exc).__name__}: {exc}")
            return _FAILED

    def _error(self, what: str, detail: str) -> None:
        self.stats.l2.add(errors=1)
        errors = self.stats.l2.errors
        if _decade(errors):
            log.warning(
                "cache %s: %s failed (%s); %d cache errors so far, reading the database",
                self.cache.name if self.cache is not None else None,
                what,
                detail,
                errors,
            )

    def _bypassed(self) -> frozenset[str]:
        """Keys whose invalidation has not been confirmed yet, by any datastore of
        this process on this store and cache (read from the database only)."""
        shared = self._shared
        if not shared.pending:
            return frozenset()
        if time.monotonic() >= shared.retry_at:
            self.retry_pending()
        with shared.lock:
            return frozenset(shared.pending)

    def retry_pending(self) -> int:
        """Send the unconfirmed invalidations again; return how many are left."""
        if self.cache is None:
            return 0
        shared = self._shared
        with shared.lock:
            shared.retry_at = time.monotonic() + RETRY_INTERVAL
            items = list(shared.pending.items())
        snapshot = dict(items)
        markers = {k: v for k, v in items if v is not None}
        bumps = [k for k, v in items if v is None]
        done: list[str] = []
        if markers:
            failed = self._l2("invalidate", self.cache.set_many, markers, self.marker_ttl)
            if not isinstance(failed, _Failed):
                done += [k for k in markers if k not in set(failed)]
        if bumps and not isinstance(
            self._l2("bump", self.cache.bump, bumps, _now_us(), self.revision_ttl), _Failed
        ):
            done += bumps
        with shared.lock:
            for k in done:
                if k in shared.pending and shared.pending[k] == snapshot[k]:
                    del shared.pending[k]
            return len(shared.pending)

    # -- entities --------------------------------------------------------------------
    def read_entities(
        self,
        ids: Sequence[bytes],
        load: Callable[[list[bytes]], dict[bytes, Stored]],
        prefetched: Mapping[str, Any] | None = None,
    ) -> dict[bytes, Stored]:
        """``{id: Stored}`` of the ids that exist: level 1, level 2, then ``load``.
        ``prefetched``: level-2 items this read already holds (keys it need not
        ask for again), from a multi-get made after the read began."""
        wanted = list(dict.fromkeys(ids))
        rc = current()
        out: dict[bytes, Stored] = {}
        if rc is not None:
            rest = []
            for i in wanted:
                entry = rc.entities.get(self._ekey + i.hex())
                if entry is None:
                    rest.append(i)
                elif entry[0] is not None:
                    out[i] = entry[0]
            self.stats.l1.add(hits=len(wanted) - len(rest), misses=len(rest))
            wanted = rest
        if wanted:
            found = (
                self._read_l2(wanted, load, prefetched) if self.cache is not None else load(wanted)
            )
            out.update(found)
            if rc is not None:
                for i in wanted:
                    rc.entities[self._ekey + i.hex()] = [found.get(i)]
        return out

    def decoded(
        self,
        ids: Sequence[bytes],
        load: Callable[[list[bytes]], dict[bytes, Stored]],
        prefetched: Mapping[str, Any] | None = None,
    ) -> dict[bytes, dict[str, Any]]:
        """Like :meth:`read_entities`, decoded (each dict a fresh copy)."""
        rc = current()
        if rc is None:
            found = self.read_entities(ids, load, prefetched)
            return {k: codec.decode(v.body) for k, v in found.items()}
        self.read_entities(ids, load, prefetched)
        out: dict[bytes, dict[str, Any]] = {}
        for i in ids:
            entry = rc.entities.get(self._ekey + i.hex(), _NO_ENTITY)
            if entry[0] is not None:
                out[i] = entity_copy(entry, codec.decode)
        return out

    def get_many(
        self, ids: Sequence[bytes], load: Callable[[list[bytes]], dict[bytes, Stored]]
    ) -> list[dict[str, Any] | None]:
        """Decoded entities in the order asked (None where missing); an id asked
        twice gives two separate dicts."""
        if current() is None:
            found = self.read_entities(ids, load)
            return [codec.decode(found[i].body) if i in found else None for i in ids]
        decoded = self.decoded(ids, load)
        out: list[dict[str, Any] | None] = []
        seen: set[bytes] = set()
        for i in ids:
            entity = decoded.get(i)
            if entity is not None and i in seen:
                entity = copy_entity(entity)
            seen.add(i)
            out.append(entity)
        return out

    def get(
        self, entity_id: bytes, load: Callable[[list[bytes]], dict[bytes, Stored]]
    ) -> dict[str, Any] | None:
        """One decoded entity (level 1 first: a hit is a lookup and a copy)."""
        rc = _current.get()
        if rc is not None:
            entry = rc.entities.get(self._ekey + entity_id.hex())
            if entry is not None:
                self.stats.l1.hit()
                return entity_copy(entry, codec.decode) if entry[0] is not None else None
        return self.decoded([entity_id], load).get(entity_id)

    def _read_l2(
        self,
        ids: list[bytes],
        load: Callable[[list[bytes]], dict[bytes, Stored]],
        prefetched: Mapping[str, Any] | None = None,
    ) -> dict[bytes, Stored]:
        assert self.cache is not None
        state = self._state()
        if state is None or state.phase != "ok":  # level 2 not trusted now
            self.stats.l2.add(misses=len(ids))
            return load(ids)
        ekey = self._kp(state.token) + "e:"
        skip = self._bypassed()
        by_key = {ekey + i.hex(): i for i in ids}
        asked = [k for k in by_key if k not in skip]
        had = {k: prefetched[k] for k in asked if k in prefetched} if prefetched else {}
        rest = [k for k in asked if k not in had] if had else asked
        got = self._l2("get", self.cache.get_many, rest) if rest else {}
        if isinstance(got, _Failed):
            self.stats.l2.add(misses=len(ids))
            return load(ids)
        if had:
            got = {**had, **got}
        out: dict[bytes, Stored] = {}
        need: list[bytes] = []
        replace: dict[str, tuple[Any, int]] = {}  # key -> (cas token, lowest version)
        for key, entity_id in by_key.items():
            item = got.get(key)
            if item is None:
                need.append(entity_id)
                continue
            value = decode_value(entity_id, item[0])
            if isinstance(value, Stored):
                out[entity_id] = value
                continue
            need.append(entity_id)
            # a marker: fill only with its version or newer; garbage: any version
            replace[key] = (item[1], value.version if isinstance(value, Marker) else 0)
        self.stats.l2.add(hits=len(out), misses=len(need))
        if not need:
            return out
        loaded = load(need)
        out.update(loaded)
        if self.before_fill is not None:
            self.before_fill("entities", need)
        adds: dict[str, bytes] = {}
        swaps: list[tuple[str, Any, bytes]] = []
        for entity_id in need:
            stored = loaded.get(entity_id)
            key = ekey + entity_id.hex()
            if stored is None or key in skip or len(stored.body) > MAX_VALUE:
                continue
            if key in replace:
                token, lowest = replace[key]
                if stored.version >= lowest:
                    swaps.append((key, token, encode_entity(entity_id, stored)))
            else:
                adds[key] = encode_entity(entity_id, stored)
        fills = 0
        if adds and not isinstance(self._l2("fill", self.cache.add_many, adds, self.ttl), _Failed):
            fills += len(adds)
        for key, token, entry in swaps:
            if self._l2("fill", self.cache.cas, key, token, entry, self.ttl) is True:
                fills += 1
        self.stats.l2.add(fills=fills)
        return out

    # -- writes ----------------------------------------------------------------------
    def idle(self) -> bool:
        """Whether a write has nothing to tell this layer: no shared level and
        no request's level 1 open (its bookkeeping after a commit does nothing)."""
        return self.cache is None and _current.get() is None

    def before_write(self, ids: Sequence[bytes]) -> None:
        """Before a write: lease the entities' keys with markers no version can
        replace, so that a writer dying between its commit and its invalidation
        leaves readers going to the database (until the marker's TTL), never an
        old entity cached."""
        if self.cache is not None and ids:
            state = self._state()
            ekey = self._kp(state.token if state is not None else None) + "e:"
            leases = {ekey + i.hex(): encode_marker(LEASE) for i in ids}
            self._l2("lease", self.cache.set_many, leases, self.marker_ttl)

    def puts_committed(
        self,
        rows: Sequence[EntityRow],
        versions: Mapping[bytes, int],
        reread: Callable[[list[bytes]], dict[bytes, Stored]],
    ) -> None:
        """Entity rows were committed: level 1 takes them, level 2 gets markers.

        ``versions`` holds each row's new version where the write read it;
        the others are read back (a version read after the commit is the
        write's own or a later one, which is as good for a marker).
        """
        if self.idle():
            return  # no level to tell (after_write would do nothing)
        known = dict(versions)
        if self.cache is not None:
            missing = [r.id for r in rows if r.id not in known]
            if missing:
                known.update({i: s.version for i, s in reread(missing).items()})
        self.after_write({r.id: Stored(r.body, known.get(r.id, 1), r.updated) for r in rows}, {})

    def deletes_committed(self, versions: Mapping[bytes, int]) -> None:
        """Entities were deleted (``{id: deleted version}``): "gone" markers."""
        self.after_write({}, {i: v + 1 for i, v in versions.items()})

    def rows_written(
        self, changes: Sequence[Change], claims: Sequence[Claim], registry: Registry
    ) -> None:
        """Index rows were written: bump the revisions of the scopes they touch."""
        if self.idle():
            return
        unready = [t for t, (_, state) in registry.by_table.items() if state != READY]
        self.after_write({}, {}, changes, claims, unready)

    def rows_repaired(self, index: Index, rows: Sequence[IndexRow], registry: Registry) -> None:
        """The Cleaner wrote or removed rows of a ``ready`` index: bump their scopes
        (pages of indexes not ready are never cached, so a backfill costs nothing)."""
        if rows and registry.state(index.table) == READY:
            self.after_write({}, {}, [Change(index, set(), set(rows))])

    def after_write(
        self,
        puts: Mapping[bytes, Stored],
        deletes: Mapping[bytes, int],
        changes: Sequence[Change] = (),
        claims: Sequence[Claim] = (),
        unready: Sequence[str] = (),
    ) -> None:
        """Invalidate after a commit (called after the write committed; for
        ``changes``, after the index rows were written).

        ``puts``: the new row of each entity written; ``deletes``: each deleted
        id with its deleted version + 1; ``changes``: the index rows deleted and
        inserted; ``claims``: unique rows newly claimed (inserted before the
        entity); ``unready``: tables of registered indexes not ``ready``.
        """
        rc = current()
        if rc is not None:
            for i, stored in puts.items():
                rc.put_entity(self._ekey + i.hex(), stored)
            for i in deletes:
                rc.put_entity(self._ekey + i.hex(), None)
            self.stats.l1.add(invalidations=len(puts) + len(deletes) + len(rc.lists))
            rc.lists.clear()
        if self.cache is None:
            return
        # The token is read after the commit: see bagstore.cache.shared for why
        # that makes these invalidations land where every trusting reader looks.
        state = self._state()
        token = state.token if state is not None else None
        kp = self._kp(token)
        markers = {kp + "e:" + i.hex(): encode_marker(s.version) for i, s in puts.items()}
        for i, floor in deletes.items():
            markers[kp + "e:" + i.hex()] = encode_marker(floor, gone=True)
        bumps: set[str] = {self.epoch_key(t, kp) for t in unready}
        for ch in changes:
            if ch.delete or ch.insert:
                bumps |= self.row_scope_keys(ch.index, [*ch.delete, *ch.insert], kp)
        by_index: dict[str, tuple[Index, list[IndexRow]]] = {}
        for c in claims:
            by_index.setdefault(c.index.table, (c.index, []))[1].append(c.row)
        for index, rows in by_index.values():
            bumps |= self.row_scope_keys(index, rows, kp)
        if markers or bumps:
            self._invalidate(state, markers, sorted(bumps))

    def _invalidate(self, state: State | None, markers: dict[str, bytes], bumps: list[str]) -> None:
        """Send markers and revision bumps; if they are not all confirmed (or no
        fresh shared state was known), remember them for retry, turn the shared
        state ``suspect`` and wait as :meth:`Shared.unconfirmed` says."""
        assert self.cache is not None
        shared = self._shared
        if shared.pending and time.monotonic() >= shared.retry_at:
            self.retry_pending()
        lost: dict[str, bytes | None] = {}
        if markers:
            failed = self._l2("invalidate", self.cache.set_many, markers, self.marker_ttl)
            if isinstance(failed, _Failed):
                lost.update(markers)
            elif failed:
                self._error("invalidate", f"{len(failed)} keys not stored")
                lost.update({k: markers[k] for k in failed})
        if bumps and isinstance(
            self._l2("bump", self.cache.bump, bumps, _now_us(), self.revision_ttl), _Failed
        ):
            lost.update(dict.fromkeys(bumps))
        self.stats.l2.add(invalidations=len(markers) + len(bumps))
        if lost:
            shared.remember(lost)
        if lost or state is None:
            until = shared.unconfirmed(self._cell, state.token if state is not None else None)
            delay = until - time.monotonic()
            if delay > 0:
                log.debug("cache: invalidation not confirmed; holding the write %.3f s", delay)
                time.sleep(delay)

    def index_changed(self, table: str) -> None:
        """An index was registered, dropped or changed state: forget its pages."""
        if self.cache is not None:
            state = self._state()
            kp = self._kp(state.token if state is not None else None)
            self._invalidate(state, {}, [self.epoch_key(table, kp)])
        rc = current()
        if rc is not None:
            rc.lists.clear()

    # -- status and lifetime -----------------------------------------------------------
    def status(self) -> dict[str, Any]:
        with self._shared.lock:
            pending = len(self._shared.pending)
        snap = self._shared.snapshot
        return {
            "backend": self.cache.name if self.cache is not None else None,
            "prefix": self.prefix,
            "pending_invalidations": pending,
            "shared_state": snap[0].phase if snap is not None else "unknown",
            **self.stats.as_dict(),
        }

    def close(self) -> None:
        if self.cache is not None and self._owns_cache:
            self.cache.close()


def _decade(n: int) -> bool:
    """True for 1, 10, 100, ... (when to log the error counter)."""
    while n >= 10 and n % 10 == 0:
        n //= 10
    return n == 1


def _servers_of(cache: Cache | None) -> str:
    """What names a cache server set in this process: the client's class and its
    servers (memcached: in any order), else its name."""
    if cache is None:
        return "none"
    kind = f"{type(cache).__module__}.{type(cache).__qualname__}"
    servers = getattr(cache, "servers", None)
    if isinstance(servers, list):
        return f"{kind} {sorted(map(str, servers))}"
    return f"{kind} {cache.name}"
