"""Where buckets live, as one immutable value, and how a shard is opened.

A :class:`Topology` is a snapshot: the catalog's placement (its version,
bucket -> shard) and the backends of the shards it names.  The router
(:mod:`bagstore.sharding.router`) replaces it whole on a refresh and never
with one of an older version; nothing edits one in place, so a reader that
took a snapshot routes a whole statement by one consistent map.  The
replicated shards' roles (epoch, primary, replicas) are kept by the opener's
:class:`~bagstore.sharding.replicas.Replication`: a failover points a shard's
backend at another server, so a snapshot's backends stay the same objects.

    >>> from bagstore.catalog import Placement
    >>> Topology(Placement(2, ("a",), (0, 0)), ()).sole_shard
    0
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from bagstore.backends import Backend, MySQLDefaults, open_backend
from bagstore.errors import ConfigurationError
from bagstore.sharding.replicas import Replication

if TYPE_CHECKING:
    from bagstore.catalog import Placement

__all__ = ["ShardOpener", "Topology"]


@dataclass(frozen=True)
class Topology:
    """One placement (version, bucket -> shard) and the backends of its shards.

    ``sole_shard`` is the shard that holds every bucket, when one does (None
    when they are spread): reads then go there without hashing each id.
    ``backend_by_bucket`` is the backend of each bucket (:meth:`backend_of` as a
    tuple; empty if the placement names a shard with no backend here): a
    point read's route is one index."""

    placement: Placement
    backends: tuple[Backend, ...]
    sole_shard: int | None = field(init=False)
    #: ``placement.buckets`` (a plain attribute: read on every point read)
    buckets: int = field(init=False, repr=False, compare=False)
    backend_by_bucket: tuple[Backend, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        shard_of = self.placement.shard_of_bucket
        sole = shard_of[0] if shard_of.count(shard_of[0]) == len(shard_of) else None
        object.__setattr__(self, "sole_shard", sole)
        object.__setattr__(self, "buckets", self.placement.buckets)
        n = len(self.backends)
        by_bucket = tuple(self.backends[k] for k in shard_of) if max(shard_of) < n else ()
        object.__setattr__(self, "backend_by_bucket", by_bucket)

    @property
    def version(self) -> int:
        return self.placement.version

    @property
    def shard_of_bucket(self) -> tuple[int, ...]:
        return self.placement.shard_of_bucket

    def backend_of(self, bucket: int) -> Backend:
        """The backend of the shard that owns ``bucket``."""
        return self.backends[self.placement.shard_of_bucket[bucket]]


@dataclass(frozen=True)
class ShardOpener:
    """How this process opens a shard: the MySQL defaults and SQLite setting it
    was configured with, and the store directory (``root``) that relative
    SQLite shard names (``shard_4.db``) live in."""

    mysql: MySQLDefaults
    sqlite_synchronous: str = "NORMAL"
    root: str | None = None
    #: the replicated shards (their primary, replicas and reads)
    replication: Replication = field(default_factory=Replication, compare=False)

    def open(self, url: str) -> Backend:
        """A backend for a URL as configured."""
        backend = open_backend(url, mysql=self.mysql, sqlite_synchronous=self.sqlite_synchronous)
        self.replication.adopt(backend)
        return backend

    def open_listed(self, name: str) -> Backend:
        """A backend for a shard name the catalog lists (added after this
        process's configuration was written)."""
        if "://" not in name and not name.startswith("sqlite:"):
            if self.root is None:
                raise ConfigurationError(
                    f"cannot locate shard {name!r} outside its store directory"
                )
            name = "sqlite:///" + os.path.join(self.root, name)
        return self.open(name)

    def listed_name(self, url: str) -> str:
        """The name the catalog records for a new shard's URL: relative to the
        store directory when the file lies in it."""
        if self.root is not None and url.startswith("sqlite:///"):
            path = url[len("sqlite:///") :]
            root = self.root.rstrip("/") + "/"
            if path.startswith(root):
                return path[len(root) :]
        return url
