"""``bagstore shard watch``: the one process that decides an unplanned failover.

A :class:`Watcher` probes the primary of every replicated shard; after
``failures`` failed probes in a row it runs the unplanned failover of
:mod:`bagstore.sharding.failover` (the most advanced replica promoted).  Only
the holder of the **lease** acts: a row of the catalog (``watch_lease``: the
holder and until when), taken by a compare-and-set update and renewed every
round, so that two watchers never both fail a shard over; the other one
waits and takes the lease over when it expires.

A watcher never fails over the group of servers that holds the catalog, where
its own lease lives (it could not tell its own outage from the primary's):
that failover is a person's, by ``bagstore shard failover catalog``.  It logs
the probes that fail and, on each primary, a semi-synchronous replication
that fell back to asynchronous.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

from bagstore.errors import BackendError, ConfigurationError

if TYPE_CHECKING:
    from bagstore.backends.mysql import MySQLBackend
    from bagstore.sharding.router import Router

__all__ = ["Watcher"]

log = logging.getLogger("bagstore.replication")

LEASE = "watch_lease"


class Watcher:
    """Probes primaries every ``interval`` seconds; fails a shard over after
    ``failures`` failed probes in a row, while holding the lease (``lease``
    seconds, renewed each round).  ``options`` go to the failover (logins)."""

    def __init__(
        self,
        router: Router,
        *,
        interval: float = 1.0,
        failures: int = 3,
        lease: float = 10.0,
        name: str | None = None,
        **options: Any,
    ) -> None:
        if not interval > 0 or not isinstance(failures, int) or failures < 1 or not lease > 0:
            raise ConfigurationError(
                "watch needs interval > 0, failures >= 1 and lease > 0 (seconds)"
            )
        self.router = router
        self.interval = interval
        self.failures = failures
        self.lease = lease
        self.name = name or f"{socket.gethostname()}:{os.getpid()}:{id(self):x}"
        self.options = options
        self._missed: dict[str, int] = {}
        #: failovers this watcher ran (what :func:`failover` returned)
        self.done: list[dict[str, Any]] = []
        #: rounds run so far
        self.rounds = 0

    # -- the lease -------------------------------------------------------------------------
    def hold(self) -> bool:
        """Take or renew the lease; whether this watcher holds it now."""
        catalog = self.router.catalog
        now = time.time()
        mine = json.dumps({"holder": self.name, "until": now + self.lease})
        b = catalog.backend
        b.insert_ignore("bagstore_meta", ("name", "value"), [(LEASE, mine)])
        rows = b.select_all("bagstore_meta", ("value",), {"name": LEASE})
        current = str(rows[0][0])
        held = json.loads(current)
        if held["holder"] != self.name and held["until"] > now:
            return False
        # compare-and-set: only if the row is still what was read
        return b.update("bagstore_meta", {"value": mine}, {"name": LEASE, "value": current}) == 1

    def release(self) -> None:
        b = self.router.catalog.backend
        rows = b.select_all("bagstore_meta", ("value",), {"name": LEASE})
        if rows and json.loads(str(rows[0][0]))["holder"] == self.name:
            b.delete_where("bagstore_meta", {"name": LEASE, "value": rows[0][0]})

    # -- probes ----------------------------------------------------------------------------
    def shards(self) -> list[tuple[str, MySQLBackend]]:
        """The replicated shards this watcher may fail over (not the catalog's group)."""
        from bagstore.backends.mysql import MySQLBackend

        catalog = self.router.catalog.backend
        out = []
        for no, b in enumerate(self.router.backends):
            if isinstance(b, MySQLBackend) and b.replicated and not _same_server(b, catalog):
                out.append((str(no), b))
        return out

    def once(self) -> list[dict[str, Any]]:
        """One round: renew the lease; if held, probe and fail over what
        failed ``failures`` times in a row.  The failovers run."""
        from bagstore.backends.replication import Servers
        from bagstore.sharding.failover import failover

        self.rounds += 1
        try:
            if not self.hold():
                self._missed.clear()
                return []
        except BackendError as exc:
            log.warning("watch: the catalog cannot be reached (%s); not acting", exc)
            return []
        ran = []
        for name, backend in self.shards():
            role = self.router.replication.role_of(backend)
            assert role is not None
            probe = Servers(backend, quick=True)
            try:
                semi = probe.semi_sync(role.primary)
                self._missed[name] = 0
                if semi["enabled"] and not semi["active"]:
                    log.warning(
                        "shard %s: semi-synchronous replication on %s fell back to "
                        "asynchronous: acknowledged writes may be lost in a failover",
                        name, role.primary,
                    )  # fmt: skip
                continue
            except BackendError as exc:
                self._missed[name] = self._missed.get(name, 0) + 1
                log.warning(
                    "shard %s: probe %d/%d of primary %s failed: %s",
                    name, self._missed[name], self.failures, role.primary, exc,
                )  # fmt: skip
            if self._missed[name] >= self.failures and self.hold():
                done = failover(self.router, name, **self.options)
                self._missed[name] = 0
                self.done.append(done)
                ran.append(done)
        return ran

    def run(self, stop: threading.Event | None = None) -> None:
        """Rounds every ``interval`` seconds until ``stop`` is set (Ctrl-C at the CLI)."""
        stop = stop or threading.Event()
        try:
            while not stop.is_set():
                started = time.monotonic()
                self.once()
                stop.wait(max(0.0, self.interval - (time.monotonic() - started)))
        finally:
            with contextlib.suppress(BackendError):
                self.release()


def _same_server(a: MySQLBackend, b: Any) -> bool:
    """Whether ``b`` (the catalog's backend) lives on one of ``a``'s servers."""
    if a is b:
        return True
    servers = {str(a.server), *a.replicas}
    return getattr(b, "server", None) in servers
