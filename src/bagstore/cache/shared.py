"""What every datastore of a process, and every process, agrees on about level 2.

An invalidation (a writer's marker, a revision bump) that a cache server did
not confirm -- a timeout, a refused connection, a server stopped and resumed --
may never have landed, or may land late, behind fills that readers sent before
it.  Entries under the keys it should have replaced must then not be trusted by
any reader, in this process or another, until something makes them unreachable.
Two mechanisms do that (docs/cache.md, "When an invalidation is not confirmed"):

**In the process**: one :class:`Shared` per store and cache server set, shared
by every datastore of the process that uses them.  It holds the keys whose
invalidation was not confirmed (read from the database only, and sent again
until confirmed) and the process's view of the store's cache state.

**Between processes**: a cell in the catalog (``bagstore_meta``, row
``cache_state``) holds a *phase* and a *token*: ``ok:<token>``,
``suspect:<token>`` or ``warming:<token>``.  Every level-2 key carries the token
(so a new token makes every older entry unreachable), and level 2 is trusted
only in phase ``ok``, by a process that read the cell less than
:data:`CHECK_INTERVAL` ago (it reads it again when its copy is older):

* a writer whose invalidation was not confirmed turns ``ok``/``warming`` into
  ``suspect`` (compare-and-set on the row) and returns only after holding for
  the interval (:data:`HOLD`): by then every process has read ``suspect``;
* a ``suspect`` phase seen for the hold, with every cache server answering a
  probe, becomes ``warming`` under a *new* token (nothing is stored under it
  yet; writers invalidate under it, readers do not read it);
* a ``warming`` phase seen for the hold becomes ``ok``: every writer's view is
  by then at least as new as the token, so its invalidations land where the
  readers look.

Phases change by compare-and-set only, so two processes never disagree about
which token follows which.

    >>> state = parse("suspect:0123456789abcdef")
    >>> (state.phase, state.token)
    ('suspect', '0123456789abcdef')
    >>> parse("garbage").phase
    'suspect'
"""

from __future__ import annotations

import logging
import re
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from hashlib import blake2b
from typing import TYPE_CHECKING, Protocol

from bagstore.errors import BackendError

if TYPE_CHECKING:
    from bagstore.backends.base import Backend

__all__ = [
    "CHECK_INTERVAL",
    "HOLD",
    "CatalogCell",
    "Cell",
    "Shared",
    "State",
    "parse",
    "shared_for",
]

log = logging.getLogger("bagstore.cache")

OK, WARMING, SUSPECT = "ok", "warming", "suspect"
#: The catalog row (in ``bagstore_meta``) holding the store's cache state.
ROW = "cache_state"
#: A process trusts its copy of the cache state for this long (seconds), then
#: reads it again.  The same in every process: it is part of the guarantee.
CHECK_INTERVAL = 1.0
#: How long a phase is held before the next step, and how long a writer that
#: turned the phase to ``suspect`` waits: the interval and 5% (clock rates of
#: different machines differ by far less).
HOLD = CHECK_INTERVAL * 1.05
#: At most this many unconfirmed invalidations are remembered for retry.
MAX_PENDING = 10_000
#: Unconfirmed invalidations are sent again at most this often (seconds).
RETRY_INTERVAL = 0.5

_TOKEN = re.compile(r"[0-9a-f]{16}")


@dataclass(frozen=True, slots=True)
class State:
    """The cache state as read from the cell: ``raw`` is the row's value."""

    raw: str | None
    phase: str
    token: str


#: The state of a layer with no cell (an in-process cache, or no store): its
#: keys carry no token and nothing between processes can go stale.
LOCAL = State(None, OK, "")


def parse(raw: str) -> State:
    """The state a cell value names; anything else is ``suspect`` (so it is
    replaced, by compare-and-set, with a fresh token)."""
    phase, sep, token = raw.partition(":")
    if sep and phase in (OK, WARMING, SUSPECT) and _TOKEN.fullmatch(token):
        return State(raw, phase, token)
    return State(raw, SUSPECT, blake2b(raw.encode(), digest_size=8).hexdigest())


def _new_token() -> str:
    return secrets.token_hex(8)


class Cell(Protocol):
    """Where the cache state is shared between processes."""

    def read(self) -> str | None:
        """The value, or None if there is none yet."""
        ...

    def swap(self, old: str | None, new: str) -> bool:
        """Store ``new`` only if the value is still ``old`` (None: absent)."""
        ...


class CatalogCell:
    """The cache state in the catalog: row ``cache_state`` of ``bagstore_meta``."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def read(self) -> str | None:
        rows = self.backend.select_all("bagstore_meta", ("value",), {"name": ROW})
        return str(rows[0][0]) if rows else None

    def swap(self, old: str | None, new: str) -> bool:
        if old is None:
            self.backend.insert_ignore("bagstore_meta", ("name", "value"), [(ROW, new)])
            return self.read() == new
        changed = self.backend.update("bagstore_meta", {"value": new}, {"name": ROW, "value": old})
        return changed > 0


class Shared:
    """One store's level-2 state in this process, for one cache server set.

    ``snapshot`` is ``(state, read_at, since)``: the state, a monotonic time at
    or before which the cell held it (its copy is fresh until ``read_at`` +
    :data:`CHECK_INTERVAL`), and the time this process first knew of it (at or
    after the cell took it).  ``pending`` maps each key whose invalidation was
    not confirmed to what must be sent again (a marker, or None: a revision bump).
    """

    def __init__(self, local: bool) -> None:
        self.local = local
        self.snapshot: tuple[State, float, float] | None = (
            (LOCAL, float("inf"), 0.0) if local else None
        )
        self.pending: OrderedDict[str, bytes | None] = OrderedDict()
        self.retry_at = 0.0
        self.lock = threading.Lock()  # guards pending and retry_at
        self._cell_lock = threading.Lock()  # one exchange with the cell at a time
        self._advancing = False

    # -- the state ---------------------------------------------------------------------
    def view(self, cell: Cell | None, probe: Callable[[], bool]) -> State | None:
        """The state to go by now (read from ``cell`` again when the copy is older
        than the interval); None if no fresh copy could be had (level 2 is then
        not trusted)."""
        snap = self.snapshot
        if snap is not None and time.monotonic() - snap[1] < CHECK_INTERVAL:
            return snap[0]
        if cell is None:
            return None
        with self._cell_lock:
            snap = self.snapshot
            if snap is None or time.monotonic() - snap[1] >= CHECK_INTERVAL:
                try:
                    snap = self._read(cell)
                except BackendError as exc:  # the catalog is unreachable: trust nothing
                    log.warning("cache: could not read the shared cache state (%s)", exc)
                    return None
        self._advance(cell, probe, snap)
        snap = self.snapshot
        return snap[0] if snap is not None and time.monotonic() - snap[1] < CHECK_INTERVAL else None

    def _read(self, cell: Cell) -> tuple[State, float, float]:
        """Read the cell (creating it ``ok`` under a new token on first use; held:
        ``_cell_lock``)."""
        start = time.monotonic()
        raw = cell.read()
        if raw is None:
            cell.swap(None, f"{OK}:{_new_token()}")
            raw = cell.read()
            if raw is None:
                raise RuntimeError("the cache state row could not be created")
        return self._take(parse(raw), start)

    def _take(self, state: State, read_at: float) -> tuple[State, float, float]:
        old = self.snapshot
        since = old[2] if old is not None and old[0].raw == state.raw else time.monotonic()
        snap = (state, read_at, since)
        self.snapshot = snap
        return snap

    def _advance(
        self, cell: Cell, probe: Callable[[], bool], snap: tuple[State, float, float]
    ) -> None:
        """Move a phase held long enough one step on: ``suspect`` (once the cache
        answers) to ``warming`` under a new token, ``warming`` to ``ok``."""
        state, _, since = snap
        if state.phase == OK or time.monotonic() - since < HOLD or self._advancing:
            return
        self._advancing = True
        try:
            if state.phase == SUSPECT and not probe():
                return
            new = f"{WARMING}:{_new_token()}" if state.phase == SUSPECT else f"{OK}:{state.token}"
            with self._cell_lock:
                if self.snapshot is None or self.snapshot[0].raw != state.raw:
                    return
                start = time.monotonic()
                if cell.swap(state.raw, new):
                    self._take(parse(new), start)
                else:
                    self._read(cell)
        except BackendError as exc:
            log.warning("cache: could not advance the shared cache state (%s)", exc)
        finally:
            self._advancing = False

    def unconfirmed(self, cell: Cell | None, token: str | None) -> float:
        """An invalidation sent under ``token`` was not confirmed: make sure that
        no process trusts that token's entries any more.  Returns the monotonic
        time until which the writer must wait (0: no wait)."""
        if cell is None or self.local:
            return 0.0
        with self._cell_lock:
            for _ in range(4):
                try:
                    state, _, since = self._read(cell)
                    if token is not None and state.token != token:
                        # A new token since the writer's view: it was made after
                        # that view was read, and is trusted a hold later, by when
                        # the write had committed.  Nothing of the old one is trusted.
                        return 0.0
                    if state.phase == SUSPECT:
                        return since + HOLD
                    start = time.monotonic()
                    new = f"{SUSPECT}:{state.token}"
                    if cell.swap(state.raw, new):
                        return self._take(parse(new), start)[2] + HOLD
                except BackendError as exc:
                    log.warning(
                        "cache: could not mark the cache state suspect (%s); other processes "
                        "may read entries an unconfirmed invalidation should have replaced",
                        exc,
                    )
                    return 0.0
        log.warning("cache: the shared cache state kept changing; not marked suspect")
        return 0.0

    # -- keys whose invalidation was not confirmed -------------------------------------
    def remember(self, items: Mapping[str, bytes | None]) -> None:
        with self.lock:
            for k, v in items.items():
                self.pending[k] = v
                self.pending.move_to_end(k)
            while len(self.pending) > MAX_PENDING:
                dropped, _ = self.pending.popitem(last=False)
                log.warning("cache: too many failed invalidations; forgetting %s", dropped)


_shared: dict[tuple[str, str], Shared] = {}
_shared_lock = threading.Lock()


def shared_for(servers: str, store: str | None) -> Shared:
    """The process's :class:`Shared` for a cache server set and a store (None:
    no store, e.g. an in-process cache: the state is local)."""
    key = (servers, store or "")
    with _shared_lock:
        found = _shared.get(key)
        if found is None:
            found = _shared[key] = Shared(local=store is None)
        return found
