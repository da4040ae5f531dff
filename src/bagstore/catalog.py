"""The catalog: the small metadata store every process of a datastore shares.

It lives on the first shard unless a ``catalog=`` URL names another database,
and holds the bucket count (fixed at creation), the list of shards and the
bucket -> shard placement.  Later capabilities add index definitions and
states, sequences and Cleaner checkpoints here.

Initialisation is safe when several processes open a new store at once: rows are
inserted with "insert unless present" and read back, so every process ends up
with the same bucket count and placement.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

from bagstore.backends import Backend
from bagstore.errors import ConfigurationError

__all__ = ["DEFAULT_BUCKETS", "Catalog", "Placement"]

DEFAULT_BUCKETS = 1024
FORMAT = "1"


@dataclass(frozen=True)
class Placement:
    """Bucket count, shard names and which shard holds each bucket."""

    buckets: int
    shard_names: tuple[str, ...]
    shard_of_bucket: tuple[int, ...]
    store_id: str = ""
    version: int = 0

    def buckets_of_shard(self, shard_no: int) -> list[int]:
        return [b for b, s in enumerate(self.shard_of_bucket) if s == shard_no]


def even_placement(buckets: int, shards: int) -> list[int]:
    """Contiguous, even ranges: bucket b goes to shard ``b * shards // buckets``."""
    return [b * shards // buckets for b in range(buckets)]


def _where(name: str) -> str:
    """The part of a shard name that must match on reopen: host, port and
    database (or the file), not the user."""
    _, sep, rest = name.partition("://")
    return rest.rsplit("@", 1)[-1] if sep else name


def check_stamps(placement: Placement, backends: Sequence[Backend]) -> None:
    """Every shard database must be the shard the catalog says, of this store:
    a reordered or mixed-up shard list is refused before anything is written."""
    for no, backend in enumerate(backends):
        store, stamped = backend.stamp(placement.store_id, no)
        if store != placement.store_id or stamped != no:
            raise ConfigurationError(
                f"database {backend.name} is shard {stamped} of store {store}, but was given "
                f"as shard {no} of store {placement.store_id} (check the order of the shards "
                "and the catalog this catalog names)"
            )


class Catalog:
    """Reads and writes the catalog tables through one backend."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def read_meta(self) -> dict[str, str]:
        return {
            str(k): str(v) for k, v in self.backend.select_all("bagstore_meta", ("name", "value"))
        }

    def stored_shard_count(self) -> int | None:
        """How many shards an existing store has, or None for a new store."""
        self.backend.create_catalog()
        rows = self.backend.select_all("bagstore_shards", ("shard_no",))
        return len(rows) or None

    def open(self, shard_names: Sequence[str], buckets: int | None) -> Placement:
        """Create or read the placement; check the shards given match the store's."""
        if buckets is not None and (type(buckets) is not int or not 1 <= buckets <= 65536):
            raise ConfigurationError(f"buckets must be an integer from 1 to 65536, not {buckets!r}")
        if not shard_names:
            raise ConfigurationError("a datastore needs at least one shard")
        b = self.backend
        b.create_catalog()
        meta = self.read_meta()
        if "buckets" not in meta:
            count = buckets or DEFAULT_BUCKETS
            if count < len(shard_names):
                raise ConfigurationError(
                    f"{count} buckets cannot be spread over {len(shard_names)} shards"
                )
            b.insert_ignore(
                "bagstore_meta",
                ("name", "value"),
                [("format", FORMAT), ("store_id", secrets.token_hex(8))],
            )
            b.insert_ignore("bagstore_shards", ("shard_no", "name"), list(enumerate(shard_names)))
            b.insert_ignore(
                "bagstore_buckets",
                ("bucket", "shard_no"),
                list(enumerate(even_placement(count, len(shard_names)))),
            )
            # Written last: a store whose meta has "buckets" is fully initialised.
            b.insert_ignore("bagstore_meta", ("name", "value"), [("buckets", str(count))])
            meta = self.read_meta()
        stored_buckets = int(meta["buckets"])
        if buckets is not None and buckets != stored_buckets:
            raise ConfigurationError(
                f"this store was created with {stored_buckets} buckets; {buckets} were asked for "
                "(the bucket count is fixed at creation)"
            )
        placement = self.read_placement(meta)
        stored = list(placement.shard_names)
        given = list(shard_names)
        # Shards added later (bagstore shard add) are opened from the catalog, so
        # a configuration may list only the first ones.
        if len(given) > len(stored) or any(
            _where(s) != _where(g) for s, g in zip(stored, given, strict=False)
        ):
            raise ConfigurationError(
                f"the catalog of this store lists shards {stored}, but {given} were given "
                "(the same databases in the same order expected)"
            )
        return placement

    def read_placement(self, meta: dict[str, str] | None = None) -> Placement:
        """The placement as the catalog holds it now."""
        b = self.backend
        meta = meta if meta is not None else self.read_meta()
        stored_buckets = int(meta["buckets"])
        stored = [str(n) for _, n in sorted(b.select_all("bagstore_shards", ("shard_no", "name")))]
        shards = b.int_column("bagstore_buckets", "bucket", "shard_no")
        if shards is None or len(shards) != stored_buckets:
            found = "some" if shards is None else f"{len(shards)}"
            raise ConfigurationError(
                f"the catalog's placement is incomplete ({found} of {stored_buckets} buckets)"
            )
        shard_of = tuple(shards)
        if any(not 0 <= s < len(stored) for s in shard_of):
            raise ConfigurationError("the catalog's placement names a shard that does not exist")
        return Placement(
            stored_buckets,
            tuple(stored),
            shard_of,
            meta["store_id"],
            int(meta.get("placement_version", "0")),
        )

    def shards_of(self, buckets: Sequence[int]) -> dict[int, int]:
        """``{bucket: shard}`` of a few buckets as the catalog holds them now."""
        out: dict[int, int] = {}
        for b in buckets:
            rows = self.backend.select_all("bagstore_buckets", ("shard_no",), {"bucket": b})
            if rows:
                out[b] = int(rows[0][0])
        return out

    def placement_version(self) -> int:
        rows = self.backend.select_all("bagstore_meta", ("value",), {"name": "placement_version"})
        return int(rows[0][0]) if rows else 0

    def set_meta(self, name: str, value: str) -> None:
        self.backend.upsert("bagstore_meta", {"name": name}, {"value": value})

    def add_shard(self, name: str) -> int:
        """Register a new shard after the others; return its number."""
        stored = self.backend.select_all("bagstore_shards", ("shard_no", "name"))
        for no, existing in stored:
            if _where(str(existing)) == _where(name):
                return int(no)
        no = len(stored)
        self.backend.insert_ignore("bagstore_shards", ("shard_no", "name"), [(no, name)])
        self.set_meta("placement_version", str(self.placement_version() + 1))
        return no

    def set_bucket(self, bucket: int, shard_no: int) -> None:
        """Point a bucket at another shard (the switch of a move)."""
        self.backend.update("bagstore_buckets", {"shard_no": shard_no}, {"bucket": bucket})
        self.set_meta("placement_version", str(self.placement_version() + 1))

    def register_kind(self, kind: str, shard_key: str, shard_map: str) -> tuple[str, str]:
        """Record how a kind is placed (first opener wins); return what is recorded."""
        self.backend.insert_ignore(
            "bagstore_kinds", ("kind", "shard_key", "shard_map"), [(kind, shard_key, shard_map)]
        )
        rows = self.backend.select_all("bagstore_kinds", ("shard_key", "shard_map"), {"kind": kind})
        return str(rows[0][0]), str(rows[0][1])

    def placements(self) -> dict[str, tuple[str, str]]:
        """``{kind: (shard_key, shard_map)}`` of every kind, as recorded."""
        rows = self.backend.select_all("bagstore_kinds", ("kind", "shard_key", "shard_map"))
        return {str(k): (str(key), str(m)) for k, key, m in rows}

    def kinds(self) -> list[str]:
        return sorted(str(k) for (k,) in self.backend.select_all("bagstore_kinds", ("kind",)))

    def global_kinds(self) -> set[str]:
        """Kinds kept in one database (``shard_map='global'``), out of every bucket move."""
        rows = self.backend.select_all("bagstore_kinds", ("kind",), {"shard_map": "global"})
        return {str(k) for (k,) in rows}

    # -- moves -----------------------------------------------------------------------
    def moves(self) -> dict[int, tuple[int, int, str]]:
        """``{bucket: (source, target, phase)}`` of unfinished moves."""
        rows = self.backend.select_all("bagstore_moves", ("bucket", "source", "target", "phase"))
        return {int(b): (int(s), int(t), str(p)) for b, s, t, p in rows}

    def set_move(self, bucket: int, source: int, target: int, phase: str) -> None:
        self.backend.upsert(
            "bagstore_moves",
            {"bucket": bucket},
            {"source": source, "target": target, "phase": phase},
        )

    def end_move(self, bucket: int) -> None:
        self.backend.delete_where("bagstore_moves", {"bucket": bucket})


class IndexCatalog:
    """The ``bagstore_indexes`` table: each index's kind, definition and state."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def entries(self, kind: str) -> list[tuple[str, str, str]]:
        """``(name, definition json, state)`` of every index of ``kind``."""
        rows = self.backend.select_all(
            "bagstore_indexes", ("name", "definition", "state"), {"kind": kind}
        )
        return [(str(n), str(d), str(s)) for n, d, s in rows]

    def all_entries(self) -> list[tuple[str, str, str, str]]:
        """``(name, kind, definition json, state)`` of every index of every kind."""
        rows = self.backend.select_all("bagstore_indexes", ("name", "kind", "definition", "state"))
        return [(str(n), str(k), str(d), str(s)) for n, k, d, s in rows]

    def register(self, name: str, kind: str, definition: str, state: str, now: int) -> None:
        """Add an index unless one of that name is registered already."""
        self.backend.insert_ignore(
            "bagstore_indexes",
            ("name", "kind", "definition", "state", "changed"),
            [(name, kind, definition, state, now)],
        )

    def set_state(self, name: str, state: str, now: int, *, expect: str | None = None) -> bool:
        """Change an index's state (only from ``expect`` if given); True if changed."""
        where: dict[str, object] = {"name": name}
        if expect is not None:
            where["state"] = expect
        return self.backend.update("bagstore_indexes", {"state": state, "changed": now}, where) > 0

    def changed(self, name: str) -> int | None:
        """When the index's state last changed (microseconds), or None."""
        rows = self.backend.select_all("bagstore_indexes", ("changed",), {"name": name})
        return int(rows[0][0]) if rows else None

    def remove(self, name: str) -> bool:
        return self.backend.delete_where("bagstore_indexes", {"name": name}) > 0


class Checkpoints:
    """Named integer positions (the Cleaner's resume points) in the catalog."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def get(self, name: str) -> int | None:
        rows = self.backend.select_all("bagstore_checkpoints", ("value",), {"name": name})
        return int(rows[0][0]) if rows else None

    def set(self, name: str, value: int) -> None:
        self.backend.upsert("bagstore_checkpoints", {"name": name}, {"value": value})

    def clear(self, prefix: str) -> None:
        for (name,) in self.backend.select_all("bagstore_checkpoints", ("name",)):
            if str(name).startswith(prefix):
                self.backend.delete_where("bagstore_checkpoints", {"name": name})
