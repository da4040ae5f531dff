"""Switchover and failover of a replicated shard (or of the catalog).

Decided in one place, never by every client: :func:`failover` is what
``ds.failover(shard, to=...)`` and ``bagstore shard failover SHARD --to
HOST:PORT`` run (docs/replication.md).

* **Planned switchover** (the primary answers): the old primary turns
  ``read_only``, records the new role (next epoch) in its role row, which
  replicates to every replica, and closes its clients' connections; the
  target waits (``MASTER_GTID_WAIT``) until it applied the old primary's
  position, and is promoted (``STOP SLAVE``, ``RESET SLAVE ALL``,
  ``read_only=OFF``); the other replicas and the old primary follow it
  (``CHANGE MASTER TO ... MASTER_USE_GTID=slave_pos``).  Writers pause,
  at most ``writable_wait`` seconds, and lose nothing.
* **Unplanned failover** (the primary cannot be reached): every reachable
  replica stops receiving and applies what it received; the most advanced
  one is promoted (``to``, if given, must be among the most advanced), the
  others follow it, and the old primary is *retired*: it may hold
  transactions no replica has, so it is never pointed at the new primary;
  docs/replication.md says how to rebuild it.

Either way the new role is written to the catalog (``topology:<shard>``) with
a placement version bump (the epoch), so every process re-reads where the
primary is, as it does after bucket moves.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from bagstore.backends.consumersql import bump_epoch
from bagstore.backends.mysql import MySQLBackend
from bagstore.errors import BackendError, ConfigurationError
from bagstore.sharding.replicas import RECORD, record_json

if TYPE_CHECKING:
    from bagstore.backends import Backend
    from bagstore.backends.replication import Role
    from bagstore.sharding.router import Router

__all__ = ["add_replica", "failover", "find_shard"]

log = logging.getLogger("bagstore.replication")


def find_shard(router: Router, shard: int | str) -> tuple[str, MySQLBackend]:
    """``("3", backend)`` of a shard given by number, by its name in ``bagstore
    shard list`` or its URL as configured, or ``"catalog"``."""
    from bagstore.catalog import _where

    backends = router.backends
    found: tuple[str, Backend] | None = None
    if shard == "catalog":
        catalog = router.catalog.backend
        # (the catalog in a shard's database is that shard: one role, one record)
        shared = [str(no) for no, b in enumerate(backends) if b is catalog]
        found = (shared[0] if shared else "catalog", catalog)
    elif isinstance(shard, int) and not isinstance(shard, bool):
        if 0 <= shard < len(backends):
            found = (str(shard), backends[shard])
    elif isinstance(shard, str):
        if shard.isdigit() and int(shard) < len(backends):
            found = (shard, backends[int(shard)])
        else:
            where = _where(shard.split("?", 1)[0])
            names = router.placement.shard_names
            for no, backend in enumerate(backends):
                if where in (_where(backend.name), _where(names[no])):
                    found = (str(no), backend)
                    break
    if found is None:
        raise ConfigurationError(
            f"no shard {shard!r} (give its number, its name in 'bagstore shard list', "
            "its URL, or 'catalog')"
        )
    name, backend = found
    if not isinstance(backend, MySQLBackend) or not backend.replicated:
        raise ConfigurationError(f"shard {shard!r} has no replicas (replica= in its URL)")
    return name, backend


def _address(value: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigurationError(f"--to {value!r} is not host:port")
    return f"{host}:{int(port)}"


def failover(
    router: Router,
    shard: int | str,
    *,
    to: str | None = None,
    user: str | None = None,
    password: str | None = None,
    replication_user: str | None = None,
    replication_password: str | None = None,
    timeout: float = 30.0,
) -> dict[str, Any]:
    """Make ``to`` (or, if the primary is down, the most advanced replica) the
    shard's primary; returns what was done: ``{"shard", "planned", "primary",
    "old_primary", "epoch", "seconds"}``.  ``user``/``password``: an
    administrative login (default the shard's own); ``replication_*``: the
    login replicas use to reach the new primary (default the same)."""
    from bagstore.backends.replication import Role, Servers, ahead

    started = time.monotonic()
    name, backend = find_shard(router, shard)
    replication = router.replication
    role, _, reachable = replication.discover(backend)
    replication.apply(backend, role)
    servers = Servers(backend, user=user, password=password)
    admin = Servers(backend, user=user, password=password, quick=True)
    repl_user = replication_user or user or str(backend._settings["user"])
    if replication_password is not None:
        repl_password = replication_password
    elif user is not None:
        repl_password = password or ""
    else:
        repl_password = str(backend._settings["password"])
    target = _address(to) if to is not None else None
    if target is not None and target not in role.replicas:
        why = "an old primary refused since" if target in role.retired else "not a replica"
        raise ConfigurationError(
            f"{target} is {why} of shard {name} (its replicas: {', '.join(role.replicas)}); "
            "an old primary must be rebuilt as a replica first (docs/replication.md)"
        )
    # (the catalog's own version is read only where it is not on this group)
    shared = backend is router.catalog.backend
    epoch = max(role.epoch, 0 if shared else router.catalog.placement_version()) + 1
    old = role.primary
    if reachable:
        if target is None:
            raise ConfigurationError(
                f"the primary of shard {name} ({old}) answers: name the replica to switch "
                "to (--to HOST:PORT)"
            )
        others = tuple(r for r in role.replicas if r != target)
        new = Role(epoch, target, (*others, old), role.retired)
        log.warning("shard %s: switching its primary from %s to %s", name, old, target)
        if servers.source_of(old) == target:
            # A crossed master-master pair (Yupoo's): both sides stay writable
            # for their other databases and keep replicating each other; only
            # this database's side changes (auto_increment_offset keeps their
            # added_id apart).  The target takes writes once the role row,
            # written after the old side's last transaction, has reached it.
            servers.fence_database(old, new)
            return _finish(router, name, backend, new, old, True, started)
        position = servers.fence(old, new)
        if not servers.gtid_wait(target, position, timeout):
            # undo, at the next epoch again: the old primary stays
            servers.write_role(old, Role(epoch + 1, old, role.replicas, role.retired))
            servers._run(old, [("SET GLOBAL read_only = OFF", ())])
            raise ConfigurationError(
                f"{target} did not reach the primary's position {position} within "
                f"{timeout:g} s; the switchover was abandoned and {old} is the primary again"
            )
        servers.promote(target, new)
        for replica in others:
            _follow(servers, replica, target, repl_user, repl_password)
        servers.point_at(old, target, repl_user, repl_password, was_primary=True)
    else:
        positions: dict[str, str] = {}
        for replica in role.replicas:
            try:
                admin.stop_io(replica)
                positions[replica] = admin.wait_applied(replica, timeout)
            except BackendError as exc:
                log.warning("shard %s: replica %s cannot be promoted: %s", name, replica, exc)
        if not positions:
            raise ConfigurationError(
                f"shard {name}: its primary {old} and every replica are unreachable"
            )
        best = [a for a, p in positions.items() if not any(ahead(q, p) for q in positions.values())]
        if target is not None and target not in best:
            raise ConfigurationError(
                f"{target} is behind {', '.join(best)} ({positions}): promoting it would lose "
                "transactions; leave --to out or name one of those"
            )
        target = target or best[0]
        others = tuple(r for r in role.replicas if r != target)
        new = Role(epoch, target, others, (*role.retired, old))
        log.warning(
            "shard %s: primary %s unreachable; promoting %s (position %s)",
            name, old, target, positions[target],
        )  # fmt: skip
        servers.promote(target, new)
        for replica in others:
            _follow(servers, replica, target, repl_user, repl_password)
    return _finish(router, name, backend, new, old, reachable, started)


def _finish(
    router: Router,
    name: str,
    backend: MySQLBackend,
    new: Role,
    old: str,
    planned: bool,
    started: float,
) -> dict[str, Any]:
    """Route by the new role here, record it in the catalog; the report."""
    router.replication.guard_to(backend, new)
    _record(router, name, new)
    if not planned:
        # The old primary may have committed changes a consumer already read
        # and no replica received: their positions will be handed out again.
        feed_epoch = bump_epoch(router.catalog.backend)
        log.warning("shard %s: change feed epoch %d (older cursors refused)", name, feed_epoch)
    router.refresh(force=True)  # this process routes by the new epoch at once
    seconds = time.monotonic() - started
    log.warning("shard %s: primary is %s (epoch %d), %.2f s", name, new.primary, new.epoch, seconds)
    return {
        "shard": name,
        "planned": planned,
        "primary": new.primary,
        "old_primary": old,
        "epoch": new.epoch,
        "seconds": round(seconds, 3),
    }


def _follow(servers: Any, replica: str, primary: str, user: str, password: str) -> None:
    """Point a replica at the new primary (one that cannot be reached now
    keeps its old settings: docs/replication.md)."""
    try:
        servers.point_at(replica, primary, user, password)
    except BackendError as exc:
        log.warning("replica %s not repointed to %s: %s", replica, primary, exc)


def _record(router: Router, name: str, role: Role) -> None:
    """The new role in the catalog, with the epoch as the placement version:
    every process re-reads where its primaries are at its next refresh."""
    catalog = router.catalog
    catalog.set_meta(RECORD + name, record_json(role))
    version = max(role.epoch, catalog.placement_version() + 1)
    catalog.set_meta("placement_version", str(version))


def add_replica(
    router: Router,
    shard: int | str,
    address: str,
    *,
    user: str | None = None,
    password: str | None = None,
) -> dict[str, Any]:
    """Record ``address`` (a rebuilt old primary, or a new server) as a replica
    of the shard, at the next epoch: it must already replicate from the
    primary and be read-only (docs/replication.md, "Rebuilding")."""
    from bagstore.backends.replication import Role, Servers

    started = time.monotonic()
    name, backend = find_shard(router, shard)
    address = _address(address)
    role, _, reachable = router.replication.discover(backend)
    if not reachable:
        raise ConfigurationError(f"the primary of shard {name} ({role.primary}) cannot be reached")
    servers = Servers(backend, user=user, password=password)
    source = servers.source_of(address)
    read_only = servers.role(address)[1]
    if source != role.primary or not read_only:
        raise ConfigurationError(
            f"{address} must replicate from the primary {role.primary} (it replicates from "
            f"{source or 'nothing'}) and be read-only (it is {'' if read_only else 'not '}"
            "read-only) before it is a replica"
        )
    shared = backend is router.catalog.backend
    epoch = max(role.epoch, 0 if shared else router.catalog.placement_version()) + 1
    new = Role(
        epoch,
        role.primary,
        (*[r for r in role.replicas if r != address], address),
        tuple(r for r in role.retired if r != address),
    )
    servers.write_role(role.primary, new)
    return _finish(router, name, backend, new, role.primary, True, started)
