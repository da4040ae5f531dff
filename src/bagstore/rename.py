"""Forgetting and renaming indexes without ever touching a table that is not theirs.

``Datastore.drop_index`` and ``Datastore.rename_index`` are here.  A store made
before :mod:`bagstore.names` may hold an index registered under the name of a
kind's entities table (``Index(table="photos")`` when kind ``photos`` exists, or
``Index(table="entities")``): its "table" is the kind's, so

* dropping it removes its catalog registration only: a table is dropped only if
  the catalog still records it as this retired index's just before the
  ``DROP``, and the table on that shard has exactly the index's columns (an
  entities table never has: it has no ``entity_id``, an index may not have an
  ``id`` property); a ``bagstore_`` name is never dropped;
* renaming it registers the same index under a new, free name (``building``),
  backfills it with the Cleaner from the kind's entities, then retires the old
  registration and forgets it as above.  Nothing is written to, deleted from or
  dropped from the kind's table at any step.

    >>> # ds.rename_index("photos", "index_photos_t")   # -> "ready"
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from bagstore import names
from bagstore.catalog import Checkpoints
from bagstore.errors import ConfigurationError
from bagstore.index import BUILDING, RETIRED, Index

if TYPE_CHECKING:
    from bagstore.backends import Backend
    from bagstore.datastore import Datastore

__all__ = ["forget_index", "rename_index"]


def _entry(ds: Datastore, table: str) -> tuple[str, str] | None:
    """``(definition, state)`` the catalog records for index ``table`` of this kind."""
    for name, definition, state in ds.index_catalog.entries(ds.kind):
        if name == table:
            return definition, state
    return None


def _registered(ds: Datastore, table: str) -> tuple[Index, str]:
    entry = _entry(ds, table)
    if entry is None:
        raise ConfigurationError(f"no index {table!r} on kind {ds.kind!r}")
    return Index.from_json(entry[0]), entry[1]


def forget_index(ds: Datastore, table: str) -> None:
    """Drop a retired index's own tables (see the module docstring) and remove
    its registration."""
    index, state = _registered(ds, table)
    if state != RETIRED:
        raise ConfigurationError(f"index {table!r} is {state}: retire it before dropping it")
    recorded = _entry(ds, table)
    if not table.lower().startswith(names.RESERVED_PREFIX):

        def drop(b: Backend) -> bool:
            if _entry(ds, table) != recorded:  # the catalog's record, again, before each DROP
                return False
            dropped = b.drop_index_table(table, index.properties, index.unique)
            b.after_bulk_step()  # freeing a large table's pages is bulk work too
            return dropped

        ds.router.on_all(drop)
    ds.index_catalog.remove(table)
    Checkpoints(ds.router.catalog_backend).clear(f"backfill:{ds.kind}:{table}:")
    ds.index_tables.tables_ready.discard(table)
    ds.index_tables.clashing.discard(table)
    ds.cache_layer.index_changed(table)
    ds.registry(refresh=True)


def rename_index(ds: Datastore, old: str, new: str, *, settle: float | None = None) -> str:
    """See ``Datastore.rename_index``.  Safe to run again after a crash: the new
    index is registered once (same definition), the backfill resumes."""
    from bagstore.cleaner import Cleaner

    index, state = _registered(ds, old)
    if state == RETIRED:
        raise ConfigurationError(
            f"index {old!r} is retired: drop it (bagstore index drop {old}), or add the "
            "index again under the new name"
        )
    if new == old:
        raise ConfigurationError(f"index {old!r}: the new name is the old one")
    definition = index.definition()
    definition["table"] = new
    renamed = Index(**definition)  # the declaration rules for the new name
    new_state = ds.add_index(renamed)  # refuses a name in use; creates, registers
    if new_state == BUILDING:
        Cleaner(ds, settle=settle).backfill(new)
        new_state = ds.registry(refresh=True).state(new) or BUILDING
    ds.index_catalog.set_state(old, RETIRED, time.time_ns() // 1000)
    ds.cache_layer.index_changed(old)
    forget_index(ds, old)
    return new_state
