"""The read path: entities by id and the shard scans of queries.

:class:`Reads` turns ids into rows: the placer says which bucket holds each
id, the router's topology which shard holds the bucket, and one statement per
shard (or one for all the shards of one server and login) reads them.  With a
cache level (:mod:`bagstore.cache`) the layer is asked first and calls back
:meth:`Reads.fetch_many` for what it lacks.  It is also the query engine's
:class:`bagstore.query.Source` (see :func:`bagstore.query.execute`).

    >>> import bagstore, tempfile
    >>> ds = bagstore.open(tempfile.mkdtemp())
    >>> ds.get_many([ds.put({"n": 1})])[0]["n"]
    1
    >>> ds.close()
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, TypeVar

from bagstore import codec
from bagstore.backends import Backend, Stored
from bagstore.cache.request import _current as _current_request
from bagstore.codec import decode
from bagstore.errors import BackendError
from bagstore.query import Plan, _Stream, shard_scans
from bagstore.sharding.hashing import bucket_of
from bagstore.sharding.replicas import check_read_from

if TYPE_CHECKING:
    from bagstore.cache.layer import CacheLayer
    from bagstore.sharding.placer import Placer
    from bagstore.sharding.router import Router
    from bagstore.sharding.topology import Topology

__all__ = ["Reads", "together"]

T = TypeVar("T")

#: ``read_from`` of the query running in this context (None: the datastore's).
_read_from: ContextVar[str | None] = ContextVar("bagstore_read_from", default=None)


#: At most this many ids go into one statement over several shards.
TOGETHER_MAX_IDS = 2000


def read_bodies_together(
    kind: str,
    parts: Sequence[tuple[Backend, Sequence[bytes]]],
    *,
    stamps: bool,
    bodies: bool = True,
) -> list[tuple[Any, ...]]:
    """:meth:`Backend.read_bodies` of ids on several shards with one ``together``
    key, in one statement on the first shard's connection (one round trip
    instead of one per shard); each part reads only its own database."""
    lead = parts[0][0]
    selects: list[str] = []
    params: list[Any] = []
    for backend, ids in parts:
        selects.append(
            lead.sql("select_bodies_sql", kind, len(ids), False, backend.schema, stamps, bodies)
        )
        params.extend(ids)
    sql = lead.dialect.union_all_sql(selects)
    return lead.read_together(sql, params, [backend for backend, _ in parts])


@contextmanager
def _reading(read_from: str) -> Iterator[None]:
    token = _read_from.set(read_from)
    try:
        yield
    finally:
        _read_from.reset(token)


_UNCHANGED: AbstractContextManager[None] = nullcontext()


def sole_backend(topology: Topology) -> Backend | None:
    """The backend of the shard that holds every bucket, if one does (and
    this process has it): a point read needs no hash there."""
    if topology.sole_shard is None or not topology.backend_by_bucket:
        return None
    return topology.backend_by_bucket[0]


class Reads:
    """Reads of one kind: by id through the cache layer, or straight from the
    shards, and the scans of queries."""

    def __init__(self, kind: str, router: Router, placer: Placer, cache: CacheLayer) -> None:
        self.kind = kind
        self.router = router
        self.placer = placer
        self.cache = cache
        #: no cache level to consult and the id alone names the bucket
        self.direct = cache.cache is None and not placer.keyed
        #: (topology, its one shard's backend or None): a point read's route
        self._route: tuple[Topology | None, Backend | None] = (None, None)
        # see _joinable: (group, alone, shards) -> (shards, schemas, backends)
        self._join_plans: dict[
            tuple[tuple[int, ...], bool, int, int],
            tuple[tuple[int, ...], tuple[str | None, ...], tuple[Backend, ...]],
        ] = {}

    def uncached(self) -> bool:
        """Whether reads go straight to the shards: no shared cache level and
        no request-scoped one open on this thread."""
        return self.cache.cache is None and _current_request.get() is None

    def mode(self, read_from: str | None = None) -> str:
        """Where reads go: ``read_from`` if given, else the query's, else the
        datastore's default."""
        if read_from is None:
            read_from = _read_from.get() or self.router.replication.read_from
            return read_from
        return check_read_from(read_from)

    def reading(self, read_from: str | None) -> AbstractContextManager[None]:
        """Within the block (this context), reads go where ``read_from`` says
        (None: nothing changes, and no generator is made for it: every query
        passes here)."""
        if read_from is None:
            return _UNCHANGED
        return _reading(check_read_from(read_from))

    def on_replicas(self, run: Callable[[], T]) -> T:
        """``run()``, a query that may scan replicas (``read_from="replica"``);
        when a replica it chose fails meanwhile (dies, is stopped), the query
        runs once more on the primaries: a dead replica is skipped, never an
        error while the primary answers."""
        if self.mode() == "primary":
            return run()
        try:
            return run()
        except BackendError as exc:
            if not self.router.replication.failed(exc):
                raise
        with self.reading("primary"):
            return run()

    # -- by id ---------------------------------------------------------------------
    def get(self, entity_id: bytes, read_from: str | None = None) -> dict[str, Any] | None:
        """One entity (the id checked by the caller), or None."""
        router = self.router
        if time.monotonic() - router.checked_at >= router.refresh_interval:
            router.refresh()
        if (read_from or router.replication.read_from) != "primary":
            mode = self.mode(read_from)
            if mode == "replica" and self.uncached():
                return self._get_on_replica(entity_id, mode)
        if self.direct and _current_request.get() is None:
            # No cache level to consult and the id alone names the bucket:
            # one statement on one shard (the only one: no hash to take).
            topology = router.topology
            route = self._route
            if route[0] is not topology:
                route = self._route = (topology, sole_backend(topology))
            backend = route[1]
            if backend is None:
                backend = topology.backend_by_bucket[bucket_of(entity_id, topology.buckets)]
            body = backend.get_body(self.kind, entity_id)
            return None if body is None else decode(body)
        return self.cache.get(entity_id, self.fetch_many)

    def _get_on_replica(self, entity_id: bytes, mode: str) -> dict[str, Any] | None:
        """:meth:`get` from a replica (apart: its closure's cell would be made
        at every get)."""
        if self.placer.keyed:  # the bucket from a lookup (on the primary)
            return self.get_many([entity_id], mode)[0]
        topology = self.router.topology
        shard = topology.shard_of_bucket[bucket_of(entity_id, topology.buckets)]
        body = self.router.read_on(shard, lambda b: b.get_body(self.kind, entity_id), mode)
        return None if body is None else codec.decode(body)

    def get_many(
        self, wanted: list[bytes], read_from: str | None = None
    ) -> list[dict[str, Any] | None]:
        """Entities in the order asked (None where missing)."""
        self.router.refresh()
        if self.uncached():
            mode = self.mode(read_from)
            bodies = {r[0]: r[1] for r in self.read_rows(wanted, stamps=False, mode=mode)}
            decode = codec.decode
            return [decode(bodies[i]) if i in bodies else None for i in wanted]
        return self.cache.get_many(wanted, self.fetch_many)

    def fetch_versioned(
        self, entity_id: bytes, bucket: int | None = None
    ) -> tuple[bytes, int] | None:
        """``(body, version)`` of one entity as its shard holds it now (never
        a cache nor a replica), or None: where the id names the bucket, one
        statement on that bucket's shard (``bucket``: the id's, if the caller
        hashed it)."""
        by_bucket = self.router.topology.backend_by_bucket
        if self.placer.shard_key is not None or not by_bucket:
            stored = self.fetch_many([entity_id]).get(entity_id)
            return None if stored is None else (stored.body, stored.version)
        if bucket is None:
            bucket = bucket_of(entity_id, len(by_bucket))
        return by_bucket[bucket].get_versioned(self.kind, entity_id)

    def fetch_many(self, ids: Iterable[bytes]) -> dict[bytes, Stored]:
        """``{id: Stored}`` of the ids that exist, as their shards hold them now
        (what the cache layer keeps)."""
        return {r[0]: Stored(r[1], r[2], r[3]) for r in self.read_rows(ids, stamps=True)}

    def existing(self, ids: Iterable[bytes]) -> set[bytes]:
        """The ids that exist, as their shards hold them now (no body read)."""
        return {r[0] for r in self.read_rows(ids, stamps=False, bodies=False)}

    def fetch_bodies(self, ids: Iterable[bytes]) -> dict[bytes, bytes]:
        """``{id: encoded body}`` of the ids that exist (reads with no cache level)."""
        return {r[0]: r[1] for r in self.read_rows(ids, stamps=False)}

    def read_rows(
        self, ids: Iterable[bytes], *, stamps: bool, mode: str = "primary", bodies: bool = True
    ) -> list[tuple[Any, ...]]:
        wanted = list(dict.fromkeys(ids))
        if mode != "primary":
            return self._replica_rows(wanted, stamps, mode, bodies)
        if not self.placer.keyed:  # the id names the bucket
            topology = self.router.topology
            sole = topology.sole_shard
            if sole is not None:  # and every bucket is on one shard
                backend = topology.backends[sole]
                return backend.read_bodies(self.kind, wanted, stamps=stamps, bodies=bodies)
            return self._rows_at(self.placer.locate(wanted), stamps, bodies)
        rows = self._rows_at(self.placer.locate(wanted), stamps, bodies)
        found = {r[0] for r in rows}
        lost = [i for i in wanted if i not in found]
        if lost:  # a stale or missing lookup row: look everywhere
            rows += self._rows_at(self.placer.search(lost), stamps, bodies)
        return rows

    def _replica_rows(
        self, wanted: list[bytes], stamps: bool, mode: str, bodies: bool = True
    ) -> list[tuple[Any, ...]]:
        """Rows read where ``mode`` says, one statement per shard (buckets and
        lookups from the primary; an id whose lookup row is missing is
        searched on the primaries)."""
        router = self.router
        shard_of = router.topology.shard_of_bucket
        groups: dict[int, list[bytes]] = defaultdict(list)
        for entity_id, bucket in self.placer.locate(wanted).items():
            groups[shard_of[bucket]].append(entity_id)

        def read(shard: int) -> list[tuple[Any, ...]]:
            part = groups[shard]
            return router.read_on(
                shard, lambda b: b.read_bodies(self.kind, part, stamps=stamps, bodies=bodies), mode
            )

        rows: list[tuple[Any, ...]] = []
        for part in router.map(read, list(groups)):
            rows += part
        if self.placer.keyed:
            found = {r[0] for r in rows}
            lost = [i for i in wanted if i not in found]
            if lost:
                rows += self._rows_at(self.placer.search(lost), stamps, bodies)
        return rows

    def _rows_at(
        self, where: Mapping[bytes, int], stamps: bool, bodies: bool = True
    ) -> list[tuple[Any, ...]]:
        """Rows (see ``Backend.read_bodies``) of ids whose buckets are known: one
        query per shard, or one for all the shards that share a server and
        login (see :func:`together`)."""
        groups: dict[int, list[bytes]] = defaultdict(list)
        topology = self.router.topology
        shard_of, backends = topology.shard_of_bucket, topology.backends
        for entity_id, bucket in where.items():
            groups[shard_of[bucket]].append(entity_id)
        if len(groups) == 1:
            ((shard, only),) = groups.items()
            return backends[shard].read_bodies(self.kind, only, stamps=stamps, bodies=bodies)

        def read(job: list[int]) -> list[tuple[Any, ...]]:
            if len(job) == 1:
                part = groups[job[0]]
                return backends[job[0]].read_bodies(self.kind, part, stamps=stamps, bodies=bodies)
            parts = [(backends[k], groups[k]) for k in job]
            return read_bodies_together(self.kind, parts, stamps=stamps, bodies=bodies)

        shards = list(groups)
        if len(where) <= TOGETHER_MAX_IDS:
            jobs = together(shards, backends.__getitem__)
        else:  # too many ids for one statement
            jobs = [[k] for k in shards]
        rows: list[tuple[Any, ...]] = []
        for part in self.router.map(read, jobs):
            rows += part
        return rows

    # -- query.Source ------------------------------------------------------------------
    def fetch_streams(self, streams: list[_Stream]) -> None:
        """query.Source: the first page of every stream (each stream's shards
        share one connection: see scan_streams)."""
        if len(streams) == 1:
            streams[0].fetch()
        else:
            self.router.map(_Stream.fetch, streams)

    def fetch_for_query(self, ids: Sequence[bytes]) -> dict[bytes, dict[str, Any]]:
        if self.uncached():
            decode = codec.decode
            rows = self.read_rows(ids, stamps=False, mode=self.mode())
            return {r[0]: decode(r[1]) for r in rows}
        return self.cache.decoded(list(dict.fromkeys(ids)), self.fetch_many)

    def scan_streams(self, plan: Plan, page: int) -> list[_Stream]:
        topology = self.router.topology
        backends = topology.backends
        scans = shard_scans(
            plan, backends, topology.shard_of_bucket, topology.buckets, topology.sole_shard
        )
        replica = self.mode() != "primary"
        if replica:  # each scanned shard's replica (or primary), chosen now
            chosen = list(backends)
            for k in scans:
                chosen[k] = self.router.read_on(k, lambda b: b, "replica")
            backends = tuple(chosen)
        groups = self._scan_groups(list(scans), backends)
        # A kind placed by the index's shard_on value (hashed, as index rows are)
        # keeps each entity beside its index rows: joining the other databases
        # would only add lookups that find nothing (~10 us a row on MariaDB).
        placer = self.placer
        beside = placer.shard_key == plan.index.shard_on and placer.directory is None
        # With no cache level, a stream reads the bodies of its rows' entities in
        # its own statement (LEFT JOIN with the entity tables its connection
        # reaches), saving a second round trip: when it is the only stream, or
        # when the entities sit beside their index rows.  Streams of several
        # servers each read past their share of the page (see first_page), and
        # half or more of their rows' entities live on another server.
        join = self.uncached() and (len(groups) == 1 or beside)
        streams = []
        for group in groups:
            scan = scans[group[0]]
            if len(group) > 1:
                scan.eq = merged_eq([scans[k].eq for k in group])
                scan.parts = tuple(str(backends[k].schema) for k in group)
            if join:
                joined, schemas, reach = self._joinable(group, beside, backends, not replica)
                scan.join_kind, scan.join = self.kind, schemas
            else:
                joined, reach = (), tuple(backends[k] for k in group[1:])
            streams.append(
                _Stream(
                    backends[group[0]],
                    scan,
                    page,
                    shards=len(group),
                    joined=joined,
                    reach=reach,
                    shard_of_bucket=topology.shard_of_bucket,
                )
            )
        return streams

    @staticmethod
    def _scan_groups(shards: list[int], backends: Sequence[Backend]) -> list[tuple[int, ...]]:
        """The shards to scan, grouped so that one statement reads each group's
        index tables (see :func:`together`), at most as many as one statement may
        name."""
        if len(shards) == 1:  # a query that gives its shard_on value
            return [(shards[0],)]
        out: list[tuple[int, ...]] = []
        for group in together(shards, backends.__getitem__, scans=True):
            size = backends[group[0]].max_together or len(group)
            out += [tuple(group[n : n + size]) for n in range(0, len(group), size)]
        return out

    def _joinable(
        self, group: tuple[int, ...], alone: bool, backends: Sequence[Backend], memo: bool = True
    ) -> tuple[tuple[int, ...], tuple[str | None, ...], tuple[Backend, ...]]:
        """The shards whose entity tables a scan of ``group`` joins: ``group``
        (its first shard is scanned on its own connection), then (unless
        ``alone``) the other shards its connection reaches (the databases of one
        server and login, SQLite files; as many as one statement may name);
        their ``schema`` names (None: the first one); and the backends of all
        but the first.  Kept until a shard is added (unless ``memo`` is False:
        backends chosen for one read)."""
        key = (group, alone, len(backends), self.router.replication.retargets)
        known = self._join_plans.get(key) if memo else None
        if known is not None:
            return known
        lead = backends[group[0]]
        shards = list(group)
        if not alone and lead.together is not None:
            shards += [
                k for k, b in enumerate(backends) if k not in group and b.together == lead.together
            ]
            # (a group is never longer than max_together: see _scan_groups)
            shards = shards[: lead.max_together]  # the rest are read by id afterwards
        plan = (
            tuple(shards),
            (None, *(backends[k].schema for k in shards[1:])),
            tuple(backends[k] for k in shards[1:]),
        )
        if memo:
            self._join_plans[key] = plan
        return plan


def together(
    items: Sequence[T], backend_of: Callable[[T], Backend], *, scans: bool = False
) -> list[list[T]]:
    """Items (shard numbers) grouped so that each group's shards can be read
    in one statement (databases of one server reached with one login; with
    ``scans``, also SQLite files, whose other reads gain nothing from it:
    see ``Backend.union_reads``); the others alone, in order."""
    groups: dict[Any, list[T]] = {}
    for n, item in enumerate(items):
        backend = backend_of(item)
        key = backend.together if scans or backend.union_reads else None
        groups.setdefault(key if key is not None else ("alone", n), []).append(item)
    return list(groups.values())


def merged_eq(eqs: Sequence[list[list[bytes]]]) -> list[list[bytes]]:
    """The ``eq`` of one scan standing for the scans of several shards: the keys
    each leading column may equal in any of them (they differ only in the
    shard_on values each shard holds; a value finds no rows on a shard it is
    not placed on, and a stale copy found there is re-checked as any row)."""
    out = [list(keys_) for keys_ in eqs[0]]
    for eq in eqs[1:]:
        for have, more in zip(out, eq, strict=True):
            have += [k for k in more if k not in have]
    return out
