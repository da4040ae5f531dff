"""Opening a datastore from a TOML file.

A store of SQLite files::

    [bagstore]
    path = "data/"      # relative to the config file
    shards = 4

A sharded MariaDB/MySQL store::

    [bagstore]
    shards = ["mysql://app:secret@db1:3306/app_0", "mysql://app:secret@db2:3306/app_1"]
    catalog = "mysql://app:secret@db1:3306/app_catalog"   # optional
    sequence_servers = ["mysql://app@ids1:3306/ids", "mysql://app@ids2:3306/ids"]  # optional
    buckets = 1024                                         # fixed at creation
    kind = "entities"
    read_timeout = 30                                      # seconds (MySQL shards)

    [[bagstore.index]]
    table = "index_user_id"
    properties = ["user_id"]
    shard_on = "user_id"

A shard (or the catalog) with replicas, as a table or in its URL (the same;
docs/replication.md)::

    [bagstore]
    shards = [
        { url = "mysql://app@db1:3306/app_0", replicas = ["db1r:3306", "db1s:3306"] },
        "mysql://app@db2:3306/app_1?replica=db2r:3306",
    ]
    read_from = "replica"   # or "primary" (the default)
    max_lag = 5             # seconds; replicas further behind are not read

Passwords may be left out of the URLs and given in ``BAGSTORE_MYSQL_PASSWORD``.
"""

from __future__ import annotations

import os
import tomllib
from typing import TYPE_CHECKING, Any

from bagstore.errors import ConfigurationError

if TYPE_CHECKING:
    from bagstore.datastore import Datastore

__all__ = ["load_config", "read_config"]

_KNOWN = {
    "path", "shards", "catalog", "buckets", "kind", "shard_key", "shard_map", "global_at", "index",
    "mysql_user", "mysql_password", "mysql_database", "sqlite_synchronous", "sequence_servers",
    "connect_timeout", "read_timeout", "write_timeout", "bulk_timeout", "max_body_bytes",
    "read_from", "max_lag",
}  # fmt: skip


def read_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``[bagstore]`` table of a TOML file, checked; relative paths resolved."""
    try:
        with open(path, "rb") as fh:
            doc = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigurationError(f"config file {os.fspath(path)!r} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigurationError(
            f"config file {os.fspath(path)!r} is not valid TOML: {exc}"
        ) from exc
    except UnicodeDecodeError as exc:  # TOML is UTF-8
        raise ConfigurationError(
            f"config file {os.fspath(path)!r} is not UTF-8 text: byte {exc.start} ({exc.reason})"
        ) from None
    section = doc.get("bagstore")
    if not isinstance(section, dict):
        raise ConfigurationError(f"config file {os.fspath(path)!r} has no [bagstore] table")
    unknown = set(section) - _KNOWN
    if unknown:
        raise ConfigurationError(
            f"unknown key(s) {sorted(unknown)} in [bagstore] of {os.fspath(path)!r}"
        )
    if "path" in section:
        if not isinstance(section["path"], str) or not section["path"]:
            raise ConfigurationError(
                f"path in [bagstore] of {os.fspath(path)!r} must be a directory name (a string), "
                f"not {section['path']!r}"
            )
        base = os.path.dirname(os.path.abspath(path))
        section["path"] = os.path.join(base, str(section["path"]))
    return section


def indexes_from_config(section: dict[str, Any]) -> list[Any]:
    from bagstore.index import Index

    out = []
    specs = section.get("index", [])
    if not isinstance(specs, list):
        raise ConfigurationError(
            "indexes are declared as [[bagstore.index]] tables (an array of tables), "
            f"not index = {specs!r}"
        )
    for spec in specs:
        if not isinstance(spec, dict):
            raise ConfigurationError("each [[bagstore.index]] must be a table")
        try:
            out.append(Index(**spec))
        except TypeError as exc:
            raise ConfigurationError(f"bad [[bagstore.index]] {spec!r}: {exc}") from None
    return out


def load_config(path: str | os.PathLike[str], **overrides: Any) -> Datastore:
    """Open the datastore a config file describes; ``overrides`` are keyword
    arguments of :class:`~bagstore.Datastore` that win over the file (such as
    ``kind=`` to open another kind of the same store)."""
    from bagstore.datastore import Datastore, open

    section = read_config(path)
    indexes = indexes_from_config(section)
    options: dict[str, Any] = {
        k: section[k]
        for k in ("catalog", "buckets", "kind", "shard_key", "shard_map", "global_at", "mysql_user",
                  "mysql_password", "mysql_database", "sqlite_synchronous", "sequence_servers",
                  "connect_timeout", "read_timeout", "write_timeout", "bulk_timeout",
                  "max_body_bytes", "read_from", "max_lag")
        if k in section
    }  # fmt: skip
    if "catalog" in options:
        options["catalog"] = shard_url(options["catalog"])
    options.update(overrides)
    seq = section.get("sequence_servers", [])
    if not isinstance(seq, list) or not all(isinstance(u, str) for u in seq):
        raise ConfigurationError('sequence_servers must be a list of URLs: ["mysql://...", ...]')
    if "path" in section:
        shards = section.get("shards")
        if shards is not None and not isinstance(shards, int):
            raise ConfigurationError("with path =, shards is a number of SQLite files")
        return open(section["path"], indexes=indexes, shards=shards, **options)
    shards = section.get("shards")
    if not isinstance(shards, list):
        raise ConfigurationError('[bagstore] needs path = "dir/" or shards = ["url", ...]')
    return Datastore([shard_url(u) for u in shards], indexes=indexes, **options)


def shard_url(entry: object) -> str:
    """A shard as configured: its URL, or ``{url = "...", replicas = [...]}``
    (the same URL with a ``replica=`` option per replica)."""
    if isinstance(entry, str):
        return entry
    if not isinstance(entry, dict) or not isinstance(entry.get("url"), str):
        raise ConfigurationError(
            f'a shard is a URL or {{ url = "...", replicas = ["host:port", ...] }}, not {entry!r}'
        )
    unknown = set(entry) - {"url", "replicas"}
    replicas = entry.get("replicas", [])
    if unknown or not isinstance(replicas, list) or not all(isinstance(r, str) for r in replicas):
        raise ConfigurationError(
            f"bad shard {entry!r}: only url and replicas (a list of host:port) are known"
        )
    url = str(entry["url"])
    if replicas and url.startswith("sqlite:"):
        raise ConfigurationError(f"SQLite shard {url!r} cannot have replicas")
    options = "&".join(f"replica={r}" for r in replicas)
    return url + ("&" if "?" in url else "?") + options if options else url
