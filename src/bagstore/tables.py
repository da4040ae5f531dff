"""Typed tables: Yupoo's ``ShardedDBTable`` and ``DBTable`` in Python's idiom.

A :class:`Model` subclass declares a table over a kind: its fields (typed by
their annotations, with defaults), the kind, the shard key, and an integer
primary key drawn from a store-wide sequence (:func:`auto_id`, Yupoo's
``global_auto_increment``).  A :class:`Table` binds it to a datastore of that
kind and runs ``insert``, ``load``, ``update``, ``delete`` and ``fetch``.

    >>> import tempfile
    >>> from datetime import date
    >>> class Photo(Model, kind="photos", shard_key="user_id", indexes=[("user_id", "posted")]):
    ...     photo_id: int = auto_id()
    ...     user_id: int
    ...     title: str = ""
    ...     posted: date | None = None
    >>> photos = Photo.open(tempfile.mkdtemp())
    >>> photo = photos.insert(Photo(user_id=1, title="Workforme", posted=date(2010, 7, 1)))
    >>> photo.photo_id
    1
    >>> loaded = photos.load(1, photo.photo_id)
    >>> loaded.title = "Database Sharding"
    >>> photos.update(loaded)
    True
    >>> [p.title for p in photos.fetch(user_id=1, posted__gt=date(2010, 6, 1))]
    ['Database Sharding']
    >>> photos.delete(loaded)
    True
    >>> photos.close()

The integer key and the 16-byte id: a row of primary key ``pk`` is the entity
whose id is 8 zero bytes then ``pk`` as 8 big-endian bytes
(:func:`id_of_pk`); the body holds the primary key field too.  An id made by
:func:`bagstore.new_id` starts with the time in milliseconds, never 6 zero
bytes, so the two never meet.  ``load(shard_key_value, pk)`` computes the id
and the shard key's bucket, and reads that bucket's shard only: one statement,
never a look through every shard (docs/tables.md).

Versioned reads and writes go through :func:`_read_with_version`,
:func:`_put_expecting_version` and :func:`_delete_expecting_version`, and
nowhere else.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from bagstore import codec, keys
from bagstore.errors import ConfigurationError, InvalidEntity, InvalidQuery
from bagstore.models import (
    ID_PREFIX,
    INDEXABLE,
    Model,
    RowMissing,
    _index_of,
    _unknown,
    auto_id,
    id_of_pk,
    pk_of_id,
)
from bagstore.query import LOOKUPS
from bagstore.sharding.hashing import bucket_of

if TYPE_CHECKING:
    from bagstore.datastore import Datastore

__all__ = [
    "ID_PREFIX",
    "Model",
    "RowMissing",
    "Rows",
    "Table",
    "auto_id",
    "id_of_pk",
    "open_table",
    "pk_of_id",
]

M = TypeVar("M", bound=Model)


class Rows(list[M]):
    """A page of rows; ``cursor`` continues after it (None after the last page)."""

    cursor: str | None

    def __init__(self, items: Iterable[M] = (), cursor: str | None = None) -> None:
        super().__init__(items)
        self.cursor = cursor


# -- versioned reads and writes -----------------------------------------------------------
# The only three places the tables read or write by version.  They use what the
# facade offers today; each says what it must become.


def _read_with_version(
    ds: Datastore, entity_id: bytes, bucket: int
) -> tuple[dict[str, Any], int] | None:
    """``(entity, version)`` as the shard holding ``bucket`` has it now (never
    a cache), or None: one statement on one shard.  (``ds.fetch_many`` would
    give the same ``Stored(body, version, updated)`` but find the id through
    the id lookup rows, and through every shard when it is missing.)"""
    ds.refresh_placement()
    found = ds.router.topology.backend_of(bucket).get_bodies(ds.kind, [entity_id])
    stored = found.get(entity_id)
    return None if stored is None else (codec.decode(stored.body), stored.version)


def _put_expecting_version(ds: Datastore, entity: dict[str, Any], version: int) -> None:
    """Store ``entity`` only if its stored version is still ``version`` (0: only
    if it does not exist yet), else raise :class:`bagstore.Conflict` with
    nothing changed."""
    ds.put(entity, expect_version=version)


def _delete_expecting_version(ds: Datastore, entity_id: bytes, version: int | None) -> bool:
    """Delete the entity only if its stored version is still ``version`` (None:
    whatever it is; else :class:`bagstore.Conflict`); whether it existed."""
    return ds.delete(entity_id, expect_version=version)


class Table(Generic[M]):
    """Typed rows of ``model`` over ``ds``, a datastore of the model's kind
    placed as the model says (``Model.open`` opens one).  The model's indexes
    are added to ``ds`` if missing.  ``owned``: ``close()`` closes ``ds``."""

    def __init__(self, model: type[M], ds: Datastore, *, owned: bool = False) -> None:
        if ds.kind != model.__kind__:
            raise ConfigurationError(
                f"{model.__name__} is kind {model.__kind__!r}; the datastore is {ds.kind!r}"
            )
        placed_by = ds.placer.shard_key
        if placed_by != model.__shard_key__ or ds.router.pinned != model.__global__:
            want = "global" if model.__global__ else f"placed by {model.__shard_key__ or 'id'!r}"
            raise ConfigurationError(
                f"{model.__name__} is {want}; kind {ds.kind!r} of this datastore is "
                + ("global" if ds.router.pinned else f"placed by {placed_by or 'id'!r}")
            )
        self.model = model
        self.ds = ds
        self._owned = owned
        auto = model.__auto__
        self.sequence = ds.sequence(
            auto.sequence or model.__kind__, block=auto.block, start=auto.start
        )
        self._fields = model.__fields__
        self._pk = model.__pk__
        self._shard_key = model.__shard_key__
        self._hashed: dict[tuple[type, Any], int] = {}
        for spec in model.__index_specs__:
            index = _index_of(model, spec)
            if index.table not in ds.indexes():
                ds.add_index(index)

    # -- rows ------------------------------------------------------------------------
    def new(self, **values: Any) -> M:
        """A new row (not stored yet): Yupoo's ``new_object``."""
        return self.model(**values)

    def _bucket(self, key_value: object) -> int | None:
        """The bucket of a shard key value (None: the directory knows no such key).
        A hashed key's bucket never changes (the bucket count is fixed): kept."""
        cached = type(key_value) in INDEXABLE
        known = self._hashed.get((type(key_value), key_value)) if cached else None
        if known is not None:
            return known
        try:
            encoded = keys.encode_value(key_value)
        except keys.UnindexableValue as exc:
            raise InvalidQuery(f"shard key {self._shard_key!r}: {exc}") from None
        bucket = self.ds.placer.bucket_of_key(encoded, for_write=False)
        if cached and self.ds.placer.directory is None and bucket is not None:
            if len(self._hashed) >= 100_000:
                self._hashed.clear()
            self._hashed[(type(key_value), key_value)] = bucket
        return bucket

    def _where(self, args: tuple[Any, ...]) -> tuple[bytes, int | None, Any]:
        """``(id, bucket, shard key value)`` of ``load``'s arguments."""
        name = self.model.__name__
        if self._shard_key is not None:
            if len(args) != 2:
                raise InvalidQuery(f"{name}.load takes the {self._shard_key} and the {self._pk}")
            entity_id = id_of_pk(args[1])
            return entity_id, self._bucket(args[0]), args[0]
        if len(args) != 1:
            raise InvalidQuery(f"{name}.load takes the {self._pk}")
        entity_id = id_of_pk(args[0])
        return entity_id, bucket_of(entity_id, self.ds.placement.buckets), None

    def load(self, *key: Any) -> M | None:
        """The row of this key, or None: ``load(shard_key_value, pk)`` for a
        table with a shard key (Yupoo's ``$Photos->load(1, 10001)``),
        ``load(pk)`` otherwise.  One statement on the shard of the key's
        bucket; the row remembers the version it read (for ``update``)."""
        entity_id, bucket, key_value = self._where(key)
        if bucket is None:
            return None
        found = _read_with_version(self.ds, entity_id, bucket)
        if found is None:
            return None
        body, version = found
        if self._shard_key is not None and not _same(body.get(self._shard_key), key_value):
            return None  # the key's bucket holds it, but under another shard key value
        return self.model._from_body(body, version)

    def insert(self, row: M) -> M:
        """Store a new row; its primary key, if None, is drawn from the
        sequence.  Fails (nothing stored) on a bad field; returns the row."""
        self._check_model(row)
        values = row._checked()
        pk = values[self._pk]
        if pk is None:
            pk = values[self._pk] = self.sequence.next()
        body = {**values, "id": id_of_pk(pk)}
        _put_expecting_version(self.ds, body, 0)
        version = None
        row.__dict__[self._pk] = pk
        row._stored, row._version = body, version
        return row

    def update(self, row: M) -> bool:
        """Write the fields changed since the row was loaded (or last written),
        on top of what is stored, conditional on the version it loaded; False
        if nothing changed.  A row whose version is not known (one from
        ``fetch``, or written before) reads it first."""
        self._check_model(row)
        values = row._checked()
        pk = values[self._pk]
        if pk is None:
            raise InvalidEntity(f"{self.model.__name__}: update of a row never inserted")
        self._same_key(row, pk)
        entity_id = id_of_pk(pk)
        before = row._stored or {}
        changed = {
            k: v for k, v in values.items() if k not in before or not _identical(before[k], v)
        }
        if not changed:
            return False
        version = row._version
        if version is None or row._stored is None:
            found = _read_with_version(self.ds, entity_id, self._bucket_of_row(before or values))
            if found is None:
                raise RowMissing(f"{self.model.__name__} {pk} is not stored (deleted?)")
            before, version = found
        body = {**before, **changed, "id": entity_id}
        _put_expecting_version(self.ds, body, version)
        row._stored, row._version = body, None
        return True

    def delete(self, row: M) -> bool:
        """Delete the row (conditional on the version it loaded, if known);
        False if it was not stored."""
        self._check_model(row)
        if row.pk is None:
            return False
        self._same_key(row, row.pk)
        done = _delete_expecting_version(self.ds, id_of_pk(row.pk), row._version)
        row._stored, row._version = None, None
        return done

    def fetch(
        self,
        *,
        order: str | None = None,
        limit: int | None = None,
        cursor: str | None = None,
        **filters: Any,
    ) -> Rows[M]:
        """Rows matching ``filters`` through the kind's indexes, as
        ``ds.query`` takes them (``user_id=1, posted__gt=date(2010, 6, 1)``)."""
        for key in filters:
            name = key.rsplit("__", 1)[0] if key.rsplit("__", 1)[-1] in LOOKUPS else key
            if name not in self._fields:
                raise InvalidQuery(_unknown(self.model, name))
        found = self.ds.query(order=order, limit=limit, cursor=cursor, **filters)
        return Rows((self.model._from_body(e, None) for e in found), found.cursor)

    # -- helpers ---------------------------------------------------------------------
    def _check_model(self, row: object) -> None:
        if type(row) is not self.model:
            raise InvalidEntity(f"a {self.model.__name__} table stores {self.model.__name__} rows")

    def _same_key(self, row: M, pk: object) -> None:
        """Refuse a row whose key was changed since it was read or written: its
        version is the old row's, which another row may share (rows written
        together): the write or delete would reach that other row."""
        stored = row._stored
        if stored is not None and self._pk in stored and not _same(stored[self._pk], pk):
            raise InvalidEntity(
                f"{self.model.__name__}: a row's key {self._pk} cannot change (from "
                f"{stored[self._pk]!r} to {pk!r}); insert a new row and delete this one"
            )

    def _bucket_of_row(self, values: Mapping[str, Any]) -> int:
        """The bucket a row's entity lives in (for a versioned read)."""
        pk = values[self._pk]
        if self._shard_key is None:
            return bucket_of(id_of_pk(pk), self.ds.placement.buckets)
        bucket = self._bucket(values[self._shard_key])
        if bucket is None:
            raise RowMissing(f"{self.model.__name__} {pk}: its shard key is not recorded")
        return bucket

    def close(self) -> None:
        """Close the datastore if this table opened it."""
        if self._owned:
            self.ds.close()

    def __enter__(self) -> Table[M]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<bagstore.Table {self.model.__name__} kind={self.model.__kind__!r}>"


def _identical(a: Any, b: Any) -> bool:
    """Equal with the same types (``1`` is not ``True``, nor ``1.0``)."""
    return type(a) is type(b) and a == b


def _same(a: Any, b: Any) -> bool:
    """Equal as the indexes compare (a shard key value)."""
    if type(a) is type(b) and type(a) in (int, str, bytes):
        return bool(a == b)  # these compare as their encodings do
    try:
        return keys.encode_value(a) == keys.encode_value(b)
    except keys.UnindexableValue:
        return False


def open_table(model: type[M], where: Any, **options: Any) -> Table[M]:
    """A :class:`Table` of ``model`` over a datastore opened for it (and closed
    with the table): see :meth:`bagstore.Model.open`."""
    from bagstore.datastore import Datastore, open

    placed: dict[str, Any] = {"kind": model.__kind__}
    if model.__global__:
        placed["shard_map"] = "global"
    elif model.__shard_key__ is not None:
        placed["shard_key"] = model.__shard_key__
    placed.update(options)
    if isinstance(where, list | tuple):
        ds = Datastore(list(where), **placed)
    else:
        ds = open(where, **placed)
    try:
        return Table(model, ds, owned=True)
    except BaseException:
        ds.close()
        raise
