"""Which server of a replicated shard answers: the primary, found by epoch,
and the replicas that take reads.

One :class:`Replication` per datastore (the router's: it decides, the
backends only carry out).  For each shard whose URL names replicas
(docs/replication.md) it knows a :class:`~bagstore.backends.replication.Role`
(epoch, primary, replicas, refused old primaries):

* **Where the primary is.**  A backend whose connection broke, or whose new
  connection found a read-only server or another epoch, calls :meth:`guard`
  before its next statement: every server of the shard (as configured and as
  last heard) is asked for its role row, and the catalog for its record; the
  highest epoch wins, and the backend is pointed there.  A revived old
  primary holds an older epoch and is never chosen again.  While the chosen
  primary is reachable but still read-only (a switchover between its two
  steps) the guard waits, up to ``writable_wait`` seconds.
* **Reads from replicas** (``read_from="replica"``): a replica is chosen per
  read, in turn; one that failed is skipped for a second, one further behind
  than ``max_lag`` seconds is skipped; before reading, the replica waits
  (``MASTER_GTID_WAIT``, up to ``wait_timeout``) for the GTID of this
  process's last write on that shard, and when it does not get there in time
  the primary answers (a *fallback*, counted).  With no usable replica the
  primary answers: a replica problem is never an error while the primary works.

    >>> Replication(read_from="replica").read_from
    'replica'
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from bagstore.backends import Backend
from bagstore.backends.replication import gtid_wait, replica_lag
from bagstore.errors import BackendError, ConfigurationError, ShardUnavailable

if TYPE_CHECKING:
    from bagstore.backends.mysql import MySQLBackend
    from bagstore.backends.replication import Role
    from bagstore.catalog import Catalog

__all__ = ["READ_FROM", "Replication", "check_read_from"]

T = TypeVar("T")
log = logging.getLogger("bagstore.replication")

READ_FROM = ("primary", "replica")
#: Catalog meta rows ``topology:<shard>`` and ``topology:catalog`` hold each
#: replicated group's role as JSON with its epoch.
RECORD = "topology:"
#: A replica that failed is left alone this long (seconds).
DOWN_FOR = 1.0
#: How long a measured lag is trusted (seconds).
LAG_FOR = 0.5


def check_read_from(value: object) -> str:
    if value not in READ_FROM:
        raise ConfigurationError(f"read_from must be 'primary' or 'replica', not {value!r}")
    return str(value)


class Replication:
    """The replicated shards of one datastore: their roles, the guard that
    finds their primary, and the choice of a replica per read."""

    def __init__(
        self,
        *,
        read_from: str = "primary",
        max_lag: float | None = None,
        wait_timeout: float = 1.0,
        writable_wait: float = 5.0,
    ) -> None:
        self.read_from = check_read_from(read_from)
        if max_lag is not None and (
            isinstance(max_lag, bool) or not isinstance(max_lag, int | float) or max_lag < 0
        ):
            raise ConfigurationError(f"max_lag must be a number of seconds >= 0, not {max_lag!r}")
        self.max_lag = max_lag
        #: How long a replica read waits for this process's last write (seconds).
        self.wait_timeout = wait_timeout
        self.writable_wait = writable_wait
        #: The catalog (once open), whose records count as one more server's word.
        self.catalog: Catalog | None = None
        #: ``{id(backend): shard number}`` (for the catalog's records).
        self.shard_numbers: dict[int, str] = {}
        self._lock = threading.Lock()
        self._guard_locks: dict[int, threading.Lock] = {}
        self._generation: Counter[int] = Counter()
        self._backends: dict[int, MySQLBackend] = {}
        self._configured: dict[int, tuple[str, ...]] = {}
        self._roles: dict[int, Role] = {}
        self._readers: dict[int, tuple[MySQLBackend, ...]] = {}
        self._down: dict[str, float] = {}
        self._lags: dict[str, tuple[float, float | None]] = {}
        self._reached: dict[str, dict[str, int]] = {}
        self._turn = itertools.count()
        #: how many times a shard was pointed at another server (plans that
        #: group shards by server are made again)
        self.retargets = 0
        self._stats_lock = threading.Lock()
        self._reads: Counter[str] = Counter()
        self._events: Counter[str] = Counter({"fallbacks": 0, "skipped": 0, "waits": 0})

    # -- the shards ---------------------------------------------------------------------
    def adopt(self, backend: Backend) -> None:
        """Take a newly opened shard backend in if it names replicas."""
        if not getattr(backend, "replicated", False):
            return
        from bagstore.backends.replication import Role

        b: MySQLBackend = backend  # type: ignore[assignment]
        key = id(b)
        self._backends[key] = b
        self._configured[key] = (str(b.server), *b.replicas)
        self._roles[key] = Role(0, str(b.server), b.replicas)
        self._guard_locks[key] = threading.Lock()
        b.guard = self.guard
        # Before its first statement: ask every server, trust the highest epoch
        # (the configured primary may be an old one, even revived).
        b.suspect = True

    def replicated(self) -> list[MySQLBackend]:
        return list(self._backends.values())

    def role_of(self, backend: Backend) -> Role | None:
        """The role this process routes ``backend``'s shard by (None: no replicas)."""
        return self._roles.get(id(backend))

    def name(self, backend: Backend, shard: str) -> None:
        """Tell which shard (``"0"``, ``"1"``, ... or ``"catalog"``) ``backend`` is."""
        self.shard_numbers.setdefault(id(backend), shard)

    # -- where the primary is ----------------------------------------------------------------
    def guard(self, backend: MySQLBackend) -> None:
        """Point ``backend`` at its shard's primary as the highest epoch says,
        waiting (up to ``writable_wait``) while that server is still read-only;
        ShardUnavailable if it cannot be reached."""
        key = id(backend)
        seen = self._generation[key]
        with self._guard_locks[key]:
            if self._generation[key] != seen and not backend.suspect:
                return  # another thread just looked
            deadline = time.monotonic() + self.writable_wait
            while True:
                role, writable, reachable = self.discover(backend)
                self.apply(backend, role)
                self._generation[key] += 1
                if writable:
                    backend.suspect = False
                    return
                if not reachable or time.monotonic() >= deadline:
                    raise ShardUnavailable(
                        f"shard {backend.name}: its primary {role.primary} (epoch {role.epoch}) "
                        + ("is read-only" if reachable else "cannot be reached"),
                        shard=backend.name,
                    )
                time.sleep(0.02)

    def discover(self, backend: MySQLBackend) -> tuple[Role, bool, bool]:
        """Ask every server of the shard (and the catalog) for its role: the
        one of the highest epoch, whether its primary is writable, reachable."""
        from bagstore.backends.replication import Role, Servers

        key = id(backend)
        known = self._roles[key]
        servers = Servers(backend, quick=True)
        addresses = dict.fromkeys([*self._configured[key], *known.servers, str(backend.server)])
        said: dict[str, tuple[Role | None, bool]] = {}
        for address in addresses:
            try:
                said[address] = servers.role(address)
            except BackendError:
                continue
        heard = [role for role, _ in said.values() if role is not None]
        record = self._catalog_record(backend)
        if record is not None:
            heard.append(record)
        if heard:  # the highest epoch any server (or the catalog) holds
            best = max(heard, key=lambda role: role.epoch)
        elif said:  # servers answered, none has a role row: no failover of this database
            configured = self._configured[key]
            writable = [a for a, (_, read_only) in said.items() if not read_only]
            first = configured[0]
            if first in said and said[first][1] and len(writable) == 1:
                # (a new database on servers whose primary moved since the
                # configuration was written: the one writable server)
                first = writable[0]
            best = Role(0, first, tuple(a for a in configured if a != first))
            if not writable and known.primary not in said:
                best = known  # the primary known is down: not another one by default
        else:  # nobody answered: keep what was known
            best = known
        answer = said.get(best.primary)
        if answer is None:
            return best, False, False
        # writable: not read_only, and it has applied its own promotion (its
        # role row is at this epoch): before that it may lack the old
        # primary's last transactions
        own = answer[0].epoch if answer[0] is not None else 0
        return best, not answer[1] and own == best.epoch, True

    def _catalog_record(self, backend: MySQLBackend) -> Role | None:
        catalog, shard = self.catalog, self.shard_numbers.get(id(backend))
        if catalog is None or shard is None or catalog.backend is backend:
            return None
        try:
            return records(catalog.read_meta()).get(shard)
        except BackendError:
            return None

    def apply(self, backend: MySQLBackend, role: Role) -> None:
        """Route ``backend``'s shard by ``role`` from now on."""
        key = id(backend)
        with self._lock:
            if role.primary != backend.server:
                log.warning(
                    "shard %s: primary is now %s (epoch %d; was %s)",
                    backend.name, role.primary, role.epoch, backend.server,
                )  # fmt: skip
                backend.retarget(role.primary)
                self.retargets += 1
            backend.epoch = role.epoch
            if self._roles.get(key) != role:
                self._roles[key] = role
                old = self._readers.pop(key, ())
                for reader in old:
                    reader.close()

    def guard_to(self, backend: MySQLBackend, role: Role) -> None:
        """Route by ``role`` (a failover this process just ran) once its
        primary is writable (see :meth:`guard`)."""
        self.apply(backend, role)
        backend.suspect = True
        self.guard(backend)

    def learn(self, recorded: Mapping[str, Role]) -> None:
        """Catalog records read on a placement refresh: a shard whose record
        is newer than its role looks for its primary again before its next
        statement."""
        for key, backend in self._backends.items():
            record = recorded.get(self.shard_numbers.get(key, ""))
            if record is not None and record.epoch > self._roles[key].epoch:
                backend.suspect = True

    # -- reads ----------------------------------------------------------------------------
    def readers(self, backend: MySQLBackend) -> tuple[MySQLBackend, ...]:
        key = id(backend)
        found = self._readers.get(key)
        if found is None:
            with self._lock:
                found = self._readers.get(key)
                if found is None:
                    role = self._roles[key]
                    found = tuple(backend.sibling(a) for a in role.replicas)
                    self._readers[key] = found
        return found

    def read(self, primary: Backend, work: Callable[[Backend], T], read_from: str | None) -> T:
        """``work`` on a replica of ``primary``'s shard when ``read_from`` (or
        the default) says so and one is fit, else on the primary."""
        mode = self.read_from if read_from is None else read_from
        key = id(primary)
        if mode == "primary" or key not in self._backends:
            return work(primary)
        b = self._backends[key]
        readers = self.readers(b)
        position = b.position()
        n = len(readers)
        start = next(self._turn) % n if n else 0
        for i in range(n):
            reader = readers[(start + i) % n]
            address = str(reader.server)
            if self._down.get(address, 0.0) > time.monotonic():
                self._count("skipped")
                continue
            try:
                if not self._fresh(reader):
                    self._count("skipped")
                    continue
                if position and not self._has(address, position):
                    self._count("waits")
                    if not gtid_wait(reader, position, self.wait_timeout):
                        self._count("fallbacks")  # not there in time: the primary answers
                        break
                    self._reached[address] = _seqs(position)
                result = work(reader)
            except BackendError as exc:
                log.info("replica %s skipped for %gs: %s", address, DOWN_FOR, exc)
                self._down[address] = time.monotonic() + DOWN_FOR
                self._count("skipped")
                continue
            self._count_read(address)
            return result
        result = work(primary)
        self._count_read(str(b.server))
        return result

    def failed(self, exc: BackendError) -> bool:
        """Whether ``exc`` came from a replica (one chosen for a query's scan
        that failed meanwhile): if so it is skipped for ``DOWN_FOR`` seconds
        and the caller reads the primary instead (counted as a fallback)."""
        for readers in list(self._readers.values()):
            for reader in readers:
                if reader.name == exc.shard:
                    address = str(reader.server)
                    log.info("replica %s skipped for %gs: %s", address, DOWN_FOR, exc)
                    self._down[address] = time.monotonic() + DOWN_FOR
                    self._count("fallbacks")
                    return True
        return False

    def _fresh(self, reader: MySQLBackend) -> bool:
        """Whether a replica is within ``max_lag`` (measured at most every
        half second; an unknown lag, replication stopped, is too far).  The
        login needs the SLAVE MONITOR privilege (``SHOW SLAVE STATUS``)."""
        if self.max_lag is None:
            return True
        address = str(reader.server)
        now = time.monotonic()
        at, lag = self._lags.get(address, (0.0, None))
        if now - at > LAG_FOR:
            lag = replica_lag(reader)
            self._lags[address] = (now, lag)
        return lag is not None and lag <= self.max_lag

    def _has(self, address: str, position: str) -> bool:
        reached = self._reached.get(address)
        if reached is None:
            return False
        return all(reached.get(d, -1) >= s for d, s in _seqs(position).items())

    def _count(self, event: str) -> None:
        with self._stats_lock:
            self._events[event] += 1

    def _count_read(self, address: str) -> None:
        with self._stats_lock:
            self._reads[address] += 1

    def stats(self) -> dict[str, dict[str, int]]:
        """``reads`` per server (of reads routed by ``read_from``) and
        ``replicas``: ``fallbacks`` (a replica did not reach this process's last
        write in time: the primary answered), ``skipped`` (a replica down or
        too far behind), ``waits`` (``MASTER_GTID_WAIT`` sent)."""
        with self._stats_lock:
            return {"reads": dict(self._reads), "replicas": dict(self._events)}

    def close(self) -> None:
        for readers in self._readers.values():
            for reader in readers:
                reader.close()


def records(meta: Mapping[str, str]) -> dict[str, Role]:
    """The catalog's ``topology:`` records: ``{shard: Role}``."""
    import json

    from bagstore.backends.replication import Role

    out: dict[str, Role] = {}
    for name, value in meta.items():
        if name.startswith(RECORD):
            data: Any = json.loads(value)
            out[name[len(RECORD) :]] = Role.from_json(int(data.pop("epoch")), json.dumps(data))
    return out


def record_json(role: Role) -> str:
    import json

    return json.dumps({"epoch": role.epoch, **json.loads(role.to_json())}, sort_keys=True)


def _seqs(position: str) -> dict[str, int]:
    from bagstore.backends.replication import seqs

    return seqs(position)


def servers_status(router: Any) -> list[dict[str, Any]]:
    """Every server of every replicated shard (and of the catalog): its role
    (``primary``, ``replica``, ``retired``, ``unreachable``), lag, GTID
    position and, on a primary, semi-synchronous replication's state."""
    from bagstore.backends.replication import Servers

    replication: Replication = router.replication
    out: list[dict[str, Any]] = []
    seen: set[int] = set()
    for backend in replication.replicated():
        if id(backend) in seen:
            continue
        seen.add(id(backend))
        role = replication.role_of(backend)
        assert role is not None
        servers = Servers(backend, quick=True)
        for address in (*role.servers, *role.retired):
            state = servers.state(address)
            kind = (
                "retired" if address in role.retired
                else "unreachable" if not state.reachable
                else "primary" if address == role.primary else "replica"
            )  # fmt: skip
            out.append({
                "shard": replication.shard_numbers.get(id(backend), "?"),
                "server": address,
                "role": kind,
                "epoch": role.epoch,
                "lag": state.lag,
                "replicating": state.io_running and state.sql_running,
                "position": state.binlog_pos,
                "semi_sync": state.semi_sync if kind == "primary" else {},
            })  # fmt: skip
    return out
