"""Where a global kind lives: one database, not sharded (Yupoo's global database).

A kind opened with ``shard_map="global"`` is not spread over the shards: all
its entities and index rows live in one database, its *home*.  ``global_at``
names it (a URL); by default it is a database beside the catalog: on the
catalog's MySQL server, the catalog's database name followed by ``_global``;
for SQLite files, ``global.db`` in the catalog file's directory.  The catalog
records each global kind's home (the first opener's wins), so every process
of the store uses the same one.

The home is stamped as the store's global database (shard number ``-1``: no
shard of the store can be taken for it) and holds every bucket as owned, so
the fenced writes of a shard succeed there unchanged; the router of a global
kind is pinned to it (:meth:`bagstore.sharding.router.Router.pin`).  Bucket
moves go between the placement's shards, which the home is not one of: they
never move a global kind's rows.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from bagstore.errors import ConfigurationError

if TYPE_CHECKING:
    from bagstore.backends import Backend
    from bagstore.sharding.router import Router

__all__ = ["GLOBAL_SHARD", "SHARD_MAPS", "check_global", "default_home", "pin_home"]

#: The shard number a global kind's home is stamped with.
GLOBAL_SHARD = -1
#: The catalog's ``bagstore_meta`` row naming a global kind's home: prefix + kind.
META_PREFIX = "global_home:"


#: how a kind's entities are placed: by a hash of the id or the shard key, by the
#: directory of shard keys, or in one database (docs/tables.md)
SHARD_MAPS = ("hash", "directory", "global")


def check_global(shard_map: object, shard_key: str | None, global_at: object) -> None:
    """Refuse a kind's placement options that are not known or do not fit
    together, before anything is recorded (a kind's map, once recorded, is
    the kind's for good)."""
    if not isinstance(shard_map, str) or shard_map not in SHARD_MAPS:
        raise ConfigurationError(f"shard_map must be one of {SHARD_MAPS}, not {shard_map!r}")
    if shard_map == "directory" and shard_key is None:
        raise ConfigurationError("shard_map='directory' needs a shard_key")
    if shard_map == "global":
        if shard_key is not None:
            raise ConfigurationError(
                f"a global kind (shard_map='global') is not sharded: it takes no shard_key "
                f"(got {shard_key!r})"
            )
        if global_at is not None and (not isinstance(global_at, str) or not global_at):
            raise ConfigurationError(f"global_at must be a database URL, not {global_at!r}")
    elif global_at is not None:
        raise ConfigurationError("global_at is only for global kinds (shard_map='global')")


def default_home(catalog: Backend) -> str:
    """The URL of the default home: a database beside the catalog's."""
    if catalog.dialect.name == "sqlite":
        path = getattr(catalog, "path", ":memory:")
        if path == ":memory:":
            raise ConfigurationError(
                "a global kind of a store whose catalog is in memory needs global_at=URL"
            )
        return "sqlite:///" + os.path.join(os.path.dirname(os.path.abspath(path)), "global.db")
    server, _, database = catalog.name.rpartition("/")
    return f"{server}/{database}_global"


def _open(router: Router, name: str) -> Backend:
    opener = router.opener
    if "://" in name or name.startswith("sqlite:"):
        return opener.open(name)
    return opener.open_listed(name)


def pin_home(router: Router, kind: str, global_at: str | None, max_body_bytes: int) -> Backend:
    """Open (and prepare) the home of global kind ``kind`` and pin ``router``
    to it; the shards' backends it no longer needs are closed."""
    catalog = router.catalog
    key = META_PREFIX + kind
    backend = _open(router, global_at or default_home(catalog.backend))
    try:
        name = router.opener.listed_name(backend.name)
        catalog.backend.insert_ignore("bagstore_meta", ("name", "value"), [(key, name)])
        recorded = catalog.read_meta()[key]
        if recorded != name:
            if global_at is not None:
                raise ConfigurationError(
                    f"global kind {kind!r} lives in {recorded}, not in {name} (global_at)"
                )
            backend.close()
            backend = _open(router, recorded)
            name = recorded
        store_id = router.placement.store_id
        store, shard = backend.stamp(store_id, GLOBAL_SHARD)
        if store != store_id or shard != GLOBAL_SHARD:
            what = "the global database" if shard == GLOBAL_SHARD else f"shard {shard}"
            raise ConfigurationError(
                f"database {name} is {what} of store {store}: it cannot be the home of "
                f"global kind {kind!r} of store {store_id}"
            )
        buckets = router.placement.buckets
        if len(backend.bucket_states()) != buckets:
            backend.claim_buckets(range(buckets))
        ensure_limits = getattr(backend, "ensure_limits", None)
        if ensure_limits is not None:
            ensure_limits()
        if backend.max_body_bytes < max_body_bytes:
            raise ConfigurationError(
                f"database {name} stores bodies of at most {backend.max_body_bytes} bytes, under "
                f"this store's max_body_bytes of {max_body_bytes}"
            )
    except BaseException:
        backend.close()
        raise
    for unused in router.pin(backend):
        unused.close()
    return backend
