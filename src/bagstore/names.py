"""The namespace of tables: kinds, index tables and bagstore's own tables.

Every table bagstore makes lives in one namespace per database, so three sorts
of names must never meet:

* bagstore's own tables (catalog, ownership, lookups, sequences, tickets) all
  start with ``bagstore_``: :data:`RESERVED_PREFIX` is refused for kinds and
  index tables;
* a kind's tables: its entities table ``<kind>`` and the names derived from
  it, ``<kind>__<suffix>`` (SQLite's ``<kind>__bucket`` and ``<kind>__updated``
  today, room for more later);
* an index's tables: ``<table>`` and ``<table>__<suffix>`` (SQLite's
  ``<table>__bucket`` and ``<table>__entity_id``).

So a new kind or index table name is a plain identifier of at most
:data:`MAX_NAME` characters (a suffix of up to 23 characters still fits the
64-character limit of MariaDB and MySQL), holds no ``__`` (derived names are
``<name>__<suffix>``, so they can never equal another kind's or index's name)
and differs, ignoring case (SQLite and some MySQL servers ignore it), from every
kind and index table the catalog records.  Names recorded before these rules
are kept: a store holding a clash still opens, :func:`clashes` lists it (in
``Datastore.check()``) and ``Datastore.rename_index`` resolves it.

    >>> check_name("photos", "kind")
    'photos'
    >>> kind_tables("photos")
    ('photos', 'photos__bucket', 'photos__updated')
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from bagstore.backends import check_identifier
from bagstore.errors import ConfigurationError

__all__ = [
    "MAX_NAME",
    "RESERVED_PREFIX",
    "check_name",
    "check_new_index",
    "check_new_kind",
    "clashes",
    "index_tables",
    "kind_tables",
    "table_clash",
]

#: bagstore's own tables start with this; no kind or index table may.
RESERVED_PREFIX = "bagstore_"
#: Longest new kind or index table name: room for ``__<suffix>`` within 64.
MAX_NAME = 40
#: Derived names are ``<name>__<suffix>``.
SEPARATOR = "__"


def kind_tables(kind: str) -> tuple[str, ...]:
    """Every table (and SQLite index) name bagstore makes for a kind."""
    return (kind, f"{kind}__bucket", f"{kind}__updated")


def index_tables(table: str) -> tuple[str, ...]:
    """Every table (and SQLite index) name bagstore makes for an index."""
    return (table, f"{table}__bucket", f"{table}__entity_id")


def check_name(name: object, what: str) -> str:
    """``name`` if it is acceptable for a new kind or index table (``what``
    says which), else ``ConfigurationError``."""
    check_identifier(name, what)
    assert isinstance(name, str)
    if name.lower().startswith(RESERVED_PREFIX):
        raise ConfigurationError(
            f"{what} {name!r}: the {RESERVED_PREFIX} prefix is reserved for bagstore's own tables"
        )
    if SEPARATOR in name:
        raise ConfigurationError(
            f"{what} {name!r}: '{SEPARATOR}' is reserved for the names bagstore derives "
            f"from kinds and index tables (<name>{SEPARATOR}<suffix>)"
        )
    if len(name) > MAX_NAME:
        raise ConfigurationError(
            f"{what} {name!r} is {len(name)} characters long: at most {MAX_NAME}, so that the "
            f"tables derived from it (<name>{SEPARATOR}<suffix>) fit the 64-character limit"
        )
    return name


def _same(a: str, b: str) -> bool:
    return a.lower() == b.lower()


def check_new_kind(
    kind: str, kinds: Iterable[str], indexes: Iterable[tuple[str, str, str, str]]
) -> None:
    """Refuse a kind the catalog does not record yet whose name is not allowed
    or meets a recorded kind (ignoring case) or index table.  ``indexes`` are
    :meth:`IndexCatalog.all_entries` rows ``(name, kind, definition, state)``."""
    check_name(kind, "kind")
    for other in kinds:
        if _same(other, kind) and other != kind:
            raise ConfigurationError(
                f"kind {kind!r} clashes with kind {other!r}: table names that differ only "
                "in case are one table on SQLite and on some MySQL servers"
            )
    for name, owner, _, _ in indexes:
        if _same(name, kind):
            raise ConfigurationError(
                f"kind {kind!r} clashes with index table {name!r} of kind {owner!r}: a kind "
                "and an index table cannot share a name; choose another kind name"
            )


def check_new_index(
    table: str, kind: str, kinds: Iterable[str], indexes: Iterable[tuple[str, str, str, str]]
) -> None:
    """Refuse a new index table of ``kind`` whose name is not allowed or meets
    a recorded kind or (ignoring case) another index table."""
    check_name(table, "index table name")
    for other in kinds:
        if _same(other, table):
            raise ConfigurationError(
                f"index table {table!r} (kind {kind!r}) clashes with kind {other!r}: the "
                f"index would use the entities table of {other!r}; choose another table name"
            )
    for name, owner, _, _ in indexes:
        if _same(name, table) and name != table:
            raise ConfigurationError(
                f"index table {table!r} (kind {kind!r}) clashes with index table {name!r} "
                f"of kind {owner!r}: names that differ only in case are one table on SQLite"
            )


def table_clash(table: str, kinds: Iterable[str]) -> str | None:
    """What, besides an index, owns table name ``table``: a sentence, or None."""
    if table.lower().startswith(RESERVED_PREFIX):
        return f"the {RESERVED_PREFIX} prefix of bagstore's own tables"
    for kind in kinds:
        if _same(kind, table):
            return f"the entities table of kind {kind!r}"
    return None


def clashes(
    kinds: Sequence[str], indexes: Sequence[tuple[str, str, str, str]]
) -> list[dict[str, Any]]:
    """Every name the catalog records that meets another, made before these
    rules: ``{"name", "sort" ("index" or "kind"), "kind", "with", "remedy"}``."""
    out: list[dict[str, Any]] = []
    for name, owner, _, state in sorted(indexes):
        what = table_clash(name, kinds)
        if what is None:
            what = next(
                (
                    f"index table {other!r} of kind {k!r}"
                    for other, k, _, _ in indexes
                    if other != name and _same(other, name)
                ),
                None,
            )
        if what is not None:
            out.append(
                {
                    "name": name,
                    "sort": "index",
                    "kind": owner,
                    "state": state,
                    "with": what,
                    "remedy": f"bagstore index rename {name} NEW_NAME (kind {owner})",
                }
            )
    for kind in sorted(kinds):
        what = None
        if kind.lower().startswith(RESERVED_PREFIX):
            what = f"the {RESERVED_PREFIX} prefix of bagstore's own tables"
        else:
            what = next(
                (f"kind {k!r}" for k in kinds if k != kind and _same(k, kind)),
                None,
            )
        if what is not None:
            out.append(
                {
                    "name": kind,
                    "sort": "kind",
                    "kind": kind,
                    "with": what,
                    "remedy": "copy its entities to a kind of another name",
                }
            )
    return out
