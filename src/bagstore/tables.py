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

import inspect
import sys
import typing
from collections.abc import Iterable, Mapping, Sequence
from datetime import date, datetime
from hashlib import blake2b
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

from bagstore import codec, keys
from bagstore.errors import BagstoreError, ConfigurationError, InvalidEntity, InvalidQuery
from bagstore.fields import FieldSpec, check_value, field_spec
from bagstore.index import Index
from bagstore.names import MAX_NAME
from bagstore.query import LOOKUPS
from bagstore.sharding.hashing import bucket_of

if TYPE_CHECKING:
    from bagstore.datastore import Datastore

__all__ = ["Model", "RowMissing", "Rows", "Table", "auto_id", "id_of_pk", "pk_of_id"]

M = TypeVar("M", bound="Model")

#: The first 8 bytes of every typed row's id (see the module's text).
ID_PREFIX = bytes(8)
MAX_PK = 2**64 - 1
_INDEXABLE = (int, str, bytes, float, bool, datetime, date)


class RowMissing(BagstoreError, LookupError):
    """The row to update or delete is no longer stored (deleted meanwhile)."""


def id_of_pk(pk: int) -> bytes:
    """The 16-byte entity id of primary key ``pk``.

    >>> id_of_pk(10001).hex()
    '00000000000000000000000000002711'
    """
    if type(pk) is not int or not 1 <= pk <= MAX_PK:
        raise InvalidQuery(f"a primary key is an int from 1 to {MAX_PK}, not {pk!r}")
    return ID_PREFIX + pk.to_bytes(8, "big")


def pk_of_id(entity_id: bytes) -> int | None:
    """The primary key an id was made from, or None for any other id.

    >>> pk_of_id(id_of_pk(7))
    7
    """
    if len(entity_id) != 16 or entity_id[:8] != ID_PREFIX:
        return None
    return int.from_bytes(entity_id[8:], "big") or None


class _AutoId:
    """The marker :func:`auto_id` returns."""

    def __init__(self, sequence: str | None, block: int, start: int) -> None:
        self.sequence = sequence
        self.block = block
        self.start = start


def auto_id(*, sequence: str | None = None, block: int = 1000, start: int = 1) -> Any:
    """Mark the integer primary key: drawn from the store's sequence
    ``sequence`` (default: the kind's name; ``start``: its first id when new)
    on insert, ``block`` ids reserved per round trip
    (:meth:`bagstore.Datastore.sequence`): unique across processes,
    increasing within one."""
    return _AutoId(sequence, block, start)


class _Field:
    __slots__ = ("default", "mutable", "name", "required", "spec")

    def __init__(self, name: str, spec: FieldSpec, default: Any, required: bool) -> None:
        self.name = name
        self.spec = spec
        self.default = default
        self.required = required
        self.mutable = type(default) in (list, dict)

    def fill(self) -> Any:
        return _copy(self.default) if self.mutable else self.default


class Model:
    """Base class of typed rows.  Declare fields as annotated class
    attributes, and the table with class keywords: ``kind`` (required),
    ``shard_key`` (a field: the kind is placed by it), ``global_kind=True``
    (one database, not sharded: Yupoo's global ``DBTable``), ``isolate_key``
    (a field narrowing the cached pages' revisions, docs/cache.md),
    ``indexes`` (tuples of field names, or :class:`~bagstore.Index` objects).
    Exactly one field is the primary key, ``= auto_id()``."""

    __kind__: ClassVar[str]
    __shard_key__: ClassVar[str | None]
    __isolate_key__: ClassVar[str | None]
    __global__: ClassVar[bool]
    __pk__: ClassVar[str]
    __auto__: ClassVar[_AutoId]
    __fields__: ClassVar[dict[str, _Field]]
    __index_specs__: ClassVar[tuple[Any, ...]]

    def __init_subclass__(
        cls,
        *,
        kind: str,
        shard_key: str | None = None,
        global_kind: bool = False,
        isolate_key: str | None = None,
        indexes: Iterable[Any] = (),
        **kwargs: Any,
    ) -> None:
        if kwargs:
            raise ConfigurationError(
                f"{cls.__name__}: unknown table option(s) {sorted(kwargs)} (kind, shard_key, "
                "global_kind, isolate_key, indexes)"
            )
        super().__init_subclass__()
        name = cls.__name__
        hints = _own_hints(cls, sys._getframe(1))
        fields: dict[str, _Field] = {}
        pk: str | None = None
        for field_name, annotation in hints.items():
            if typing.get_origin(annotation) is ClassVar or field_name.startswith("_"):
                continue
            if field_name == "id":
                raise ConfigurationError(f"{name}: 'id' is the entity's own; name the field else")
            default = cls.__dict__.get(field_name, _NO_DEFAULT)
            if isinstance(default, _AutoId):
                if pk is not None:
                    raise ConfigurationError(f"{name}: two auto_id() fields ({pk}, {field_name})")
                if annotation is not int:
                    raise ConfigurationError(f"{name}.{field_name}: an auto_id() field is an int")
                pk, cls.__auto__ = field_name, default
                default = None
            spec = field_spec(annotation)
            required = default is _NO_DEFAULT
            fields[field_name] = _Field(field_name, spec, None if required else default, required)
            if field_name in cls.__dict__:
                delattr(cls, field_name)  # instances hold the values
        if pk is None:
            raise ConfigurationError(f"{name}: one int field must be the key: `= auto_id()`")
        if global_kind and shard_key is not None:
            raise ConfigurationError(f"{name}: a global table has no shard_key")
        for what, key in (("shard_key", shard_key), ("isolate_key", isolate_key)):
            if key is not None:
                spec_of = fields.get(key)
                if spec_of is None or spec_of.spec.scalar not in _INDEXABLE or key == pk:
                    raise ConfigurationError(
                        f"{name}: {what} {key!r} must be one of its fields of a scalar type "
                        "(int, str, bytes, float, bool, datetime, date), not the key"
                    )
        cls.__kind__ = kind
        cls.__shard_key__ = shard_key
        cls.__isolate_key__ = isolate_key
        cls.__global__ = global_kind
        cls.__pk__ = pk
        cls.__fields__ = fields
        cls.__index_specs__ = tuple(indexes)
        for spec in cls.__index_specs__:
            _index_of(cls, spec)  # bad declarations fail now

    def __init__(self, **values: Any) -> None:
        fields = type(self).__fields__
        for key in values:
            if key not in fields:
                raise InvalidEntity(f"{_unknown(type(self), key)}")
        for f in fields.values():
            if f.name in values:
                setattr(self, f.name, values[f.name])
            elif f.required and f.name != type(self).__pk__:
                raise InvalidEntity(f"{type(self).__name__}.{f.name}: required field missing")
            else:
                setattr(self, f.name, f.fill())
        self._stored: dict[str, Any] | None = None
        self._version: int | None = None

    # -- bodies ----------------------------------------------------------------------
    @classmethod
    def _from_body(cls: type[M], body: dict[str, Any], version: int | None) -> M:
        """A row from a stored body: fields it lacks take their defaults (a
        field added after it was stored), properties no field declares are kept."""
        row = cls.__new__(cls)
        values = row.__dict__
        for name, f in cls.__fields__.items():
            if name in body:
                value = body[name]
                values[name] = _copy(value) if type(value) in (list, dict) else value
            elif f.required:
                raise InvalidEntity(
                    f"{cls.__name__}: stored entity {body.get('id', b'').hex()} has no "
                    f"{name!r}, a required field (give the field a default to read it)"
                )
            else:
                values[name] = f.fill()
        values["_stored"] = body
        values["_version"] = version
        return row

    def _checked(self) -> dict[str, Any]:
        """Every field's value to store, checked (InvalidEntity naming the field)."""
        cls = type(self)
        out: dict[str, Any] = {}
        for key in self.__dict__:
            if not key.startswith("_") and key not in cls.__fields__:
                raise InvalidEntity(_unknown(cls, key))
        for name, f in cls.__fields__.items():
            if name not in self.__dict__:
                raise InvalidEntity(f"{cls.__name__}.{name}: required field missing")
            value = self.__dict__[name]
            if name == cls.__pk__ and value is None:
                out[name] = None
                continue
            fits, stored = check_value(f.spec, value)
            if not fits:
                shown = repr(value)
                shown = shown if len(shown) <= 60 else shown[:57] + "..."
                raise InvalidEntity(
                    f"{cls.__name__}.{name}: expected {f.spec.describe}, got "
                    f"{type(value).__name__} {shown}"
                )
            out[name] = stored
        return out

    @property
    def pk(self) -> int | None:
        """The primary key (None before insert)."""
        value: int | None = self.__dict__.get(type(self).__pk__)
        return value

    def as_dict(self) -> dict[str, Any]:
        """The fields' values, by name."""
        return {name: getattr(self, name, None) for name in type(self).__fields__}

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Model)
            and type(other) is type(self)
            and (self.as_dict() == other.as_dict())
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={v!r}" for k, v in self.as_dict().items())
        return f"{type(self).__name__}({shown})"

    # -- a table over a new datastore ------------------------------------------------
    @classmethod
    def open(cls: type[M], where: Any, **options: Any) -> Table[M]:
        """A :class:`Table` of this model over a datastore it opens (and closes
        with the table): ``where`` is a SQLite store directory
        (:func:`bagstore.open`) or a list of shard URLs
        (:class:`bagstore.Datastore`); ``options`` go to the datastore."""
        from bagstore.datastore import Datastore, open

        placed: dict[str, Any] = {"kind": cls.__kind__}
        if cls.__global__:
            placed["shard_map"] = "global"
        elif cls.__shard_key__ is not None:
            placed["shard_key"] = cls.__shard_key__
        placed.update(options)
        if isinstance(where, list | tuple):
            ds = Datastore(list(where), **placed)
        else:
            ds = open(where, **placed)
        try:
            return Table(cls, ds, owned=True)
        except BaseException:
            ds.close()
            raise


def _own_hints(cls: type, frame: Any) -> dict[str, Any]:
    """The class's own annotations, evaluated where the class statement ran
    (strings under ``from __future__ import annotations`` too)."""
    module = sys.modules.get(cls.__module__)
    scope = dict(vars(module)) if module is not None else {}
    scope.update(frame.f_globals)
    local = dict(frame.f_locals)
    out: dict[str, Any] = {}
    for name, annotation in inspect.get_annotations(cls).items():
        if isinstance(annotation, str):
            try:
                annotation = eval(annotation, scope, local)  # what typing.get_type_hints does
            except Exception as exc:
                raise ConfigurationError(
                    f"{cls.__name__}.{name}: cannot read its type {annotation!r} ({exc})"
                ) from None
        out[name] = annotation
    return out


class _NoDefault:
    def __repr__(self) -> str:
        return "<required>"


_NO_DEFAULT: Any = _NoDefault()


def _unknown(cls: type[Model], key: str) -> str:
    return f"{cls.__name__}: unknown field {key!r} (fields: {', '.join(cls.__fields__)})"


def _index_of(cls: type[Model], spec: Any) -> Index:
    """The index a declaration names (a tuple of fields, or an Index)."""
    if isinstance(spec, Index):
        return spec
    if isinstance(spec, str) or not isinstance(spec, Sequence) or not spec:
        raise ConfigurationError(f"{cls.__name__}: an index is a tuple of field names or an Index")
    props = [str(p) for p in spec]
    for p in props:
        f = cls.__fields__.get(p)
        if f is None:
            raise ConfigurationError(f"{cls.__name__}: index on {p!r}, which is not a field")
    sk, iso = cls.__shard_key__, cls.__isolate_key__
    # Index rows live beside their entities when the index is placed by the
    # shard key; a global table's all live in one database, and its shard_on
    # is what the cached pages' revisions are scoped by (Yupoo's isolate_key).
    shard_on = sk if sk in props else iso if iso in props else props[0]
    name = f"{cls.__kind__}_by_{'_'.join(props)}"
    if len(name) > MAX_NAME or "__" in name:
        digest = blake2b(name.encode(), digest_size=5).hexdigest()
        name = f"{cls.__kind__[: MAX_NAME - 15]}_by_{digest}".replace("__", "_")
    isolate = iso if iso in props and iso != shard_on else None
    return Index(name, props, shard_on=shard_on, isolate_key=isolate)


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


def _put_expecting_version(ds: Datastore, entity: dict[str, Any], version: int) -> int | None:
    """Store ``entity`` only if its stored version is still ``version`` (0: only
    if it does not exist yet); return the new version when known.

    For now a plain ``ds.put``: it MUST become ``ds.put(entity,
    expect_version=version)`` (raising ``bagstore.Conflict``) once the facade
    has it; nothing else in this module checks versions."""
    ds.put(entity)
    return None


def _delete_expecting_version(ds: Datastore, entity_id: bytes, version: int | None) -> bool:
    """Delete the entity only if its stored version is still ``version`` (None:
    whatever it is); whether it existed.

    For now a plain ``ds.delete``: it MUST become ``ds.delete(entity_id,
    expect_version=version)`` once the facade has it."""
    return ds.delete(entity_id)


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
        cached = type(key_value) in _INDEXABLE
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
        version = _put_expecting_version(self.ds, body, 0)
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
        new_version = _put_expecting_version(self.ds, body, version)
        row._stored, row._version = body, new_version
        return True

    def delete(self, row: M) -> bool:
        """Delete the row (conditional on the version it loaded, if known);
        False if it was not stored."""
        self._check_model(row)
        if row.pk is None:
            return False
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


def _copy(value: Any) -> Any:
    """A copy of a list or dict of stored values, nested ones copied too (the
    scalars a body holds are immutable)."""
    if type(value) is list:
        return [_copy(v) if type(v) in (list, dict) else v for v in value]
    return {k: _copy(v) if type(v) in (list, dict) else v for k, v in value.items()}


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
