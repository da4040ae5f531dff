"""Declarations of typed tables (:mod:`bagstore.tables`): the :class:`Model`
base class, its fields, the integer key and the id it maps to.

    >>> class Note(Model, kind="notes"):
    ...     note_id: int = auto_id()
    ...     text: str
    ...     stars: int = 0
    >>> Note(text="hi")
    Note(note_id=None, text='hi', stars=0)
    >>> id_of_pk(7).hex()
    '00000000000000000000000000000007'
"""

from __future__ import annotations

import inspect
import sys
import typing
from collections.abc import Iterable, Sequence
from datetime import date, datetime
from hashlib import blake2b
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from bagstore.errors import BagstoreError, ConfigurationError, InvalidEntity, InvalidQuery
from bagstore.fields import FieldSpec, check_value, field_spec
from bagstore.index import Index
from bagstore.names import MAX_NAME

if TYPE_CHECKING:
    from bagstore.tables import Table

__all__ = ["ID_PREFIX", "MAX_PK", "Model", "RowMissing", "auto_id", "id_of_pk", "pk_of_id"]

M = TypeVar("M", bound="Model")

#: The first 8 bytes of every typed row's id (see docs/tables.md).
ID_PREFIX = bytes(8)
MAX_PK = 2**64 - 1
INDEXABLE = (int, str, bytes, float, bool, datetime, date)


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
                if spec_of is None or spec_of.spec.scalar not in INDEXABLE or key == pk:
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
        from bagstore.tables import open_table

        return open_table(cls, where, **options)


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


def _copy(value: Any) -> Any:
    """A copy of a list or dict of stored values, nested ones copied too (the
    scalars a body holds are immutable)."""
    if type(value) is list:
        return [_copy(v) if type(v) in (list, dict) else v for v in value]
    return {k: _copy(v) if type(v) in (list, dict) else v for k, v in value.items()}
