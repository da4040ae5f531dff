"""Typed fields of :mod:`bagstore.tables`: what a field's annotation accepts.

A field's type is read from its annotation and turned into a checker once,
when the model class is made.  Accepted annotations: ``int``, ``str``,
``bytes``, ``float`` (an ``int`` is accepted and stored as a ``float``),
``bool``, ``datetime.datetime``, ``datetime.date``, ``list`` / ``list[X]``,
``dict`` / ``dict[str, X]``, ``X | None`` (``Optional[X]``) and ``Any``.
``bool`` is not an ``int`` here, nor a ``datetime`` a ``date``: the codec and
the indexes tell them apart, so the fields do too.

    >>> spec = field_spec(list[int])
    >>> spec.check([1, 2]), spec.check([1, "2"])
    ([1, 2], None)
    >>> spec.describe
    'list[int]'
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date, datetime
from typing import Any

from bagstore.errors import ConfigurationError

__all__ = ["FieldSpec", "field_spec"]

_MISSING_CHECK = object()


@dataclass(frozen=True)
class FieldSpec:
    """How one annotation checks a value: ``check(v)`` returns the value to
    store (``v`` itself, or an ``int`` made a ``float``), or None when ``v``
    does not fit (for ``X | None`` fields, a None value is let through before
    ``check`` is asked)."""

    describe: str
    check: Callable[[Any], Any]
    optional: bool = False
    #: the scalar type a shard key or an index may use (None: a container or Any)
    scalar: type | None = None


def _exact(cls: type) -> Callable[[Any], Any]:
    def check(v: Any) -> Any:
        return v if type(v) is cls else None

    return check


def _float(v: Any) -> Any:
    t = type(v)
    if t is float:
        return v
    if t is int:
        return float(v)
    return None


_SCALARS: dict[Any, tuple[str, Callable[[Any], Any]]] = {
    int: ("int", _exact(int)),
    str: ("str", _exact(str)),
    bytes: ("bytes", _exact(bytes)),
    float: ("float", _float),
    bool: ("bool", _exact(bool)),
    datetime: ("datetime", _exact(datetime)),
    date: ("date", _exact(date)),
}


def _list_of(inner: FieldSpec) -> Callable[[Any], Any]:
    def check(v: Any) -> Any:
        if type(v) is not list:
            return None
        out = []
        for item in v:
            got = _checked(inner, item)
            if got is _MISSING_CHECK:
                return None
            out.append(got)
        return out

    return check


def _dict_of(inner: FieldSpec) -> Callable[[Any], Any]:
    def check(v: Any) -> Any:
        if type(v) is not dict:
            return None
        out = {}
        for key, item in v.items():
            got = _checked(inner, item)
            if type(key) is not str or got is _MISSING_CHECK:
                return None
            out[key] = got
        return out

    return check


def _checked(spec: FieldSpec, v: Any) -> Any:
    """The value to store, or ``_MISSING_CHECK`` when ``v`` does not fit."""
    if v is None:
        return None if spec.optional else _MISSING_CHECK
    got = spec.check(v)
    return _MISSING_CHECK if got is None else got


def check_value(spec: FieldSpec, v: Any) -> tuple[bool, Any]:
    """``(fits, value to store)``."""
    got = _checked(spec, v)
    return (False, None) if got is _MISSING_CHECK else (True, got)


def field_spec(annotation: Any) -> FieldSpec:
    """The checker of an annotation (ConfigurationError for one not accepted)."""
    if annotation is Any:
        return FieldSpec("Any", lambda v: v, optional=True)
    if annotation in _SCALARS:
        name, check = _SCALARS[annotation]
        return FieldSpec(name, check, scalar=annotation)
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1 and len(args) == 2:
            inner = field_spec(rest[0])
            return FieldSpec(
                f"{inner.describe} | None", inner.check, optional=True, scalar=inner.scalar
            )
        raise ConfigurationError(f"field type {annotation!r}: a union is accepted only as X | None")
    if annotation is list or origin is list:
        item = field_spec(args[0]) if args else field_spec(Any)
        return FieldSpec(f"list[{item.describe}]" if args else "list", _list_of(item))
    if annotation is dict or origin is dict:
        if args and args[0] is not str:
            raise ConfigurationError(f"field type {annotation!r}: dict keys must be str")
        value = field_spec(args[1]) if args else field_spec(Any)
        return FieldSpec(f"dict[str, {value.describe}]" if args else "dict", _dict_of(value))
    raise ConfigurationError(
        f"field type {annotation!r} is not one a table field may have (int, str, bytes, "
        "float, bool, datetime, date, list, dict, X | None, Any)"
    )
