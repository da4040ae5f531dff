"""Query pages in level 2: cached as id lists under the revisions of their scopes.

A page is cached as its entity ids (plus the next cursor) under a key that
carries the revisions of the query's *scopes*: its ``shard_on`` value(s) (one
scope per ``__in`` value), narrowed to the pair (``shard_on`` value,
``isolate_key`` value) when the index declares an ``isolate_key`` and the query
gives it by equality, or the whole index when the query gives no ``shard_on``
value.  Each index also has an *epoch* revision in every page key.  After its
index rows are written, a writer bumps, for every index whose rows changed, the
revisions of the scopes of the rows it deleted and inserted and the index-wide
one; an old page becomes unreachable.  A reader reads the revisions *before* it
runs the query, so a page stored late is stored under the old revisions.  Pages
are read back through the entity cache and re-checked against the query; any
mismatch is a miss.  Only ``ready`` indexes are cached (a write while an index
is building or retired bumps its epoch).

:class:`PageReads` is a part of :class:`bagstore.cache.layer.CacheLayer`; every
key of one read is made with one key prefix (``kp``: the datastore's prefix and
the shared state's token, see :mod:`bagstore.cache.shared`).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from bagstore import codec, keys
from bagstore.cache.base import decode_list, encode_list, entity_body
from bagstore.cache.request import current
from bagstore.query import QueryResult

if TYPE_CHECKING:
    from bagstore.backends.base import Stored
    from bagstore.backends.indexsql import IndexRow
    from bagstore.cache.base import Cache, CacheStats
    from bagstore.cache.shared import State
    from bagstore.index import Index
    from bagstore.query import Plan

__all__ = ["MAX_PREFETCH", "MAX_SCOPES", "PageReads"]

T = TypeVar("T")

#: Values above this many bytes are not cached (memcached's item limit is 1 MiB).
MAX_VALUE = 1_000_000
#: A cached page of at most this many ids is read with its entities in one multi-get.
MAX_PREFETCH = 100
#: A query over more scopes than this uses the index-wide revision instead.
MAX_SCOPES = 64
#: At most this many queries' last pages are remembered.
MAX_MEMO = 10_000


class _Failed:
    """What a guarded level-2 call returns after a client error."""


_FAILED = _Failed()


class _Seen:
    """What this process last saw of one query's page: the revisions it was
    found under and its ids, with the keys worked out once (the scopes' revision
    keys, the page's key, and ``ask``: all of them and the entities' keys, the
    multi-get of the next read), all under the key prefix ``kp``."""

    __slots__ = ("ask", "ids", "kp", "page_key", "revs", "scopes")

    def __init__(
        self,
        layer: PageReads,
        kp: str,
        base: str,
        scopes: list[str],
        revs: tuple[int, ...],
        ids: tuple[bytes, ...],
    ) -> None:
        self.kp, self.scopes, self.revs, self.ids = kp, scopes, revs, ids
        self.page_key = layer._hashed("l", base.encode(), *_rev_bytes(revs), kp=kp)
        self.ask = [*scopes, self.page_key, *(kp + "e:" + i.hex() for i in ids)]


class PageReads:
    """Query pages (a part of the caching layer)."""

    if TYPE_CHECKING:
        cache: Cache | None
        prefix: str
        stats: CacheStats
        list_ttl: int
        revision_ttl: int
        before_fill: Callable[[str, list[Any]], None] | None
        _lock: threading.Lock

        def _l2(self, what: str, fn: Callable[..., T], *args: Any) -> T | _Failed: ...
        def _hashed(self, tag: str, *parts: bytes, kp: str | None = None) -> str: ...
        def _kp(self, token: str | None = None) -> str: ...
        def _state(self) -> State | None: ...
        def _bypassed(self) -> frozenset[str]: ...
        def decoded(
            self,
            ids: Sequence[bytes],
            load: Callable[[list[bytes]], dict[bytes, Stored]],
            prefetched: Mapping[str, Any] | None = None,
        ) -> dict[bytes, dict[str, Any]]: ...

    #: query -> what this process last saw of its page (see :class:`_Seen`)
    _memo: OrderedDict[str, _Seen]

    # -- revision keys ---------------------------------------------------------------
    def epoch_key(self, table: str, kp: str | None = None) -> str:
        return self._hashed("r", b"epoch", table.encode(), kp=kp)

    def wide_key(self, table: str, kp: str | None = None) -> str:
        return self._hashed("r", b"index", table.encode(), kp=kp)

    def shard_scope_key(self, table: str, shard_value: bytes, kp: str | None = None) -> str:
        return self._hashed("r", b"shard", table.encode(), shard_value, kp=kp)

    def pair_scope_key(
        self, table: str, shard_value: bytes, isolate_value: bytes, kp: str | None = None
    ) -> str:
        return self._hashed("r", b"pair", table.encode(), shard_value, isolate_value, kp=kp)

    def scope_keys(self, plan: Plan, kp: str | None = None) -> list[str]:
        """The revision keys a page of this query depends on (its epoch last)."""
        kp = self._kp() if kp is None else kp
        index = plan.index
        eq = {f.prop: f for f in plan.eq}
        shard = eq.get(index.shard_on)
        scopes: list[str]
        if shard is None:
            scopes = [self.wide_key(index.table, kp)]
        else:
            values = _stored(shard.keys)
            iso = index.isolate_key
            if iso and iso != index.shard_on and iso in eq:
                iso_values = _stored(eq[iso].keys)
                scopes = [
                    self.pair_scope_key(index.table, s, i, kp) for s in values for i in iso_values
                ]
            else:
                scopes = [self.shard_scope_key(index.table, s, kp) for s in values]
            if len(scopes) > MAX_SCOPES:
                scopes = [self.wide_key(index.table, kp)]
        return [*scopes, self.epoch_key(index.table, kp)]

    def row_scope_keys(self, index: Index, rows: Iterable[IndexRow], kp: str) -> set[str]:
        """The revision keys a change of these rows must bump."""
        out = {self.wide_key(index.table, kp)}
        pos = index.properties.index(index.shard_on)
        iso = index.isolate_key
        iso_pos = index.properties.index(iso) if iso and iso != index.shard_on else None
        for row in rows:
            out.add(self.shard_scope_key(index.table, row.keys[pos], kp))
            if iso_pos is not None:
                out.add(self.pair_scope_key(index.table, row.keys[pos], row.keys[iso_pos], kp))
        return out

    # -- reads -----------------------------------------------------------------------
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
        state = self._state()
        if state is None or state.phase != "ok":  # level 2 not trusted now
            self.stats.l2.add(misses=1)
            return run()
        kp = self._kp(state.token)
        with self._lock:
            seen = self._memo.get(base)
        if seen is not None and seen.kp != kp:
            seen = None
        scope_keys = seen.scopes if seen is not None else self.scope_keys(plan, kp)
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
                hit = self._page_hit(plan, kp, key, item[0], guess_ids, got)
                if hit is not None:
                    return hit
        else:
            key = self._remember_page(kp, base, scope_keys, current_revs, ()).page_key
            more = self._l2("get", self.cache.get_many, [key])
            item = more.get(key) if isinstance(more, dict) else None
        if item is not None:
            page = decode_list(key, item[0])
            if page is not None:
                result = _rebuild(plan, page[0], page[1], lambda ids: self.decoded(ids, load, got))
                if result is not None:
                    if current_revs != guess or tuple(page[0]) != guess_ids:
                        self._remember_page(kp, base, scope_keys, current_revs, page[0])
                    self.stats.l2.add(hits=1)
                    return result
        self.stats.l2.add(misses=1)
        result = run()
        ids = _ids_of(result)
        if self.before_fill is not None:
            self.before_fill("list", [key])
        if ids is not None:
            self._remember_page(kp, base, scope_keys, current_revs, ids)
        value = encode_list(key, ids, result.cursor) if ids is not None else None
        if value is not None and len(value) <= MAX_VALUE:
            fill = self.cache.set_many if item is not None else self.cache.add_many
            if not isinstance(self._l2("fill", fill, {key: value}, self.list_ttl), _Failed):
                self.stats.l2.add(fills=1)
        return result

    def _page_hit(
        self,
        plan: Plan,
        kp: str,
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
        ekey, filters, out = kp + "e:", plan.filters, []
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
        self, kp: str, base: str, scopes: list[str], revs: tuple[int, ...], ids: Sequence[bytes]
    ) -> _Seen:
        """Remember the revisions a query's page was last found under, and its ids
        when there are few (to ask for them with the next read of that page)."""
        ids = tuple(ids) if len(ids) <= MAX_PREFETCH else ()
        seen = _Seen(self, kp, base, scopes, revs, ids)
        with self._lock:
            self._memo[base] = seen
            self._memo.move_to_end(base)
            if len(self._memo) > MAX_MEMO:
                self._memo.popitem(last=False)
        return seen


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


def _now_us() -> int:
    return time.time_ns() // 1000
