"""``bagstore index list|add|retire|drop|rename``: an index's life cycle.

The commands register on the ``cli`` group of :mod:`bagstore.cli` (which
imports this module at its end)."""

from __future__ import annotations

import click

import bagstore
from bagstore.cli import _index_doc, _index_table, _out, _print_json, _store, cli


# -- indexes -----------------------------------------------------------------------
@cli.group("index", short_help="List, add, retire, drop and rename indexes.")
def index_group() -> None:
    """List, add, retire, drop and rename secondary indexes (each a table on every shard)."""


@index_group.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.pass_context
def index_list(ctx: click.Context, as_json: bool) -> None:
    """Every index of the kind, with its state (building, ready, retired)."""
    indexes = _store(ctx).indexes()
    if as_json:
        _print_json([_index_doc(i, s) for _, (i, s) in sorted(indexes.items())])
    elif indexes:
        _out().print(_index_table(indexes))
    else:
        click.echo("No indexes.")


@index_group.command("add")
@click.argument("name")
@click.option("--properties", required=True, help="Comma-separated property names, in index order.")
@click.option("--shard-on", help="The property whose value places a row (default: the first).")
@click.option("--unique", is_flag=True, help="At most one entity per value.")
@click.option("--json", "as_json", is_flag=True, help="Print the index as JSON (as `index list`).")
@click.pass_context
def index_add(
    ctx: click.Context,
    name: str,
    properties: str,
    shard_on: str | None,
    unique: bool,
    as_json: bool,
) -> None:
    """Register index NAME; its tables are created on every shard at once.

    On a kind with no entities it is ready at once; otherwise it is building
    (every write maintains it, old entities are not in it until backfilled).
    """
    props = [p.strip() for p in properties.split(",") if p.strip()]
    index = bagstore.Index(table=name, properties=props, shard_on=shard_on, unique=unique)
    state = _store(ctx).add_index(index)
    if as_json:
        _print_json(_index_doc(index, state))
    else:
        click.echo(f"index {name}: {state}")
    if state == "building":
        click.echo(
            "every write maintains it from now on; entities stored before are not in it "
            f"until it is backfilled with `bagstore clean --index {name}`; query it with "
            "--partial meanwhile",
            err=True,
        )


@index_group.command("retire")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help='Print {"table": NAME, "state": "retired"}.')
@click.pass_context
def index_retire(ctx: click.Context, name: str, as_json: bool) -> None:
    """Stop maintaining index NAME (queries on it fail; its tables stay)."""
    _store(ctx).retire_index(name)
    if as_json:
        _print_json({"table": name, "state": "retired"})
    else:
        click.echo(f"index {name}: retired")


@index_group.command("drop")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help='Print {"table": NAME, "state": "dropped"}.')
@click.pass_context
def index_drop(ctx: click.Context, name: str, as_json: bool) -> None:
    """Drop the tables of retired index NAME on every shard and forget it."""
    _store(ctx).drop_index(name)
    if as_json:
        _print_json({"table": name, "state": "dropped"})
    else:
        click.echo(f"index {name}: dropped")


@index_group.command("rename")
@click.argument("old")
@click.argument("new")
@click.option("--settle", type=float, help="Seconds to wait before the backfill reads.")
@click.option("--json", "as_json", is_flag=True, help='Print {"table": NEW, "state": ...}.')
@click.pass_context
def index_rename(
    ctx: click.Context, old: str, new: str, settle: float | None, as_json: bool
) -> None:
    """Replace index OLD by the same index named NEW: NEW is built and backfilled,
    then OLD is retired and forgotten.  A table that is a kind's (an index named
    like a kind, see `bagstore check`) is never dropped or written."""
    state = _store(ctx).rename_index(old, new, settle=settle)
    if as_json:
        _print_json({"table": new, "state": state, "replaced": old})
    else:
        click.echo(f"index {new}: {state} (replaces {old})")
