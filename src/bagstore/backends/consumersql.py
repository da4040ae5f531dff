"""SQL of a change feed's catalog tables: each kind's feed settings, each
named consumer, its bucket ranges (positions and leases) and its live
processes (:mod:`bagstore.subscriber`); the feed's epoch."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bagstore.backends.base import Backend, Dialect

__all__ = ["bump_epoch", "checkpoint_ranges", "create_feed_catalog", "renew_leases"]


def _mysql(d: Dialect) -> bool:
    return d.name == "mysql"


def _suffix(d: Dialect) -> str:
    return " ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin" if _mysql(d) else ""


def create_feed_catalog(backend: Backend) -> None:
    """The catalog's feed tables: each kind's feed settings, each named
    consumer, its bucket ranges (positions and leases) and its live processes."""
    d = backend.dialect
    s = _suffix(d)
    text = "MEDIUMTEXT" if _mysql(d) else "TEXT"
    backend._executescript(
        [
            "CREATE TABLE IF NOT EXISTS bagstore_feeds (kind VARCHAR(64) NOT NULL PRIMARY KEY, "
            "bodies INTEGER NOT NULL, max_age BIGINT NOT NULL, max_changes BIGINT NOT NULL)" + s,
            "CREATE TABLE IF NOT EXISTS bagstore_consumers (name VARCHAR(64) NOT NULL "
            "PRIMARY KEY, kind VARCHAR(64) NOT NULL, ranges INTEGER NOT NULL, "
            "created BIGINT NOT NULL)" + s,
            "CREATE TABLE IF NOT EXISTS bagstore_consumer_ranges (name VARCHAR(64) NOT NULL, "
            f"range_no INTEGER NOT NULL, positions {text} NOT NULL, owner VARCHAR(64) NOT NULL, "
            "lease_until BIGINT NOT NULL, checkpointed BIGINT NOT NULL, "
            "PRIMARY KEY (name, range_no))" + s,
            "CREATE TABLE IF NOT EXISTS bagstore_consumer_members (name VARCHAR(64) NOT NULL, "
            "member VARCHAR(64) NOT NULL, seen BIGINT NOT NULL, PRIMARY KEY (name, member))" + s,
        ]
    )


def renew_leases(
    catalog: Backend, name: str, member: str, ranges: Sequence[int], until: int
) -> int:
    """Move the leases of consumer ``name``'s ``ranges`` that ``member``
    holds on to ``until`` (µs), one statement; the number renewed."""
    p = catalog.dialect.param
    return catalog.execute(
        f"UPDATE bagstore_consumer_ranges SET lease_until = {p} WHERE name = {p} "
        f"AND owner = {p} AND range_no IN ({', '.join([p] * len(ranges))})",
        [until, name, member, *ranges],
    )


def checkpoint_ranges(
    catalog: Backend,
    name: str,
    member: str,
    done: dict[int, str],
    at: int,
    renew: Sequence[int],
    until: int,
) -> int:
    """One statement: of consumer ``name``'s ranges that ``member`` holds, the
    checkpoints ``done`` (``{range: positions text}``, checkpointed at ``at``
    µs) and the leases of those ranges and of ``renew`` moved on to
    ``until`` (µs); the number of rows written (fewer when a lease was lost)."""
    ranges = sorted(set(done) | set(renew))
    params: list[Any] = []
    for no, text in done.items():
        params += [no, text]
    if done:
        params += [*done, at]
    params += [until, name, member, *ranges]
    return catalog.execute(_checkpoint_text(catalog.dialect.param, len(done), len(ranges)), params)


@functools.lru_cache(maxsize=256)
def _checkpoint_text(p: str, done: int, ranges: int) -> str:
    """:func:`checkpoint_ranges`' statement for ``done`` checkpoints and
    ``ranges`` ranges in all (made once: a consumer writes one a batch)."""
    sets = [f"lease_until = {p}"]
    if done:
        texts = " ".join([f"WHEN {p} THEN {p}"] * done)
        sets = [
            f"positions = CASE range_no {texts} ELSE positions END",
            f"checkpointed = CASE WHEN range_no IN ({', '.join([p] * done)}) "
            f"THEN {p} ELSE checkpointed END",
            *sets,
        ]
    return (
        f"UPDATE bagstore_consumer_ranges SET {', '.join(sets)} WHERE name = {p} "
        f"AND owner = {p} AND range_no IN ({', '.join([p] * ranges)})"
    )


def bump_epoch(catalog: Backend) -> int:
    """Move the feed's epoch (every kind's) on by one in the catalog's
    ``bagstore_meta``; the new epoch.  An unplanned failover calls it
    (:mod:`bagstore.sharding.failover`): the old primary may have committed
    changes that a consumer read and no replica received."""
    rows = catalog.select_all("bagstore_meta", ("value",), {"name": "feed_epoch"})
    epoch = (int(rows[0][0]) if rows else 0) + 1
    catalog.upsert("bagstore_meta", {"name": "feed_epoch"}, {"value": str(epoch)})
    return epoch
