"""The index a query lacks: what :class:`~bagstore.NoIndexForQuery` suggests.

An index answers a query when the filters give equality (or ``__in``) on a
prefix of its properties and at most a range on the next one, which is also the
only property besides the equal ones that the query may order by.  So the index
a query needs lists each filtered property once: the equal ones first (plain
equality before ``__in``, so that ``shard_on``, the first, reads one shard), then
the ranged one, or else the ``order`` property.  Its table is named after the
properties, with a ``_2``, ``_3``... suffix when the name is taken by any index
(ready, building or retired, of any kind) or kind the catalog records.

A query that no index can answer (a range on two properties, ``order`` on a
third, more than ``MAX_PROPERTIES`` properties, a property name an index cannot
hold) gets :class:`~bagstore.InvalidQuery` saying why, not a suggestion.

    >>> from bagstore.query import parse_filters
    >>> exc = no_index(parse_filters({"score": 5, "score__gt": 6}), None, taken=["index_score"])
    >>> exc.command
    'bagstore index add index_score_2 --properties score'
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Sequence

from bagstore import names
from bagstore.errors import ConfigurationError, InvalidQuery, NoIndexForQuery
from bagstore.index import MAX_PROPERTIES, Index
from bagstore.query import Filter, plan_query

__all__ = ["command_for", "no_index"]

_EQUAL = ("eq", "in")


def no_index(
    filters: Sequence[Filter], order: str | None, *, taken: Iterable[str] = ()
) -> NoIndexForQuery | InvalidQuery:
    """The error for a query no ready index answers: ``NoIndexForQuery`` with the
    index that would (``.index``) and the command that adds it (``.command``),
    or ``InvalidQuery`` when no index could.  ``taken``: every kind and index
    table name the catalog records."""
    ops: dict[str, set[str]] = {}
    for f in filters:
        ops.setdefault(f.prop, set()).add(f.op)
    equal = sorted((p for p in ops if ops[p] & set(_EQUAL)), key=lambda p: ("eq" not in ops[p], p))
    ranged = sorted(p for p in ops if p not in equal)
    if len(ranged) > 1:
        return InvalidQuery(
            f"no index can answer this query: it gives ranges on {ranged}, and an index "
            "answers equality on some properties and a range on one more; give the others "
            "by equality, or filter on them in your own code"
        )
    ordered = None
    if isinstance(order, str):
        ordered = order[1:] if order.startswith("-") else order
    if ranged and ordered is not None and ordered not in equal and ordered != ranged[0]:
        return InvalidQuery(
            f"no index can answer this query: it gives a range on {ranged[0]!r}, so its "
            f"results come in the order of {ranged[0]!r}, not of {ordered!r}"
        )
    tail = ranged or ([ordered] if ordered is not None and ordered not in equal else [])
    props = equal + tail
    if len(props) > MAX_PROPERTIES:
        return InvalidQuery(
            f"no index can answer this query: it needs {len(props)} properties {props}, "
            f"and an index has at most {MAX_PROPERTIES}"
        )
    try:
        index = Index(table=_free_name(props, taken), properties=props)
        plan_query(index, list(filters), order)  # the suggestion must answer
    except (ConfigurationError, InvalidQuery) as exc:
        return InvalidQuery(f"no index can answer this query: {exc}")
    command = command_for(index)
    return NoIndexForQuery(
        f"no ready index answers this query; add one with: {command}",
        suggestion=repr(index),
        index=index,
        command=command,
    )


def command_for(index: Index) -> str:
    """The ``bagstore index add`` command line that registers ``index``."""
    words = ["bagstore", "index", "add", index.table, "--properties", ",".join(index.properties)]
    if index.shard_on != index.properties[0]:
        words += ["--shard-on", index.shard_on]
    if index.unique:
        words.append("--unique")
    return shlex.join(words)


def _free_name(props: Sequence[str], taken: Iterable[str]) -> str:
    """``index_<props>``, cut to fit and with a ``_N`` suffix when taken.

    Raises ``ConfigurationError`` when a property cannot be indexed (reserved or
    not an identifier), so that no index could answer."""
    base = re.sub("_+", "_", "index_" + "_".join(props)).rstrip("_")
    used = {name.lower() for name in taken}
    for n in range(1, 10_000):
        suffix = "" if n == 1 else f"_{n}"
        name = base[: names.MAX_NAME - len(suffix)].rstrip("_") + suffix
        if name.lower() not in used:
            return names.check_name(name, "index table name")
    raise ConfigurationError(f"no free index table name starting with {base!r}")  # pragma: no cover
