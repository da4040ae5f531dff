"""``bagstore feed on|off``, ``bagstore changes`` and ``bagstore consumers``:
the change feed at the command line (docs/changes.md).

The commands register on the ``cli`` group of :mod:`bagstore.cli` (which
imports this module at its end)."""

from __future__ import annotations

import time
from typing import Any

import click

from bagstore.changes import Change
from bagstore.cli import _out, _print_json, _store, cli
from bagstore.cli_errors import Numbers
from bagstore.cli_json import dumps_json
from bagstore.consumeradmin import pruned_note
from bagstore.retention import prune_changes


def change_doc(c: Change) -> dict[str, Any]:
    """A change as one JSON document (ids in hex)."""
    return {
        "kind": c.kind,
        "id": c.id.hex(),
        "op": c.op,
        "version": c.version,
        "updated": c.updated,
        "entity": c.entity,
    }


@cli.command("feed", short_help="Switch the kind's change feed on or off.")
@click.argument("state", type=click.Choice(["on", "off"]))
@click.option("--bodies", is_flag=True, help="Record each put's new body in its change.")
@click.option("--max-age", type=int, default=7 * 24 * 3600, help="Seconds changes are kept.")
@click.option("--max-changes", type=int, default=1_000_000, help="Changes kept per bucket.")
@click.pass_context
def feed(ctx: click.Context, state: str, bodies: bool, max_age: int, max_changes: int) -> None:
    """Record every write of the kind as a change (on), or stop (off)."""
    ds = _store(ctx)
    if state == "on":
        ds.feed.enable(bodies=bodies, max_age=max_age, max_changes=max_changes)
    else:
        ds.feed.disable()
    click.echo(f"change feed of kind {ds.kind!r}: {state}")


@cli.command("changes", short_help="Print the change feed, one line per change.")
@click.option("--kind", help="Another kind's changes (default: the store's kind).")
@click.option("--since", help="A cursor printed before: the changes after it.")
@click.option("--limit", type=int, default=1000, help="Changes per page (default 1000).")
@click.option("--follow", is_flag=True, help="Keep printing new changes as they commit.")
@click.option(
    "--interval",
    type=Numbers(0.001, 3600),
    default=0.2,
    help="Seconds between polls (--follow; 0.001 to 3600).",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON document per line.")
@click.pass_context
def changes(
    ctx: click.Context,
    kind: str | None,
    since: str | None,
    limit: int,
    follow: bool,
    interval: float,
    as_json: bool,
) -> None:
    """Print committed writes in order; the cursor to resume from goes to
    stderr after each page (``cursor: ...``)."""
    ds = _store(ctx)
    while True:
        page = ds.changes(since=since, limit=limit, kind=kind)
        for c in page:
            if as_json:
                click.echo(dumps_json(change_doc(c)))
            else:
                click.echo(f"{c.op:6} {c.id.hex()} v{c.version} {c.updated}")
        if page or since is None:
            click.echo(f"cursor: {page.cursor}", err=True)
        since = page.cursor
        if not page:
            if not follow:
                return
            time.sleep(interval)


@cli.group("consumers", invoke_without_command=True, short_help="Consumers and their lag.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.pass_context
def consumers(ctx: click.Context, as_json: bool) -> None:
    """List the named consumers of the change feed and their lag."""
    if ctx.invoked_subcommand is not None:
        return
    rows = _store(ctx).feed.consumers()
    if as_json:
        _print_json(rows)
        return
    if not rows:
        click.echo("No consumers.")
    print_lags(_out(), rows)


def print_lags(out: Any, rows: list[dict[str, Any]], status: bool = False) -> None:
    """Each consumer's lag, a line each (as ``bagstore status`` shows them with
    ``status``), and what one whose unhandled changes were pruned is told."""
    for r in rows:
        lag = f"lag {r['lag_changes']} changes, {r['lag_seconds']} s"
        if status:
            out.print(f"consumer {r['name']}: {lag}")
        else:
            out.print(f"{r['name']}  kind {r['kind']!r}  {lag}  processes {r['processes']}")
        if r["lag_pruned"]:
            out.print(f"  [bold red]{pruned_note(r)}[/]")


@consumers.command("drop")
@click.argument("name")
@click.pass_context
def consumers_drop(ctx: click.Context, name: str) -> None:
    """Forget consumer NAME (its positions and leases)."""
    _store(ctx).feed.drop_consumer(name)
    click.echo(f"consumer {name!r} dropped")


@consumers.command("reset")
@click.argument("name")
@click.option("--to", type=click.Choice(["start", "end"]), default="start", show_default=True)
@click.pass_context
def consumers_reset(ctx: click.Context, name: str, to: str) -> None:
    """Set consumer NAME back to the oldest change kept, or on past the newest."""
    _store(ctx).feed.reset_consumer(name, to=to)
    click.echo(f"consumer {name!r} reset to the {to}")


@consumers.command("prune")
@click.pass_context
def consumers_prune(ctx: click.Context) -> None:
    """Delete the changes retention allows (what the Cleaner does)."""
    n = prune_changes(_store(ctx).feed)
    click.echo(f"{n} changes deleted")
