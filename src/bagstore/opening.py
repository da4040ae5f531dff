"""How a :class:`bagstore.Datastore` opens: the set-up steps of its
constructor and of :func:`bagstore.open`, each given what it works on (this
module sits below the facade and never sees it).

* :func:`open_router`: the catalog's placement (created with the store), the
  shards it lists beyond those given (added later), and the router over them;
* :func:`prepare_kind`: every check and first-time step before a kind is
  served: the shards' stamps, their bucket ownership, the kind's placement
  options against the catalog's record, each server's body limit, a global
  kind's home, the kind's entities table on every shard;
* :func:`sqlite_store`: the shard files of an embedded store in a directory.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from bagstore.backends import check_identifier
from bagstore.catalog import Catalog, IndexCatalog, check_stamps
from bagstore.errors import ConfigurationError
from bagstore.names import check_new_kind
from bagstore.sharding.home import check_global, pin_home
from bagstore.sharding.router import Router

if TYPE_CHECKING:
    from bagstore.backends import Backend
    from bagstore.catalog import Placement
    from bagstore.sharding.topology import ShardOpener

__all__ = [
    "SQLITE_SHARD_FILE",
    "check_body_capacity",
    "open_router",
    "prepare_kind",
    "sqlite_store",
]

SQLITE_SHARD_FILE = "shard_{}.db"


def open_router(
    catalog: Catalog,
    names: Sequence[str],
    buckets: int | None,
    backends: list[Backend],
    opener: ShardOpener,
    *,
    refresh_interval: float,
    freeze_wait: float,
    parallel: bool | None,
    max_workers: int,
) -> tuple[Placement, Router]:
    """The store's placement (the catalog's, or a new one over ``names``) and
    a router over ``backends``, to which the shards the placement lists beyond
    them are appended (opened as listed)."""
    placement = catalog.open(names, buckets)
    for name in placement.shard_names[len(backends) :]:
        backends.append(opener.open_listed(name))
    router = Router(
        catalog,
        placement,
        backends,
        opener,
        refresh_interval=refresh_interval,
        freeze_wait=freeze_wait,
        parallel=parallel,
        max_workers=max_workers,
    )
    return placement, router


def prepare_kind(
    router: Router,
    placement: Placement,
    backends: Sequence[Backend],
    kind: str,
    *,
    shard_key: str | None,
    shard_map: str,
    global_at: str | None,
    max_body_bytes: int,
) -> None:
    """Check the shards and the kind's options, then ready the kind: raises
    ``ConfigurationError`` (or the catalog's errors) before anything of the
    kind is recorded if they do not fit."""
    catalog = router.catalog
    check_stamps(placement, backends)
    if catalog.read_meta().get("owned_init") != "1":
        for no, backend in enumerate(backends):
            backend.claim_buckets(placement.buckets_of_shard(no))
        catalog.set_meta("owned_init", "1")
    if shard_key is not None:
        check_identifier(shard_key, "shard_key")
    check_global(shard_map, shard_key, global_at)
    known = catalog.kinds()
    if kind not in known:  # a new kind: its name must be free (bagstore.names)
        check_new_kind(kind, known, IndexCatalog(catalog.backend).all_entries())
    recorded = catalog.register_kind(kind, shard_key or "", shard_map)
    if recorded != (shard_key or "", shard_map):
        raise ConfigurationError(
            f"kind {kind!r} is placed by {recorded[0] or 'id'!r} "
            f"({recorded[1]} map), not by {shard_key or 'id'!r} ({shard_map} map)"
        )
    for b in backends:
        ensure_limits = getattr(b, "ensure_limits", None)
        if ensure_limits is not None:
            ensure_limits()
            check_body_capacity(b, max_body_bytes)
    if shard_map == "global":  # one database, not sharded (docs/tables.md)
        pin_home(router, kind, global_at, max_body_bytes)
    router.on_all(lambda b: b.ensure_kind(kind))


def check_body_capacity(backend: Backend, max_body_bytes: int) -> None:
    """Refuse a shard whose server could not store a body of ``max_body_bytes``
    (MySQL: its ``max_allowed_packet``)."""
    if backend.max_body_bytes < max_body_bytes:
        raise ConfigurationError(
            f"shard {backend.name} stores bodies of at most {backend.max_body_bytes} "
            "bytes (what its server's max_allowed_packet carries, at most a MEDIUMBLOB), "
            f"under this store's max_body_bytes "
            f"of {max_body_bytes}: raise the server's max_allowed_packet to at least "
            f"{2 * max_body_bytes + 64 * 1024}, or give max_body_bytes="
            f"{backend.max_body_bytes} or less"
        )


#: the most files an embedded store is made with (they share one machine's disk)
MOST_SQLITE_SHARDS = 256


def sqlite_store(path: str | os.PathLike[str], shards: int | None) -> tuple[str, list[str]]:
    """The directory (created if missing) and the shard URLs of the embedded
    store at ``path``: ``shards`` files for a new store (default 4); an
    existing one keeps its number (asking for another is refused), and only
    its first file is named: its catalog lists its shards."""
    from bagstore.backends.sqlite import SQLiteBackend

    root = os.fspath(path)
    if shards is not None and (type(shards) is not int or not 1 <= shards <= MOST_SQLITE_SHARDS):
        raise ConfigurationError(
            f"shards must be an integer from 1 to {MOST_SQLITE_SHARDS} (SQLite files), "
            f"not {shards!r}"
        )
    os.makedirs(root, exist_ok=True)
    first = os.path.join(root, SQLITE_SHARD_FILE.format(0))
    existing: int | None = None
    if os.path.exists(first):
        probe = SQLiteBackend(first)
        try:
            existing = Catalog(probe).stored_shard_count()
        finally:
            probe.close()
    if existing is not None and shards is not None and shards != existing:
        raise ConfigurationError(
            f"the store in {root!r} has {existing} shards; {shards} were asked for"
        )
    # An existing store lists its shards (some maybe added later) in its catalog,
    # which lives in the first file: name only that one.
    count = 1 if existing else (shards or 4)
    return root, [SQLITE_SHARD_FILE.format(i) for i in range(count)]
