"""The caching logic the datastore calls: entities by id, query pages by revision.

Keys (``P`` is the datastore's prefix: store id and kind by default)::

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

**Query pages.**  A page is cached as its entity ids (plus the next cursor)
under a key that carries the revisions of the query's *scopes*: its
``shard_on`` value(s) (one scope per ``__in`` value), narrowed to the pair
(``shard_on`` value, ``isolate_key`` value) when the index declares an
``isolate_key`` and the query gives it by equality, or the whole index when the
query gives no ``shard_on`` value.  Each index also has an *epoch* revision in
every page key.  After its index rows are written, a writer bumps, for every
index whose rows changed, the revisions of the scopes of the rows it deleted and
inserted and the index-wide one; an old page becomes unreachable.  A reader reads
the revisions *before* it runs the query, so a page stored late is stored under
the old revisions.  Pages are read back through the entity cache and re-checked
against the query; any mismatch is a miss.  Only ``ready`` indexes are cached
(a write while an index is building or retired bumps its epoch).

**Failures.**  Every level-2 call is guarded: the client's errors are counted,
logged (at the 1st, 10th, 100th... error) and answered from the database.  A
marker or bump that failed is kept and retried (at most twice a second); until
it lands this process reads those keys from the database only.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from hashlib import blake2b
from typing import TYPE_CHECKING, Any, TypeVar

from bagstore import codec, keys
from bagstore.backends.base import Stored
from bagstore.cache.base import (
    Cache,
    CacheStats,
    Marker,
    decode_list,
    decode_value,
    encode_entity,
    encode_list,
    encode_marker,
    entity_body,
)
from bagstore.cache.request import _current, copy_entity, current, entity_copy
from bagstore.index import READY
from bagstore.indexer import Change
from bagstore.query import QueryResult

if TYPE_CHECKING:
    from bagstore.backends.base import EntityRow
    from bagstore.backends.indexsql import IndexRow
    from bagstore.index import Index, Registry
    from bagstore.indexer import Claim
    from bagstore.query import Plan

__all__ = ["CacheLayer"]

log = logging.getLogger("bagstore.cache")

T = TypeVar("T")

#: Values above this many bytes are not cached (memcached's item limit is 1 MiB).
MAX_VALUE = 1_000_000
#: A cached page of at most this many ids is read with its entities in one multi-get.
MAX_PREFETCH = 100
#: A query over more scopes than this uses the index-wide revision instead.
MAX_SCOPES = 64
#: At most this many failed invalidations are remembered for retry.
MAX_PENDING = 10_000
RETRY_INTERVAL = 0.5
#: The version of a writer's lease taken before its commit: no fill replaces it.
LEASE = 2**63 - 1


class _Failed:
    """What a guarded level-2 call returns after a client error."""


class _Seen:
    """What this process last saw of one query's page: the revisions it was
    found under and its ids, with the keys worked out once (the scopes' revision
    keys, the page's key, and ``ask``: all of them and the entities' keys, the
    multi-get of the next read)."""

    __slots__ = ("ask", "ids", "page_key", "revs", "scopes")

    def __init__(
        self,
        layer: CacheLayer,
        base: str,
        scopes: list[str],
        revs: tuple[int, ...],
        ids: tuple[bytes, ...],
    ) -> None:
        self.scopes, self.revs, self.ids = scopes, revs, ids
        self.page_key = layer._hashed("l", base.encode(), *_rev_bytes(revs))
        self.ask = [*scopes, self.page_key, *(layer.entity_key(i) for i in ids)]


_FAILED = _Failed()
_NO_ENTITY: list[Any] = [None]


class CacheLayer:
    """Level 1 and level 2 for one datastore (one store, one kind).

    ``cache`` is the level-2 client, or None for level 1 only.  ``before_fill``
    is a test hook: called as ``before_fill(what, keys)`` after a reader's
    database read and before its cache fill (``what`` is ``"entities"`` or
    ``"list"``), to force the read-fill race.
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
        self._pending: OrderedDict[str, bytes | None] = OrderedDict()
        self._retry_at = 0.0
        #: query -> what this process last saw of its page (see :class:`_Seen`)
        self._memo: OrderedDict[str, _Seen] = OrderedDict()

    # -- keys ------------------------------------------------------------------------
    def entity_key(self, entity_id: bytes) -> str:
        return self._ekey + entity_id.hex()

    def _hashed(self, tag: str, *parts: bytes) -> str:
        h = blake2b(digest_size=12)
        for p in parts:
            h.update(len(p).to_bytes(4, "big"))
            h.update(p)
        return f"{self.prefix}{tag}:{h.hexdigest()}"

    def epoch_key(self, table: str) -> str:
        return self._hashed("r", b"epoch", table.encode())

    def wide_key(self, table: str) -> str:
        return self._hashed("r", b"index", table.encode())

    def shard_scope_key(self, table: str, shard_value: bytes) -> str:
        return self._hashed("r", b"shard", table.encode(), shard_value)

    def pair_scope_key(self, table: str, shard_value: bytes, isolate_value: bytes) -> str:
        return self._hashed("r", b"pair", table.encode(), shard_value, isolate_value)

    def scope_keys(self, plan: Plan) -> list[str]:
        """The revision keys a page of this query depends on (its epoch last)."""
        index = plan.index
        eq = {f.prop: f for f in plan.eq}
        shard = eq.get(index.shard_on)
        scopes: list[str]
        if shard is None:
            scopes = [self.wide_key(index.table)]
        else:
            values = _stored(shard.keys)
            iso = index.isolate_key
            if iso and iso != index.shard_on and iso in eq:
                iso_values = _stored(eq[iso].keys)
                scopes = [
                    self.pair_scope_key(index.table, s, i) for s in values for i in iso_values
                ]
            else:
                scopes = [self.shard_scope_key(index.table, s) for s in values]
            if len(scopes) > MAX_SCOPES:
                scopes = [self.wide_key(index.table)]
        return [*scopes, self.epoch_key(index.table)]

    def row_scope_keys(self, index: Index, rows: Iterable[IndexRow]) -> set[str]:
        """The revision keys a change of these rows must bump."""
        out = {self.wide_key(index.table)}
        pos = index.properties.index(index.shard_on)
        iso = index.isolate_key
        iso_pos = index.properties.index(iso) if iso and iso != index.shard_on else None
        for row in rows:
            out.add(self.shard_scope_key(index.table, row.keys[pos]))
            if iso_pos is not None:
                out.add(self.pair_scope_key(index.table, row.keys[pos], row.keys[iso_pos]))
        return out

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
        """Keys whose invalidation has not landed yet (read from the database only)."""
        if not self._pending:
            return frozenset()
        if time.monotonic() >= self._retry_at:
            self.retry_pending()
        with self._lock:
            return frozenset(self._pending)

    def retry_pending(self) -> int:
        """Send the invalidations that failed again; return how many are left."""
        if self.cache is None:
            return 0
        with self._lock:
            self._retry_at = time.monotonic() + RETRY_INTERVAL
            items = list(self._pending.items())
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
        with self._lock:
            for k in done:
                if k in self._pending and self._pending[k] == snapshot[k]:
                    del self._pending[k]
            return len(self._pending)

    def _remember(self, items: Mapping[str, bytes | None]) -> None:
        with self._lock:
            for k, v in items.items():
                self._pending[k] = v
                self._pending.move_to_end(k)
            while len(self._pending) > MAX_PENDING:
                dropped, _ = self._pending.popitem(last=False)
                log.warning("cache: too many failed invalidations; forgetting %s", dropped)

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
        skip = self._bypassed()
        by_key = {self._ekey + i.hex(): i for i in ids}
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
            key = self._ekey + entity_id.hex()
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

    # -- query pages -----------------------------------------------------------------
    def read_list(
        self,
        plan: Plan,
        limit: object,
        cursor: object,
        run: Callable[[], QueryResult],
        load: Callable[[list[bytes]], dict[bytes, Stored]],
        *,
        cacheable: bool = True,
    ) -> QueryResult:
        """One page of a query: level 1, level 2 (under the scopes' revisions),
        else ``run()`` (whose ids are then cached).  ``load`` reads entities from
        the database; a cached page is rebuilt through the entity cache."""
        rc = current()
        if not cacheable or (rc is None and self.cache is None):
            return run()

        def fetch(ids: Sequence[bytes]) -> dict[bytes, dict[str, Any]]:
            return self.decoded(ids, load)

        base = f"{plan.fingerprint()}|{limit!r}|{cursor!r}"
        if rc is not None:
            page = rc.lists.get(self.prefix + base)
            if page is not None:
                result = _rebuild(plan, page[0], page[1], fetch)
                if result is not None:
                    self.stats.l1.add(hits=1)
                    return result
            self.stats.l1.add(misses=1)
        result = self._read_list_l2(plan, base, run, load) if self.cache is not None else run()
        if rc is not None:
            ids = _ids_of(result)
            if ids is not None:
                rc.lists[self.prefix + base] = (ids, result.cursor)
        return result

    def _read_list_l2(
        self,
        plan: Plan,
        base: str,
        run: Callable[[], QueryResult],
        load: Callable[[list[bytes]], dict[bytes, Stored]],
    ) -> QueryResult:
        assert self.cache is not None
        with self._lock:
            seen = self._memo.get(base)
        scope_keys = seen.scopes if seen is not None else self.scope_keys(plan)
        skip = self._bypassed()
        if skip and any(k in skip for k in scope_keys):
            self.stats.l2.add(misses=1)
            return run()
        # With the revisions this process saw last, ask for the page they name and
        # the entities that page held: a page that did not change is rebuilt from
        # this one multi-get (entities are still checked as any read checks them).
        guess, guess_ids, guess_key = (
            (seen.revs, seen.ids, seen.page_key) if seen is not None else (None, (), None)
        )
        got = self._l2("get", self.cache.get_many, seen.ask if seen is not None else scope_keys)
        if isinstance(got, _Failed):
            self.stats.l2.add(misses=1)
            return run()
        revs: list[int] = []
        missing: list[str] = []
        for k in scope_keys:
            rev = _parse_rev(got.get(k))
            if rev is None:
                missing.append(k)
            else:
                revs.append(rev)
        if missing:
            # first use (or evicted, or garbage): start the revisions, cache next time
            self._l2("bump", self.cache.bump, missing, _now_us(), self.revision_ttl)
            self.stats.l2.add(misses=1)
            return run()
        current_revs = tuple(revs)
        if current_revs == guess and guess_key is not None:
            key = guess_key
            item = got.get(key)
            if item is not None and not skip and current() is None:
                # the usual hit: the page this process saw last, its entities in hand
                hit = self._page_hit(plan, key, item[0], guess_ids, got)
                if hit is not None:
                    return hit
        else:
            key = self._remember_page(base, scope_keys, current_revs, ()).page_key
            more = self._l2("get", self.cache.get_many, [key])
            item = more.get(key) if isinstance(more, dict) else None
        if item is not None:
            page = decode_list(key, item[0])
            if page is not None:
                result = _rebuild(plan, page[0], page[1], lambda ids: self.decoded(ids, load, got))
                if result is not None:
                    if current_revs != guess or tuple(page[0]) != guess_ids:
                        self._remember_page(base, scope_keys, current_revs, page[0])
                    self.stats.l2.add(hits=1)
                    return result
        self.stats.l2.add(misses=1)
        result = run()
        ids = _ids_of(result)
        if self.before_fill is not None:
            self.before_fill("list", [key])
        if ids is not None:
            self._remember_page(base, scope_keys, current_revs, ids)
        value = encode_list(key, ids, result.cursor) if ids is not None else None
        if value is not None and len(value) <= MAX_VALUE:
            fill = self.cache.set_many if item is not None else self.cache.add_many
            if not isinstance(self._l2("fill", fill, {key: value}, self.list_ttl), _Failed):
                self.stats.l2.add(fills=1)
        return result

    def _page_hit(
        self,
        plan: Plan,
        key: str,
        value: bytes,
        ids: tuple[bytes, ...],
        got: Mapping[str, tuple[bytes, Any]],
    ) -> QueryResult | None:
        """The page in ``value`` if it holds ``ids``, each entity's entry is in
        ``got`` and still matches the query; None for anything else (the
        general path then decides)."""
        page = decode_list(key, value)
        if page is None or tuple(page[0]) != ids:
            return None
        ekey, filters, out = self._ekey, plan.filters, []
        for i in ids:
            item = got.get(ekey + i.hex())
            body = entity_body(i, item[0]) if item is not None else None
            if body is None:
                return None
            entity = codec.decode(body, checksum=False)  # entity_body checked these bytes
            for f in filters:
                if not f.matches(entity):
                    return None
            out.append(entity)
        self.stats.l2.add(hits=len(ids) + 1)
        return QueryResult(out, page[1])

    def _remember_page(
        self, base: str, scopes: list[str], revs: tuple[int, ...], ids: Sequence[bytes]
    ) -> _Seen:
        """Remember the revisions a query's page was last found under, and its ids
        when there are few (to ask for them with the next read of that page)."""
        seen = _Seen(self, base, scopes, revs, tuple(ids) if len(ids) <= MAX_PREFETCH else ())
        with self._lock:
            self._memo[base] = seen
            self._memo.move_to_end(base)
            if len(self._memo) > MAX_PENDING:
                self._memo.popitem(last=False)
        return seen

    # -- writes ----------------------------------------------------------------------
    def before_write(self, ids: Sequence[bytes]) -> None:
        """Before a write: lease the entities' keys with markers no version can
        replace, so that a writer dying between its commit and its invalidation
        leaves readers going to the database (until the marker's TTL), never an
        old entity cached."""
        if self.cache is not None and ids:
            leases = {self._ekey + i.hex(): encode_marker(LEASE) for i in ids}
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
        markers = {self._ekey + i.hex(): encode_marker(s.version) for i, s in puts.items()}
        for i, floor in deletes.items():
            markers[self._ekey + i.hex()] = encode_marker(floor, gone=True)
        bumps: set[str] = {self.epoch_key(t) for t in unready}
        for ch in changes:
            if ch.delete or ch.insert:
                bumps |= self.row_scope_keys(ch.index, [*ch.delete, *ch.insert])
        by_index: dict[str, tuple[Index, list[IndexRow]]] = {}
        for c in claims:
            by_index.setdefault(c.index.table, (c.index, []))[1].append(c.row)
        for index, rows in by_index.values():
            bumps |= self.row_scope_keys(index, rows)
        if not markers and not bumps:
            return
        if self._pending and time.monotonic() >= self._retry_at:
            self.retry_pending()
        lost: dict[str, bytes | None] = {}
        if markers:
            failed = self._l2("invalidate", self.cache.set_many, markers, self.marker_ttl)
            if isinstance(failed, _Failed):
                lost.update(markers)
            elif failed:
                self._error("invalidate", f"{len(failed)} keys not stored")
                lost.update({k: markers[k] for k in failed})
        ordered = sorted(bumps)
        if ordered and isinstance(
            self._l2("bump", self.cache.bump, ordered, _now_us(), self.revision_ttl), _Failed
        ):
            lost.update(dict.fromkeys(ordered))
        if lost:
            self._remember(lost)
        self.stats.l2.add(invalidations=len(markers) + len(ordered))

    def index_changed(self, table: str) -> None:
        """An index was registered, dropped or changed state: forget its pages."""
        if self.cache is not None:
            key = self.epoch_key(table)
            if isinstance(
                self._l2("bump", self.cache.bump, [key], _now_us(), self.revision_ttl), _Failed
            ):
                self._remember({key: None})
        rc = current()
        if rc is not None:
            rc.lists.clear()

    # -- status and lifetime -----------------------------------------------------------
    def status(self) -> dict[str, Any]:
        with self._lock:
            pending = len(self._pending)
        return {
            "backend": self.cache.name if self.cache is not None else None,
            "prefix": self.prefix,
            "pending_invalidations": pending,
            **self.stats.as_dict(),
        }

    def close(self) -> None:
        if self.cache is not None and self._owns_cache:
            self.cache.close()


def _ids_of(result: Sequence[Mapping[str, Any]]) -> list[bytes] | None:
    """The ids of a page's entities (None if one lacks a proper id: not cached)."""
    ids = [e.get("id") for e in result]
    if all(type(i) is bytes and len(i) == 16 for i in ids):
        return ids  # type: ignore[return-value]
    return None


def _stored(full_keys: Iterable[bytes]) -> list[bytes]:
    """Index keys as the index rows store them (cut to the key limit), unique."""
    return list(dict.fromkeys(keys.truncate(k)[0] for k in full_keys))


def _parse_rev(item: tuple[bytes, Any] | None) -> int | None:
    if item is None:
        return None
    try:
        value = int(item[0])
    except ValueError:
        return None
    return value if value > 0 else None


def _rev_bytes(revs: Iterable[int] | None) -> list[bytes]:
    return [str(r).encode() for r in revs or ()]


def _rebuild(
    plan: Plan,
    ids: Sequence[bytes],
    cursor: str | None,
    fetch: Callable[[Sequence[bytes]], dict[bytes, dict[str, Any]]],
) -> QueryResult | None:
    """The page from its ids, or None if an entity is gone or no longer matches."""
    entities = fetch(ids) if ids else {}
    out = []
    for i in ids:
        entity = entities.get(i)
        if entity is None or not all(f.matches(entity) for f in plan.filters):
            return None
        out.append(entity)
    return QueryResult(out, cursor)


def _decade(n: int) -> bool:
    """True for 1, 10, 100, ... (when to log the error counter)."""
    while n >= 10 and n % 10 == 0:
        n //= 10
    return n == 1


def _now_us() -> int:
    return time.time_ns() // 1000
