"""Integer id sequences shared by every process of a store, handed out in blocks.

``ds.sequence("photos").next()`` gives a positive integer that no other call,
thread or process of the store ever gets: Yupoo's sequence table (one row per
name, ``UPDATE ... SET id = LAST_INSERT_ID(id + block)``), with the block kept in
memory so that 999 of every 1,000 ids cost no round trip.

    >>> import bagstore, tempfile
    >>> with bagstore.open(tempfile.mkdtemp()) as ds:
    ...     photos = ds.sequence("photos")
    ...     photos.next(), photos.next(), photos.next_many(3)
    (1, 2, [3, 4, 5])

Guarantees (see docs/ids.md):

* Unique across processes and threads; increasing within one process (one
  :class:`Sequence` object); a new sequence starts at 1, or at ``start``.
* A block reserved but not handed out (a process that exits) is skipped for ever.
* Hand edits: a reservation starts above ``max(id, high, floor)`` where ``high``
  is a second copy of the last reservation and ``floor`` the top of what this
  process already reserved.  So lowering ``id`` by hand changes nothing for
  anybody, and nothing stored — not even both columns lowered or the row deleted
  — makes a running process go back or repeat (it reserves again above its
  floor).  A process started *after* both columns were lowered (or the row was
  deleted, or the table restored from an old backup) may repeat ids handed out
  before: only such an edit can, as with any sequence table.
* Several id servers (``sequence_servers=[url0, url1, ...]``): server ``i`` of
  ``n`` hands out only ids ≡ i+1 (mod n) (``auto_increment_offset = i+1``,
  ``auto_increment_increment = n``), so servers never collide and need not talk
  to each other.  Each refill goes to the next server (round robin); a server
  that fails with :class:`~bagstore.ShardUnavailable` or ``ShardTimeout`` is
  skipped for ``retry_after`` seconds while the others serve.  Each server's row
  records ``n`` and ``i``; a store opened with another number or order of id
  servers is refused (``ConfigurationError``) instead of risking collisions
  until :func:`advance_sequence` moves the sequence to the new list.
* Bad names (not ``^[A-Za-z_][A-Za-z0-9_]{0,63}$``), block sizes, starts and
  modes raise :class:`~bagstore.ConfigurationError`; a bad count given to
  ``next_many`` raises :class:`~bagstore.InvalidQuery`.

``mode="ticket"`` keeps Flickr's ticket server instead: one single-row table per
sequence, ``REPLACE INTO bagstore_tickets_<name> (stub) VALUES ('a')`` and the id
from ``LAST_INSERT_ID`` — one round trip per id, for stores that already run one.
"""

from __future__ import annotations

import itertools
import operator
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from bagstore.backends import Backend, check_identifier, open_backend, seqsql
from bagstore.errors import ConfigurationError, InvalidQuery, ShardTimeout, ShardUnavailable

if TYPE_CHECKING:
    from bagstore.datastore import Datastore

__all__ = [
    "IdServers",
    "Sequence",
    "TicketSequence",
    "advance_sequence",
    "close_sequences",
    "id_servers",
    "list_sequences",
    "open_sequence",
]

T = TypeVar("T")

MAX_BLOCK = 10_000_000
MAX_START = 2**62
MAX_MANY = 10_000_000
#: Seconds a failed id server is skipped before it is tried again.
RETRY_AFTER = 5.0

_FAILOVER = (ShardUnavailable, ShardTimeout)
#: False on a free-threaded build running without the GIL.
_GIL: bool = getattr(sys, "_is_gil_enabled", lambda: True)()


class IdServers:
    """The databases that hold a store's sequences, and which of them answer.

    One per :class:`~bagstore.Datastore` (see :func:`id_servers`): the catalog
    database, or one backend per ``sequence_servers`` URL.
    """

    def __init__(self, backends: list[Backend], *, owned: bool, retry_after: float = RETRY_AFTER):
        self.backends = backends
        self.retry_after = retry_after
        self._owned = owned
        self._down_until = [0.0] * len(backends)
        self._tables: set[int] = set()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.backends)

    def order(self, first: int) -> list[int]:
        """Servers to try, round robin from ``first``: those not marked down, then
        (as a last resort) those that are."""
        n = len(self.backends)
        if n == 1:
            return [0]
        turn = [(first + k) % n for k in range(n)]
        now = time.monotonic()
        with self._lock:
            up = [i for i in turn if self._down_until[i] <= now]
        return up + [i for i in turn if i not in up]

    def attempt(self, order: list[int], what: str, fn: Callable[[int, Backend], T]) -> T:
        """``fn(i, backend)`` on the first server of ``order`` that answers."""
        failures: list[BaseException] = []
        for i in order:
            backend = self.backends[i]
            try:
                result = fn(i, backend)
            except _FAILOVER as exc:
                with self._lock:
                    self._down_until[i] = time.monotonic() + self.retry_after
                failures.append(exc)
                continue
            if self._down_until[i]:
                with self._lock:
                    self._down_until[i] = 0.0
            return result
        names = ", ".join(self.backends[i].name for i in order)
        raise ShardUnavailable(
            f"{what}: no id server answered ({names}): {failures[-1]}",
            shard=self.backends[order[-1]].name,
        ) from failures[-1]

    def reset(self) -> None:
        """Forget failures: every server is tried again from the next refill on."""
        with self._lock:
            self._down_until = [0.0] * len(self.backends)

    def ensure_table(self, i: int) -> None:
        """Create ``bagstore_sequences`` on server ``i`` (once per process)."""
        if i in self._tables:
            return
        seqsql.ensure_sequences_table(self.backends[i])
        with self._lock:
            self._tables.add(i)

    def close(self) -> None:
        """Close the id servers' connections (not the catalog's: the store owns it)."""
        if self._owned:
            for b in self.backends:
                b.close()


_registry: weakref.WeakKeyDictionary[Any, IdServers] = weakref.WeakKeyDictionary()
_registry_lock = threading.Lock()


def id_servers(ds: Datastore) -> IdServers:
    """The id servers of ``ds`` (made on first use, shared by its sequences)."""
    with _registry_lock:
        found = _registry.get(ds)
        if found is not None:
            return found
        urls = list(ds.sequence_servers)
        if not urls:
            servers = IdServers([ds.router.catalog_backend], owned=False)
        else:
            if any(not isinstance(u, str) for u in urls) or all(len(u) == 1 for u in urls):
                raise ConfigurationError(
                    f"sequence_servers must be a list of URLs, not {ds.sequence_servers!r}"
                )
            backends = [open_backend(u, mysql=ds.router.opener.mysql) for u in urls]
            names = [b.name for b in backends]
            if len(set(names)) != len(names):
                for b in backends:
                    b.close()
                raise ConfigurationError(f"an id server is listed twice in {names}")
            servers = IdServers(backends, owned=True)
            weakref.finalize(ds, servers.close)
        _registry[ds] = servers
        return servers


def close_sequences(ds: Datastore) -> None:
    """Close the connections ``ds`` opened to its ``sequence_servers``; call it
    with ``ds.close()`` (they are also closed when ``ds`` is garbage collected).
    A sequence used afterwards still works, on a fresh connection per refill."""
    with _registry_lock:
        servers = _registry.pop(ds, None)
    if servers is not None:
        servers.close()


def _check_name(name: object, mode: str) -> str:
    name = check_identifier(name, "sequence name")
    if mode == "ticket":
        seqsql.ticket_table(name)  # the table name must fit too
    return name


def _check_int(value: object, what: str, low: int, high: int) -> int:
    if type(value) is not int or not low <= value <= high:
        raise ConfigurationError(f"{what} must be an integer from {low} to {high}, not {value!r}")
    return value


def open_sequence(
    ds: Datastore, name: str, *, block: int = 1000, start: int = 1, mode: str = "block"
) -> Sequence | TicketSequence:
    """The sequence ``name`` of ``ds`` (created on first use).

    ``block`` ids are reserved per round trip (mode ``"block"``); ``start`` is the
    smallest id it hands out; ``mode="ticket"`` uses a Flickr ticket table.
    ``Datastore.sequence(name)`` calls this and caches the object.
    """
    if mode not in ("block", "ticket"):
        raise ConfigurationError(f"sequence mode must be 'block' or 'ticket', not {mode!r}")
    name = _check_name(name, mode)
    _check_int(start, "start", 1, MAX_START)
    if mode == "ticket":
        return TicketSequence(name, id_servers(ds), start=start)
    _check_int(block, "block", 1, MAX_BLOCK)
    return Sequence(name, id_servers(ds), block=block, start=start)


def _check_count(n: object) -> int:
    if type(n) is not int or not 0 <= n <= MAX_MANY:
        raise InvalidQuery(f"next_many takes a count from 0 to {MAX_MANY}, not {n!r}")
    return n


class Sequence:
    """Ids from a sequence table, reserved ``block`` at a time.

    ``next()`` and ``next_many(n)`` are safe to call from many threads.  The
    block in memory is an iterator over a ``range``; taking one id is a single
    ``next()`` on it, which CPython's GIL makes atomic (no lock on the fast
    path: a fraction of a microsecond an id).  A lock guards the refill (one statement, run under
    it) and ``next_many``; without a GIL (free-threaded builds) every call takes
    the lock.

        >>> seq = ds.sequence("photos")  # doctest: +SKIP
        >>> seq.next()                   # doctest: +SKIP
        1
    """

    def __init__(self, name: str, servers: IdServers, *, block: int, start: int) -> None:
        self.name = name
        self.block = block
        self.start = start
        self._servers = servers
        self._step = len(servers)
        self._lock = threading.Lock()
        self._ids: Iterator[int] = iter(())  # the rest of the block in memory
        self._floor = start - 1  # every reservation starts above this
        self._turn = 0
        #: Statements sent so far (reservations, plus creation on first use).
        self.statements = 0

    def next(self) -> int:
        """The next id."""
        if not _GIL:
            with self._lock:
                try:
                    return next(self._ids)
                except StopIteration:
                    self._ids = iter(self._reserve(1))
                    return next(self._ids)
        while True:
            ids = self._ids
            try:
                return next(ids)  # atomic under the GIL
            except StopIteration:
                with self._lock:
                    if self._ids is ids:  # nobody refilled it meanwhile
                        self._ids = iter(self._reserve(1))

    def next_many(self, n: int) -> list[int]:
        """``n`` ids, increasing; at most one round trip however large ``n`` is."""
        n = _check_count(n)
        with self._lock:
            out = list(itertools.islice(self._ids, n))
            if len(out) < n:
                rest = n - len(out)
                block = self._reserve(rest)
                out += block[:rest]
                self._ids = iter(block[rest:])
            return out

    def _reserve(self, count: int) -> range:
        """Reserve whole blocks for at least ``count`` ids (lock held); return them."""
        servers = self._servers
        n = self._step
        span = -(-count // self.block) * self.block * n
        floor = self._floor

        def on(i: int, backend: Backend) -> tuple[int, int]:
            return i, self._reserve_on(i, backend, floor, span)

        i, top = servers.attempt(servers.order(self._turn), f"sequence {self.name!r}", on)
        self._turn = (i + 1) % n
        self._floor = top
        base = top - span
        # (base, top] holds exactly span / n ids ≡ i+1 (mod n), all above the floor.
        first = base + 1 + (i - base) % n
        return range(first, top + 1, n)

    def _reserve_on(self, i: int, backend: Backend, floor: int, span: int) -> int:
        n = self._step
        self._servers.ensure_table(i)
        args: dict[str, Any] = {"floor": floor, "span": span, "servers": n, "server_no": i}
        self.statements += 1
        top = seqsql.reserve(backend, self.name, **args)
        if top is None:  # a new sequence (on this server)
            seqsql.create_sequence_row(
                backend, self.name, value=self.start - 1, servers=n, server_no=i
            )
            self.statements += 2
            top = seqsql.reserve(backend, self.name, **args)
        if top is None:
            row = seqsql.sequence_row(backend, self.name)
            where = f"server {row.server_no} of {row.servers}" if row else "missing"
            raise ConfigurationError(
                f"sequence {self.name!r} on {backend.name} is set up as {where}, but this "
                f"datastore makes it server {i} of {n}: the list of sequence_servers changed "
                "(see docs/ids.md, 'Changing the id servers')"
            )
        return top

    def __repr__(self) -> str:
        return (
            f"<bagstore.Sequence {self.name!r} block={self.block} servers={self._step} "
            f"in_memory={operator.length_hint(self._ids)}>"
        )


class TicketSequence:
    """Flickr's ticket server: one ``REPLACE INTO`` (one round trip) per id.

    Unique across processes as long as the ticket table's ``AUTO_INCREMENT``
    is; increasing within one server; with several servers the calls go round
    robin, so ids from different servers interleave.
    """

    def __init__(self, name: str, servers: IdServers, *, start: int) -> None:
        self.name = name
        self.start = start
        self.table = seqsql.ticket_table(name)
        self._servers = servers
        self._ready: set[int] = set()
        self._lock = threading.Lock()
        self._turn = 0
        self.statements = 0

    def next(self) -> int:
        """The next id (one round trip)."""
        servers = self._servers
        with self._lock:
            first = self._turn
            self._turn = (first + 1) % len(servers)
        return servers.attempt(servers.order(first), f"ticket sequence {self.name!r}", self._on)

    def _on(self, i: int, backend: Backend) -> int:
        n = len(self._servers)
        if i not in self._ready:
            seqsql.ensure_ticket_table(
                backend, self.table, start=self.start, servers=n, server_no=i
            )
            self._ready.add(i)
            self._count(2)
        self._count(1)
        return seqsql.next_ticket(backend, self.table, servers=n, server_no=i)

    def _count(self, statements: int) -> None:
        with self._lock:
            self.statements += statements

    def next_many(self, n: int) -> list[int]:
        """``n`` ids (``n`` round trips)."""
        return [self.next() for _ in range(_check_count(n))]

    def __repr__(self) -> str:
        return f"<bagstore.TicketSequence {self.name!r} table={self.table}>"


def advance_sequence(ds: Datastore, name: str, value: int) -> None:
    """Make sequence ``name`` hand out only ids above ``value`` on every id server
    of ``ds``, and record this datastore's list of servers in its rows.

    It never lowers anything.  Use it after changing ``sequence_servers`` (with
    ``value`` = the highest stored value under the old list, every process that
    hands out ids stopped), or after restoring an id server from a backup.
    Every server must answer (else ``ShardUnavailable``; run it again).
    """
    name = _check_name(name, "block")
    value = _check_int(value, "value", 0, MAX_START)
    servers = id_servers(ds)
    for i, backend in enumerate(servers.backends):
        servers.ensure_table(i)
        seqsql.advance_sequence_row(backend, name, value=value, servers=len(servers), server_no=i)


def list_sequences(ds: Datastore, *, skip_unavailable: bool = False) -> list[tuple[str, int]]:
    """``[(name, last id reserved)]`` of every block sequence of ``ds``, by name.

    With several id servers the value is the highest over the servers.  A server
    that does not answer raises ``ShardUnavailable`` unless ``skip_unavailable``.
    """
    servers = id_servers(ds)
    found: dict[str, int] = {}
    for i, backend in enumerate(servers.backends):
        try:
            servers.ensure_table(i)
            rows = seqsql.sequence_rows(backend)
        except _FAILOVER:
            if skip_unavailable:
                continue
            raise
        for row in rows:
            found[row.name] = max(found.get(row.name, 0), row.value)
    return sorted(found.items())
