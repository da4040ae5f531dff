"""Replication commands of ``bagstore``: ``shard failover`` and the replicas
part of ``status`` (docs/replication.md).

    $ bagstore --config app.toml shard failover 0 --to db1r:3306
    $ bagstore --config app.toml status      # each server's role, lag, semi-sync
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

import click
from rich.markup import escape
from rich.table import Table

from bagstore.cli import CliError, _out, _print_json, _store
from bagstore.cli_errors import Numbers
from bagstore.cli_ops import shard_group
from bagstore.sharding.failover import add_replica, failover
from bagstore.sharding.replicas import servers_status

__all__ = ["replication_table", "shard_add_replica", "shard_failover", "shard_watch"]

log = logging.getLogger("bagstore.replication")


@shard_group.command("failover")
@click.argument("shard")
@click.option("--to", "to", metavar="HOST:PORT", help="The replica to promote.")
@click.option("--user", default=None, help="Administrative login (default: the shard's own).")
@click.option("--replication-user", default=None, help="The login replicas use (default: --user).")
@click.option("--timeout", type=Numbers(0.1), default=30.0, show_default=True,
              help="Seconds the target may take to catch up.")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def shard_failover(
    ctx: click.Context,
    shard: str,
    to: str | None,
    user: str | None,
    replication_user: str | None,
    timeout: float,
    as_json: bool,
) -> None:
    """Make replica --to the primary of SHARD (its number, its name in `shard
    list`, its URL, or `catalog`): a planned switchover while the primary
    answers; when it cannot be reached, the most advanced replica is promoted
    (--to, if given, must be one of them) and the old primary is refused from
    then on.  Passwords: BAGSTORE_ADMIN_PASSWORD and
    BAGSTORE_REPLICATION_PASSWORD."""
    ds = _store(ctx)
    done = failover(
        ds.router,
        shard,
        to=to,
        user=user,
        password=os.environ.get("BAGSTORE_ADMIN_PASSWORD") if user else None,
        replication_user=replication_user,
        replication_password=os.environ.get("BAGSTORE_REPLICATION_PASSWORD"),
        timeout=timeout,
    )
    if as_json:
        _print_json(done)
        return
    kind = "switchover" if done["planned"] else "failover"
    _out().print(
        f"shard {escape(done['shard'])}: {kind} from {escape(done['old_primary'])} to "
        f"{escape(done['primary'])} (epoch {done['epoch']}, {done['seconds']:.2f} s)"
    )


@shard_group.command("add-replica")
@click.argument("shard")
@click.argument("address", metavar="HOST:PORT")
@click.option("--user", default=None, help="Administrative login (default: the shard's own).")
@click.pass_context
def shard_add_replica(ctx: click.Context, shard: str, address: str, user: str | None) -> None:
    """Record HOST:PORT as a replica of SHARD again (a rebuilt old primary): it
    must replicate from the primary and be read-only.  Password:
    BAGSTORE_ADMIN_PASSWORD."""
    ds = _store(ctx)
    password = os.environ.get("BAGSTORE_ADMIN_PASSWORD") if user else None
    done = add_replica(ds.router, shard, address, user=user, password=password)
    _out().print(
        f"shard {escape(done['shard'])}: {escape(address)} is a replica (epoch {done['epoch']})"
    )


def replication_table(report: list[dict[str, Any]]) -> Table:
    """``bagstore status``'s table of replicated servers."""
    table = Table(title="Replication", title_justify="left")
    for column in ("shard", "server", "role", "lag", "position", "semi-sync"):
        table.add_column(column)
    for s in report:
        semi = s.get("semi_sync") or {}
        if s["role"] == "primary" and semi.get("enabled"):
            sync = "on" if semi.get("active") else "[red]fell back to async[/]"
        else:
            sync = "-" if s["role"] == "primary" else ""
        lag = "" if s.get("lag") is None else f"{s['lag']} s"
        table.add_row(s["shard"], s["server"], s["role"], lag, s.get("position", ""), sync)
    return table


def status_part(ds: Any) -> list[dict[str, Any]]:
    """The servers of the replicated shards, logged when semi-sync fell back."""
    report = servers_status(ds.router)
    for s in report:
        semi = s.get("semi_sync") or {}
        if s["role"] == "primary" and semi.get("enabled") and not semi.get("active"):
            log.warning(
                "shard %s: semi-synchronous replication on %s fell back to asynchronous "
                "(no replica acknowledged in time): acknowledged writes may be lost in a "
                "failover until it is back",
                s["shard"], s["server"],
            )  # fmt: skip
    return report


@shard_group.command("watch")
@click.option("--interval", type=Numbers(0.05), default=1.0, show_default=True,
              help="Seconds between probes.")  # fmt: skip
@click.option("--failures", type=click.IntRange(1), default=3, show_default=True,
              help="Failed probes in a row before a failover.")  # fmt: skip
@click.option("--lease", type=Numbers(0.1), default=10.0, show_default=True,
              help="Seconds the lease in the catalog lasts unless renewed.")  # fmt: skip
@click.option("--user", default=None, help="Administrative login (default: the shard's own).")
@click.option("--replication-user", default=None, help="The login replicas use.")
@click.pass_context
def shard_watch(
    ctx: click.Context,
    interval: float,
    failures: int,
    lease: float,
    user: str | None,
    replication_user: str | None,
) -> None:
    """Probe the primaries of the replicated shards and fail one over after
    --failures failed probes, while holding the lease in the catalog (two
    watchers never both act). Never the catalog's own servers: fail those
    over with `shard failover catalog`. Runs until Ctrl-C."""
    from bagstore.sharding.watch import Watcher

    ds = _store(ctx)
    watcher = Watcher(
        ds.router,
        interval=interval,
        failures=failures,
        lease=lease,
        user=user,
        password=os.environ.get("BAGSTORE_ADMIN_PASSWORD") if user else None,
        replication_user=replication_user,
        replication_password=os.environ.get("BAGSTORE_REPLICATION_PASSWORD"),
    )
    shards = [name for name, _ in watcher.shards()]
    if not shards:
        raise CliError("no replicated shard to watch (outside the catalog's servers)")
    _out().print(f"watching shard(s) {', '.join(shards)} as {escape(watcher.name)}")
    with contextlib.suppress(KeyboardInterrupt):
        watcher.run()
    for done in watcher.done:
        _out().print(f"failed shard {done['shard']} over to {escape(done['primary'])}")
