"""Queries: filters and lookups, planning onto an index, keyset cursors, re-checks.

Filters use Django's lookups: ``prop`` (equality), ``prop__in``, ``prop__gt``,
``__gte``, ``__lt``, ``__lte``.  An index answers a query when the filters give
equality (or ``__in``) on a prefix of its properties and at most a range on the
next one.  Results come in index order of the properties after that prefix, then
entity id; the same order on every shard, so a query over several shards is a
k-way merge of their sorted scans.

Every entity fetched through an index is re-checked against the whole query, and
the index row itself against the entity (a row whose values the entity no longer
has is stale and skipped): a stale row costs a lookup, never a wrong answer.
Comparisons use :mod:`bagstore.keys`, so they agree with the index exactly.
"""

from __future__ import annotations

import base64
import binascii
import heapq
import itertools
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from hashlib import blake2b
from typing import TYPE_CHECKING, Any, Protocol

from bagstore import codec, keys
from bagstore.backends.scansql import Scan
from bagstore.errors import InvalidQuery
from bagstore.sharding.hashing import bucket_of

if TYPE_CHECKING:
    from bagstore.backends import Backend
    from bagstore.index import Index

__all__ = ["Filter", "Plan", "QueryResult", "parse_filters", "plan_query"]

LOOKUPS = {"eq", "in", "gt", "gte", "lt", "lte"}
MAX_LIMIT = 10_000
#: A query without ``limit`` returns at most this many entities (more: InvalidQuery).
MAX_UNLIMITED = 100_000
MAX_IN = 1_000


class QueryResult(list[dict[str, Any]]):
    """A page of entities; ``cursor`` continues after it (None after the last page)."""

    cursor: str | None

    def __init__(self, items: Sequence[dict[str, Any]] = (), cursor: str | None = None) -> None:
        super().__init__(items)
        self.cursor = cursor


#: Exact types whose Python comparisons agree with their index encodings (str
#: by code point, as UTF-8 bytes compare; bytes bytewise; int numerically), so
#: that a filter on values of one of them re-checks an entity's value of the
#: same type without encoding it.
_PLAIN = (str, bytes, int)


@dataclass(frozen=True)
class Filter:
    """One parsed filter: ``prop``, a lookup, the value(s) and their full keys.

    ``plain`` is the one exact type of every value when it is str, bytes or
    int (else None), and ``values`` those values: the re-check's shortcut.
    """

    prop: str
    op: str
    value: Any
    keys: tuple[bytes, ...]
    plain: type | None = field(default=None, compare=False)
    values: frozenset[Any] = field(default=frozenset(), compare=False)

    def matches(self, entity: Mapping[str, Any]) -> bool:
        """Whether any of the entity's values for ``prop`` satisfies the filter."""
        v = entity.get(self.prop)
        if type(v) is self.plain:  # same exact type: Python decides as the keys would
            op = self.op
            if op == "eq" or op == "in":
                return v in self.values
            w = self.value
            if op == "gt":
                return bool(v > w)
            if op == "gte":
                return bool(v >= w)
            return bool(v < w) if op == "lt" else bool(v <= w)
        return self._matches_keys(v)

    def matcher(self) -> Callable[[Mapping[str, Any]], bool]:
        """:meth:`matches` as a function, without its attribute look-ups when
        the filter is equality (or ``__in``) on values of one plain type: the
        re-check of every entity a query reads."""
        if self.plain is None or self.op not in ("eq", "in"):
            return self.matches
        prop, plain, values, by_keys = self.prop, self.plain, self.values, self._matches_keys

        def matches(entity: Mapping[str, Any]) -> bool:
            v = entity.get(prop)
            return v in values if type(v) is plain else by_keys(v)

        return matches

    def _matches_keys(self, v: object) -> bool:
        op = self.op
        for k in keys.index_keys(v):
            if op in ("eq", "in"):
                if k in self.keys:
                    return True
            elif (
                (op == "gt" and k > self.keys[0])
                or (op == "gte" and k >= self.keys[0])
                or (op == "lt" and k < self.keys[0])
                or (op == "lte" and k <= self.keys[0])
            ) and k[0] == self.keys[0][0]:
                return True
        return False


def parse_filters(filters: Mapping[str, Any]) -> list[Filter]:
    """Parse ``{"published__gte": t, ...}``; unknown lookups and bad values raise."""
    out: list[Filter] = []
    for name, value in filters.items():
        prop, sep, lookup = name.partition("__")
        op = lookup if sep else "eq"
        if op not in LOOKUPS or not prop or "__" in lookup:
            raise InvalidQuery(
                f"unknown lookup in filter {name!r}: use prop, prop__in, prop__gt, "
                "prop__gte, prop__lt or prop__lte"
            )
        if op == "in":
            if isinstance(value, (str, bytes)) or not isinstance(
                value, (list, tuple, set, frozenset)
            ):
                raise InvalidQuery(f"filter {name!r} takes a list of values")
            values = list(value)
            if len(values) > MAX_IN:
                raise InvalidQuery(f"filter {name!r}: at most {MAX_IN} values")
        else:
            values = [value]
        encoded: list[bytes] = []
        for v in values:
            if v is None:
                raise InvalidQuery(
                    f"filter {name!r}: None is never indexed (an entity without the "
                    "property has no index row)"
                )
            try:
                encoded.append(keys.encode_value(v))
            except keys.UnindexableValue as exc:
                raise InvalidQuery(f"filter {name!r}: {exc}") from None
        types = {type(v) for v in values}
        plain = types.pop() if len(types) == 1 else None
        out.append(
            Filter(
                prop,
                op,
                value,
                tuple(dict.fromkeys(encoded)),
                plain if plain in _PLAIN else None,
                frozenset(values) if plain in _PLAIN else frozenset(),
            )
        )
    return out


@dataclass
class Plan:
    """How one index answers one query."""

    index: Index
    filters: list[Filter]
    eq: list[Filter]  # one filter per leading property, in index order
    bounds: keys.Bounds | None  # on the next property (stored keys)
    desc: bool
    order_props: tuple[str, ...] = field(default=())

    @property
    def single_shard(self) -> bool:
        return self.index.properties.index(self.index.shard_on) < len(self.eq)

    def score(self) -> tuple[int, int, int]:
        """Higher is better: properties used, reads one shard, fewer columns."""
        used = len(self.eq) + (1 if self.bounds is not None else 0)
        return used, int(self.single_shard), -len(self.index.properties)

    def fingerprint(self) -> str:
        h = blake2b(digest_size=8)
        h.update(self.index.to_json().encode())
        for f in sorted(self.filters, key=lambda f: (f.prop, f.op)):
            h.update(f"{f.prop}|{f.op}|".encode() + b"|".join(f.keys) + b"\n")
        h.update(b"desc" if self.desc else b"asc")
        return h.hexdigest()


def _intersect(a: keys.Bounds | None, b: keys.Bounds) -> keys.Bounds:
    if a is None:
        return b
    if a.lower > b.lower or (a.lower == b.lower and not a.lower_inclusive):
        lower, lower_inc = a.lower, a.lower_inclusive
    else:
        lower, lower_inc = b.lower, b.lower_inclusive
    if a.upper < b.upper or (a.upper == b.upper and not a.upper_inclusive):
        upper, upper_inc = a.upper, a.upper_inclusive
    else:
        upper, upper_inc = b.upper, b.upper_inclusive
    return keys.Bounds(lower, lower_inc, upper, upper_inc)


def plan_query(index: Index, filters: list[Filter], order: str | None) -> Plan:
    """Fit the filters onto ``index``; raise InvalidQuery saying why it cannot."""
    by_prop: dict[str, list[Filter]] = {}
    for f in filters:
        by_prop.setdefault(f.prop, []).append(f)
    eq: list[Filter] = []
    bounds: keys.Bounds | None = None
    used: set[str] = set()
    for prop in index.properties:
        fs = by_prop.get(prop, [])
        if not fs:
            break
        equal = [f for f in fs if f.op in ("eq", "in")]
        if equal:
            # the fewest values to look up; the property's other filters are
            # re-checked on each entity, as every filter is
            eq.append(min(equal, key=lambda f: len(f.keys)))
            used.add(prop)
            continue
        lowers = [f for f in fs if f.op in ("gt", "gte")]
        uppers = [f for f in fs if f.op in ("lt", "lte")]
        if len(lowers) > 1 or len(uppers) > 1:
            raise InvalidQuery(f"property {prop!r}: at most one lower and one upper bound")
        for f in fs:
            bounds = _intersect(bounds, keys.range_bounds(f.op, f.value))
        if len(fs) == 2 and fs[0].keys[0][0] != fs[1].keys[0][0]:
            raise InvalidQuery(f"property {prop!r}: range bounds of different types")
        used.add(prop)
        break
    extra = [p for p in by_prop if p not in used]
    if extra:
        raise InvalidQuery(
            f"cannot filter on {extra} here: index {index.table!r} on "
            f"{list(index.properties)} answers equality (or __in) on a prefix of its "
            "properties, then a range on the next one"
        )
    order_props = index.properties[len(eq) :]
    desc = False
    if order is not None:
        if not isinstance(order, str):
            raise InvalidQuery(
                f"order must be a property name (with - for descending), not {order!r}"
            )
        desc = order.startswith("-")
        name = order[1:] if desc else order
        allowed = [f.prop for f in eq] + list(order_props[:1])
        if name not in allowed:
            raise InvalidQuery(
                f"index {index.table!r} cannot order by {name!r} for this query; "
                f"it orders by {list(order_props) or ['id']}"
            )
    return Plan(index, filters, eq, bounds, desc, tuple(order_props))


# -- cursors ---------------------------------------------------------------------
def encode_cursor(plan: Plan, position: Sequence[bytes]) -> str:
    doc = {"q": plan.fingerprint(), "a": [p.hex() for p in position]}
    return base64.urlsafe_b64encode(json.dumps(doc, separators=(",", ":")).encode()).decode()


def decode_cursor(plan: Plan, cursor: str) -> tuple[bytes, ...]:
    try:
        doc = json.loads(base64.urlsafe_b64decode(cursor.encode()))
        position = tuple(bytes.fromhex(p) for p in doc["a"])
        fingerprint = doc["q"]
    except (ValueError, KeyError, TypeError, AttributeError, binascii.Error):
        raise InvalidQuery("malformed cursor") from None
    if fingerprint != plan.fingerprint() or len(position) != len(plan.order_props) + 1:
        raise InvalidQuery("this cursor belongs to another query")
    return position


# -- execution -------------------------------------------------------------------
def shard_scans(
    plan: Plan,
    backends: Sequence[Backend],
    shard_of_bucket: Sequence[int],
    buckets: int,
    sole: int | None = None,
) -> dict[int, Scan]:
    """One scan per shard that may hold matching rows (``sole``: the shard that
    holds every bucket, when one does)."""
    index = plan.index
    limit = keys.KEY_LIMIT
    # The stored keys (cut to KEY_LIMIT) each leading column may equal, distinct.
    eq_keys = [list(dict.fromkeys([k[:limit] for k in f.keys])) for f in plan.eq]
    b = plan.bounds
    lower = None if b is None else (b.lower, b.lower_inclusive)
    upper = None if b is None else (b.upper, b.upper_inclusive)

    def scan(eq: list[list[bytes]]) -> Scan:
        return Scan(index.table, index.properties, eq, lower, upper, desc=plan.desc)

    if not plan.single_shard:
        return {i: scan([list(ks) for ks in eq_keys]) for i in range(len(backends))}
    pos = index.properties.index(index.shard_on)
    if sole is not None:  # no key to hash (none at all: an empty __in, no scan)
        return {sole: scan(eq_keys)} if eq_keys[pos] else {}
    per_shard: dict[int, list[bytes]] = {}
    for full in plan.eq[pos].keys:
        values = per_shard.setdefault(shard_of_bucket[bucket_of(full, buckets)], [])
        stored = full[:limit]
        if stored not in values:
            values.append(stored)
    out = {}
    for shard, values in per_shard.items():
        eq = [list(ks) for ks in eq_keys]
        eq[pos] = values
        out[shard] = scan(eq)
    return out


class _Stream:
    """One scan, fetched a page at a time from the keyset position: of one
    shard, or of several (``shards``) merged in one statement.

    ``next`` is the size of the next page to read: ``page``, except that the
    first page of a query over several streams can be smaller (see
    :func:`first_page`)."""

    def __init__(
        self,
        backend: Backend,
        scan: Scan,
        page: int,
        *,
        shards: int = 1,
        joined: tuple[int, ...] = (),
        reach: tuple[Backend, ...] = (),
        shard_of_bucket: Sequence[int] = (),
    ) -> None:
        self.backend, self.scan, self.page, self.shards = backend, scan, page, shards
        self.next = page
        self.rows: list[tuple[bytes, ...]] = []
        self.done = False
        # A scan joined with entity tables (``scan.join``): the shard of each
        # joined table, and where the bodies read with the rows go (id -> body,
        # only copies that the placement puts on the shard they were read from).
        self.joined, self.shard_of_bucket = joined, shard_of_bucket
        # The other shards whose tables the statement names: those of a merged
        # scan's parts first, then those only joined.
        self.reach = reach
        self.bodies: dict[bytes, bytes] = {}

    def fetch(self) -> None:
        self.accept(self.read())

    def read(self) -> list[tuple[Any, ...]]:
        """The next page's rows as the statement gives them (joined: with the
        ``which, bucket, body`` columns); :meth:`accept` takes them."""
        self.scan.limit = self.next
        return self.backend.scan_index(self.scan, self.reach)

    def accept(self, rows: list[tuple[Any, ...]]) -> None:
        """Take the next page of rows (read with ``scan.limit == next``)."""
        if self.joined:
            rows = self._keep_bodies(rows)
        self.rows = rows
        self.done = len(rows) < self.next
        self.next = self.page
        if rows:
            self.scan.after = rows[-1]

    def _keep_bodies(self, rows: list[tuple[Any, ...]]) -> list[tuple[bytes, ...]]:
        """Split joined rows: the index columns stay rows, the body of each row's
        entity goes to ``bodies`` if the joined copy is on the shard that the
        placement names (a copy elsewhere, left by a move, is not that one; the
        entity is then read by id)."""
        width = self.scan.order_width
        bodies, owner, joined = self.bodies, self.shard_of_bucket, self.joined
        last, at_bucket, at_body = width - 1, width + 1, width + 2
        for row in rows:
            which = row[width]
            if which is not None and owner[row[at_bucket]] == joined[which]:
                bodies[row[last]] = row[at_body]
        return [row[:width] for row in rows]

    def __iter__(self) -> Iterator[tuple[bytes, ...]]:
        while True:
            yield from self.rows
            self.rows = []
            if self.done:
                return
            self.fetch()

    def take(self, n: int) -> list[tuple[bytes, ...]]:
        """The next ``n`` rows (fewer at the end): ``islice(stream, n)``, without
        a generator; reads the next page only when a row is wanted from it."""
        out: list[tuple[bytes, ...]] = []
        while True:
            rows, need = self.rows, n - len(out)
            if len(rows) >= need:
                out += rows[:need]
                self.rows = rows[need:]
                return out
            out += rows
            self.rows = []
            if self.done:
                return out
            self.fetch()


def first_page(limit: int | None, shards: int, page: int, share: int = 1) -> int:
    """Rows to read first, for a page of ``limit``, from a stream that scans
    ``share`` of the ``shards`` a query reads.

    The rows of one page are usually spread over the shards, so each stream is
    asked for twice its even share (at least 10) rather than the whole page:
    with rows spread evenly, a shard rarely holds more than that of a page's
    rows (21 rows over 4 shards: 12 or more on one of them in under 1 query of
    100), and then only that stream is read again, from where it stopped.  On
    every other query, fewer rows cross the network and get parsed (a driver
    in pure Python spends more on 60 rows than the server does on the scans).
    """
    if limit is None or share >= shards:
        return page
    return min(page, max(10, 2 * -(-(limit + 1) * share // shards)))


def stale(plan: Plan, row: tuple[bytes, ...], entity: Mapping[str, Any]) -> bool:
    """True if the row holds order-column values the entity no longer has."""
    for stored, prop in zip(row, plan.order_props, strict=False):
        v = entity.get(prop)
        if type(v) is not list:  # one value: one key to compare
            try:
                if keys.encode_value(v)[: keys.KEY_LIMIT] != stored:
                    return True
            except keys.UnindexableValue:
                return True
        elif not any(k[: keys.KEY_LIMIT] == stored for k in keys.index_keys(v)):
            return True
    return False


class Source(Protocol):
    """What :func:`execute` needs from a datastore."""

    def scan_streams(self, plan: Plan, page: int) -> list[_Stream]: ...

    def fetch_streams(self, streams: list[_Stream]) -> None: ...

    def fetch_for_query(self, ids: Sequence[bytes]) -> dict[bytes, dict[str, Any]]:
        """``{id: entity}`` of the ids (which may repeat) that exist, read by id
        (the bodies that joined scans read with their rows are decoded by
        :func:`execute` itself)."""
        ...


def _one_pass(
    stream: _Stream,
    rows: list[tuple[Any, ...]],
    plan: Plan,
    matches: Callable[[Mapping[str, Any]], bool],
    limit: int | None,
) -> QueryResult | None:
    """The usual query in one pass over its first page: one stream whose
    statement read each row's entity (joined).  The same answer as the loop of
    :func:`execute` (same re-checks, same cursor), or None when that loop must
    take the page: an entity to read by id (no copy joined, or one that the
    placement does not put where it was read), or more rows wanted than the
    first batch holds."""
    batch = limit or 500
    if stream.next <= batch:  # (a page smaller than the batch: the loop reads on)
        return None
    width = stream.scan.order_width
    at_id, at_which, at_bucket, at_body = width - 1, width, width + 1, width + 2
    owner, joined = stream.shard_of_bucket, stream.joined
    check_rows = bool(plan.order_props)
    decode = codec.decode
    want = limit if limit is not None else MAX_UNLIMITED + 1
    out = QueryResult()
    # An entity has one row per shard when every property is one value:
    # only a scan of several shards, __in or the order columns can repeat it.
    seen: set[bytes] | None = None
    if stream.shards > 1 or check_rows or any(f.op != "eq" for f in plan.eq):
        seen = set()
    exhausted = len(rows) < batch
    if not exhausted:
        rows = rows[:batch]
    for i, row in enumerate(rows):
        which = row[at_which]
        if which is None or owner[row[at_bucket]] != joined[which]:
            return None
        if seen is not None and row[at_id] in seen:
            continue
        entity = decode(row[at_body])
        if (check_rows and stale(plan, row, entity)) or not matches(entity):
            continue
        out.append(entity)
        if seen is not None:
            seen.add(row[at_id])
        if len(out) >= want:
            if limit is not None and (i + 1 < len(rows) or not exhausted):
                out.cursor = encode_cursor(plan, row[:width])
            return out
    # A whole batch read and not enough kept: the loop reads on.  (Without a
    # limit, an exhausted page holds fewer than MAX_UNLIMITED entities.)
    return None if not exhausted else out


def execute(source: Source, plan: Plan, *, limit: int | None, cursor: str | None) -> QueryResult:
    """Run a planned query: merge the shards' scans, fetch, re-check, page."""
    if limit is not None and (
        not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= MAX_LIMIT
    ):
        raise InvalidQuery(f"limit must be an integer from 1 to {MAX_LIMIT}, not {limit!r}")
    after = decode_cursor(plan, cursor) if cursor is not None else None
    if cursor is not None and not isinstance(cursor, str):
        raise InvalidQuery("cursor must be the string a previous result gave")
    page = min(max((limit or 500) + 1, 20), 1000)
    streams = source.scan_streams(plan, page)
    shards = sum(s.shards for s in streams)
    known: dict[bytes, bytes] = {}  # bodies read with the index rows (joined scans)
    for s in streams:
        s.scan.after = after
        s.next = first_page(limit, shards, page, s.shards)
        s.bodies = known
    filters = plan.filters
    if len(filters) == 1:  # the usual query: no generator per row
        matches = filters[0].matcher()
    else:

        def matches(entity: Mapping[str, Any]) -> bool:
            return all(f.matches(entity) for f in filters)

    if len(streams) == 1 and streams[0].joined:
        first = streams[0].read()
        answer = _one_pass(streams[0], first, plan, matches, limit)
        if answer is not None:
            return answer
        streams[0].accept(first)  # the general way, from the same page
    else:
        source.fetch_streams(streams)
    # One stream is in index order already; several are merged.
    if len(streams) == 1:
        take = streams[0].take
    else:
        merged = heapq.merge(*streams, reverse=plan.desc)

        def take(n: int) -> list[tuple[bytes, ...]]:
            return list(itertools.islice(merged, n))

    check_rows = bool(plan.order_props)
    decode = codec.decode
    results: list[dict[str, Any]] = []
    seen: set[bytes] = set()
    last: tuple[bytes, ...] | None = None
    want = limit if limit is not None else MAX_UNLIMITED + 1
    batch = limit or 500
    exhausted = left_over = False
    while len(results) < want and not exhausted:
        rows = take(batch)
        exhausted = len(rows) < batch
        # Bodies read with the index rows (joined scans) are decoded below; the
        # other rows' entities are read by id.
        missing = [r[-1] for r in rows if r[-1] not in known] if known else [r[-1] for r in rows]
        entities = source.fetch_for_query(missing) if missing else {}
        for i, row in enumerate(rows):
            entity_id = row[-1]
            if entity_id in seen:
                continue
            body = known.get(entity_id)
            entity = entities.get(entity_id) if body is None else decode(body)
            if entity is None or (check_rows and stale(plan, row, entity)) or not matches(entity):
                continue
            results.append(entity)
            seen.add(entity_id)
            last = row
            if len(results) >= want:
                left_over = i + 1 < len(rows)
                break
        batch = max(batch, 2 * (want - len(results)))
    if limit is None and len(results) > MAX_UNLIMITED:
        raise InvalidQuery(
            f"more than {MAX_UNLIMITED} entities match: pass limit= and page with the cursor"
        )
    more = limit is not None and len(results) >= want and (left_over or not exhausted)
    return QueryResult(results, encode_cursor(plan, last) if more and last is not None else None)
