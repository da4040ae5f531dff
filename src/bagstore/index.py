"""Secondary indexes: each one a table on every shard (FriendFeed's design).

An :class:`Index` names its table, the properties it indexes (in order), the
property whose value decides which shard a row lives on (``shard_on``), and
whether values are unique.  Every index row holds one stored key per property,
the entity id and the bucket of its ``shard_on`` value; the row lives on the
shard that owns that bucket, so a query that gives the ``shard_on`` value reads
one shard.

    >>> user_id_index = Index(table="index_user_id", properties=["user_id"], shard_on="user_id")
    >>> user_id_index.properties
    ('user_id',)

Life cycle (kept in the catalog): ``building`` -> ``ready`` -> ``retired``.  Writers
maintain ``building`` and ``ready`` indexes; queries use ``ready`` ones (or a
``building`` one with ``allow_partial=True``).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Mapping, Sequence
from functools import partial
from operator import itemgetter
from typing import TYPE_CHECKING, Any, cast

from bagstore import keys
from bagstore.backends import check_identifier
from bagstore.backends.indexsql import RESERVED, IndexRow
from bagstore.errors import ConfigurationError, InvalidEntity
from bagstore.names import RESERVED_PREFIX, check_name
from bagstore.sharding.hashing import bucket_list, bucket_of

if TYPE_CHECKING:
    from bagstore.datastore import Datastore
    from bagstore.query import QueryResult

__all__ = ["BUILDING", "READY", "RETIRED", "STATES", "Index"]

_FIRST = itemgetter(0)
#: ``IndexRow`` of a tuple of its fields, at C's speed (as namedtuple's ``_make``)
_index_row = partial(tuple.__new__, IndexRow)

BUILDING, READY, RETIRED = "building", "ready", "retired"
STATES = (BUILDING, READY, RETIRED)
#: At most this many index rows for one entity in one index (lists multiply).
MAX_ROWS_PER_ENTITY = 1000
MAX_PROPERTIES = 8


class Index:
    """A secondary index declaration.

    ``properties`` are indexed in order (a query gives equality on a prefix of
    them, then an optional range on the next); ``shard_on`` (default: the first
    property) must be one of them; ``unique=True`` allows one entity per value.
    ``table`` follows the naming rules of :mod:`bagstore.names` (at most 40
    characters, no ``__``, not starting with ``bagstore_``; the catalog also
    refuses a name a kind or another index already uses).
    ``isolate_key`` (optional, one of the properties) narrows the cache scope of
    a query that gives it by equality besides the ``shard_on`` value (Yupoo's
    isolate key: a write to one album leaves the cached pages of the user's other
    albums alone); see ``docs/cache.md``.
    """

    __slots__ = ("_json", "isolate_key", "properties", "shard_on", "table", "unique")

    def __init__(
        self,
        table: str,
        properties: Sequence[str],
        shard_on: str | None = None,
        unique: bool = False,
        isolate_key: str | None = None,
        *,
        _stored: bool = False,
    ) -> None:
        check_identifier(table, "index table name")
        if table.lower().startswith(RESERVED_PREFIX):
            raise ConfigurationError(
                f"index table name {table!r}: the {RESERVED_PREFIX} prefix is reserved "
                "for bagstore's own tables"
            )
        if not _stored:  # definitions read from the catalog keep the rules of their day
            check_name(table, "index table name")
        if isinstance(properties, str) or not isinstance(properties, Sequence):
            raise ConfigurationError(f"index {table!r}: properties must be a list of names")
        props = tuple(properties)
        if not 1 <= len(props) <= MAX_PROPERTIES:
            raise ConfigurationError(
                f"index {table!r}: needs 1 to {MAX_PROPERTIES} properties, got {len(props)}"
            )
        for p in props:
            check_identifier(p, f"property of index {table!r}")
            if p in RESERVED or p == "id":
                reserved = sorted(RESERVED | {"id"})
                raise ConfigurationError(
                    f"index {table!r}: property name {p!r} is reserved ({reserved})"
                )
        if len(set(props)) != len(props):
            raise ConfigurationError(
                f"index {table!r}: a property is listed twice in {list(props)}"
            )
        shard = props[0] if shard_on is None else shard_on
        if shard not in props:
            raise ConfigurationError(
                f"index {table!r}: shard_on {shard!r} must be one of its properties {list(props)}"
            )
        if not isinstance(unique, bool):
            raise ConfigurationError(f"index {table!r}: unique must be True or False")
        if isolate_key is not None and isolate_key not in props:
            raise ConfigurationError(
                f"index {table!r}: isolate_key {isolate_key!r} must be one of its properties "
                f"{list(props)}"
            )
        self.table = table
        self.properties = props
        self.shard_on = shard
        self.unique = unique
        self.isolate_key = isolate_key
        #: The definition as JSON: what equality and hashing compare (an Index
        #: is not changed after it is made).
        self._json = json.dumps(self.definition(), sort_keys=True)

    # -- identity ----------------------------------------------------------------
    def definition(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "table": self.table,
            "properties": list(self.properties),
            "shard_on": self.shard_on,
            "unique": self.unique,
        }
        if self.isolate_key is not None:  # absent otherwise: older definitions stay equal
            out["isolate_key"] = self.isolate_key
        return out

    def to_json(self) -> str:
        return self._json

    @classmethod
    def from_json(cls, text: str) -> Index:
        try:
            return cls(**json.loads(text), _stored=True)
        except (TypeError, ValueError) as exc:
            raise ConfigurationError(f"bad index definition in the catalog: {text!r}") from exc

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Index) and self._json == other._json

    def __hash__(self) -> int:
        return hash(self._json)

    def __repr__(self) -> str:
        unique = ", unique=True" if self.unique else ""
        isolate = f", isolate_key={self.isolate_key!r}" if self.isolate_key is not None else ""
        return (
            f"Index(table={self.table!r}, properties={list(self.properties)!r}, "
            f"shard_on={self.shard_on!r}{unique}{isolate})"
        )

    # -- rows --------------------------------------------------------------------
    def rows_for(self, entity: Mapping[str, Any], entity_id: bytes, buckets: int) -> set[IndexRow]:
        """The index rows an entity body should have (empty if it lacks a property).

        Raises :class:`InvalidEntity` for a unique value too long to store whole,
        or for lists that would make more than ``MAX_ROWS_PER_ENTITY`` rows.
        """
        if len(self.properties) == 1:  # the common case, without the product
            value = entity.get(self.properties[0])
            if type(value) is not list:
                try:
                    key = keys.encode_value(value)
                except keys.UnindexableValue:
                    return set()
                kept = key
                if len(key) > keys.KEY_LIMIT:  # (keys.truncate's cut, inline)
                    if self.unique:
                        raise self._too_long(len(key))
                    kept = key[: keys.KEY_LIMIT]
                return {_index_row(((kept,), entity_id, bucket_of(key, buckets)))}
        per_property: list[list[bytes]] = []
        for p in self.properties:
            encoded = keys.index_keys(entity.get(p))
            if not encoded:
                return set()
            per_property.append(encoded)
        count = 1
        for vs in per_property:
            count *= len(vs)
        if count > MAX_ROWS_PER_ENTITY:
            raise InvalidEntity(
                f"index {self.table!r} would hold {count} rows for entity {entity_id.hex()} "
                f"(at most {MAX_ROWS_PER_ENTITY}; lists in several indexed properties multiply)"
            )
        shard_pos = self.properties.index(self.shard_on)
        rows: set[IndexRow] = set()
        for combo in itertools.product(*per_property):
            if self.unique and any(len(k) > keys.KEY_LIMIT for k in combo):
                raise self._too_long(max(map(len, combo)))
            stored = tuple(keys.truncate(k)[0] for k in combo)
            rows.add(IndexRow(stored, entity_id, bucket_of(combo[shard_pos], buckets)))
        return rows

    def rows_for_many(
        self, entities: Sequence[tuple[bytes, Mapping[str, Any]]], buckets: int
    ) -> list[set[IndexRow]]:
        """``[rows_for(entity, entity_id, buckets) for entity_id, entity in
        entities]``, a step at a time over the whole batch (a ``put_many``'s):
        the same rows and the same errors."""
        if len(self.properties) != 1 or len(entities) == 1:
            return [self.rows_for(e, i, buckets) for i, e in entities]
        prop = self.properties[0]
        values = [e.get(prop) for _, e in entities]
        encoded = keys.encode_scalars(values)  # None: no row, or a list's
        limit, unique = keys.KEY_LIMIT, self.unique
        present = cast("list[bytes]", encoded)  # (once None is not in it)
        if encoded and None not in encoded and max(map(len, present)) <= limit:  # (usually)
            # {IndexRow((key,), entity_id, bucket)} each, made in C's loops
            hashed_all = bucket_list(present, buckets)
            made = zip(zip(present), map(_FIRST, entities), hashed_all, strict=True)
            return list(map(set, zip(map(_index_row, made))))
        hashed = iter(bucket_list([k for k in encoded if k is not None], buckets))
        out: list[set[IndexRow]] = []
        append = out.append
        for (entity_id, entity), value, key in zip(entities, values, encoded, strict=True):
            if key is None:
                append(self.rows_for(entity, entity_id, buckets) if type(value) is list else set())
            elif len(key) <= limit:
                append({IndexRow((key,), entity_id, next(hashed))})
            elif unique:
                raise self._too_long(len(key))
            else:
                append({IndexRow((key[:limit],), entity_id, next(hashed))})
        return out

    def _too_long(self, size: int) -> InvalidEntity:
        return InvalidEntity(
            f"a value of unique index {self.table!r} is {size} bytes "
            f"encoded, over the {keys.KEY_LIMIT}-byte limit of unique values"
        )

    def rows_or_none(
        self, entity: Mapping[str, Any] | None, entity_id: bytes, buckets: int
    ) -> set[IndexRow]:
        """Like :meth:`rows_for`, but an old body that no longer passes the
        checks (or no body) yields no rows instead of an error."""
        if entity is None:
            return set()
        try:
            return self.rows_for(entity, entity_id, buckets)
        except InvalidEntity:
            return set()

    # -- queries -----------------------------------------------------------------
    def get_all(
        self,
        datastore: Datastore,
        *,
        order: str | None = None,
        limit: int | None = None,
        cursor: str | None = None,
        allow_partial: bool = False,
        read_from: str | None = None,
        **filters: Any,
    ) -> QueryResult:
        """Entities matching ``filters`` through this index, in index order
        (``read_from``: "primary" or "replica", see docs/replication.md).

        Filters: ``prop=v``, ``prop__in=[...]`` on a prefix of the properties,
        then ``prop__gt/__gte/__lt/__lte`` on the next one.  ``order`` is that
        next property, ``-`` in front for descending.  The result is a list with
        a ``.cursor`` for the next page (None after the last).

        >>> # entities = user_id_index.get_all(ds, user_id=b"...", limit=20)
        """
        return datastore.query_index(
            self,
            filters,
            order=order,
            limit=limit,
            cursor=cursor,
            allow_partial=allow_partial,
            read_from=read_from,
        )

    def get(self, datastore: Datastore, **filters: Any) -> dict[str, Any] | None:
        """The first entity matching ``filters`` (for unique indexes: the one), or None."""
        found = self.get_all(datastore, limit=1, **filters)
        return found[0] if found else None


class Registry:
    """The indexes of one kind, as the catalog lists them, with their states."""

    def __init__(self, entries: Iterable[tuple[Index, str]] = ()) -> None:
        self.by_table: dict[str, tuple[Index, str]] = {i.table: (i, s) for i, s in entries}

    def maintained(self) -> list[Index]:
        """Indexes every writer must keep: building and ready."""
        return [i for i, s in self.by_table.values() if s in (BUILDING, READY)]

    def state(self, table: str) -> str | None:
        entry = self.by_table.get(table)
        return entry[1] if entry else None
