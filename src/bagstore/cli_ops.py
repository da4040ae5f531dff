"""Operational commands of ``bagstore``: clean, shard, key, seq, bench.

They register on the ``cli`` group of :mod:`bagstore.cli` (which imports this
module) and, like every command, only parse arguments and call the library.

    $ bagstore clean --index index_link         # backfill, with a progress bar
    $ bagstore clean --follow                   # repair continuously (Ctrl-C stops)
    $ bagstore shard add mysql://app@db3:3306/app_2 && bagstore shard rebalance
    $ bagstore key migrate --kind posts ann 17
    $ bagstore seq next photos -n 3
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskProgressColumn,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table

import bagstore
from bagstore.cli import (
    CliError,
    Target,
    _err,
    _out,
    _print_json,
    _store,
    cli,
    parse_value,
)
from bagstore.config import load_config
from bagstore.scaleout import DEFAULT_BATCH, DEFAULT_DUTY

__all__ = ["bench", "clean", "key_group", "seq_group", "shard_group"]


def _progress() -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TaskProgressColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=_err(),
        transient=False,
    )


def _pacing(duty: float, duty_help: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``--duty`` (with this default and help) and ``--max-rate``: the options that
    pace bulk work (``clean``, ``shard move``, ``shard rebalance``)."""

    def add(fn: Callable[..., Any]) -> Callable[..., Any]:
        fn = click.option(
            "--duty", type=click.FloatRange(0, 10), default=duty, show_default=True, help=duty_help
        )(fn)
        return click.option(
            "--max-rate", type=float, default=None, help="At most this many rows per second."
        )(fn)

    return add


# -- clean ---------------------------------------------------------------------------
@cli.command(short_help="Backfill an index, or repair indexes (once or continuously).")
@click.option("--index", "table", metavar="NAME", help="Backfill this (building) index.")
@click.option("--repair", "repair", is_flag=True, help="One repair pass over every index.")
@click.option("--follow", is_flag=True, help="Repair continuously until Ctrl-C.")
@click.option("--batch", default=1000, show_default=True, help="Entities per statement.")
@_pacing(
    0.5,
    "Pause this fraction of each batch's time after it; batches of one server "
    "take turns (0: every shard at once, flat out).",
)
@click.option("--interval", default=1.0, show_default=True, help="Seconds between --follow passes.")
@click.option("--json", "as_json", is_flag=True, help="Print the counts as JSON.")
@click.pass_context
def clean(
    ctx: click.Context,
    table: str | None,
    repair: bool,
    follow: bool,
    batch: int,
    max_rate: float | None,
    duty: float,
    interval: float,
    as_json: bool,
) -> None:
    """Run the Cleaner.

    --index NAME backfills a building index from the existing entities, shows
    progress with rate and ETA, and marks it ready.  Ctrl-C stops after the
    current batch; run the same command again to resume from the checkpoint.
    --repair writes missing and deletes stale index rows once; --follow keeps
    doing it from the last time it saw.
    """
    if sum(map(bool, (table, repair, follow))) != 1:
        raise click.UsageError("give exactly one of --index NAME, --repair, --follow")
    ds = _store(ctx)
    cleaner = bagstore.Cleaner(ds, batch=batch, max_rate=max_rate, duty=duty)
    stats: bagstore.CleanStats
    try:
        if table is not None:
            with _progress() as progress:
                task = progress.add_task(f"backfill {table}", total=None)

                def advance(done: int, total: int) -> None:
                    progress.update(task, completed=done, total=total)

                stats = cleaner.backfill(table, progress=advance)
            ready = ds.indexes().get(table, (None, "?"))[1]
            _err().print(f"{table}: {ready}")
        elif repair:
            stats = cleaner.repair()
        else:
            err = _err()
            err.print("repairing continuously; Ctrl-C stops")

            def report(s: bagstore.CleanStats) -> None:
                if s.written or s.removed:
                    err.print(f"wrote {s.written}, removed {s.removed} ({s.entities} entities)")

            stats = cleaner.follow(interval=interval, on_pass=report)
    except KeyboardInterrupt:
        _err().print("stopped; run the same command again to resume")
        raise SystemExit(130) from None
    if as_json:
        _print_json(stats.as_dict())
    else:
        _out().print(
            f"wrote {stats.written} rows, removed {stats.removed}, "
            f"read {stats.entities} entities in {stats.seconds:.1f}s"
        )


# -- shard ---------------------------------------------------------------------------
@cli.group("shard")
def shard_group() -> None:
    """Shards and buckets: list, add, move, rebalance, resume, rollback."""


@shard_group.command("list")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def shard_list(ctx: click.Context, as_json: bool) -> None:
    """Every shard with its buckets and entity count, unfinished moves, and
    server settings that would let a move stall writers (see docs/scaleout.md)."""
    ds = _store(ctx)
    status = ds.status()
    moves = bagstore.Mover(ds).unfinished()
    if as_json:
        _print_json({"shards": status["shards"], "unfinished_moves": moves})
        return
    table = Table(title=f"{status['buckets']} buckets", title_justify="left")
    for column in ("shard", "name", "buckets", "entities"):
        table.add_column(column)
    for s in status["shards"]:
        table.add_row(str(s["shard"]), s["name"], str(s["buckets"]), str(s["entities"]))
    out = _out()
    out.print(table)
    for bucket, (source, target, phase) in sorted(moves.items()):
        out.print(f"[yellow]unfinished move: bucket {bucket} {source} -> {target} ({phase})[/]")
    _advise(ds)


@shard_group.command("add")
@click.argument("url")
@click.pass_context
def shard_add(ctx: click.Context, url: str) -> None:
    """Register a new, empty shard (a database URL).  Then move buckets to it
    with `shard rebalance` or `shard move`."""
    number = _store(ctx).add_shard(url)
    _out().print(f"added shard {number}: {url}")


def _advise(ds: bagstore.Datastore) -> None:
    """Print what the shards' servers should change before buckets move."""
    for line in bagstore.Mover(ds).server_advice():
        _out().print(f"[yellow]{escape(line)}[/]")


def _move_report(stats: bagstore.MoveStats) -> None:
    _out().print(
        f"moved {stats.buckets} buckets: {stats.entities} entities, {stats.index_rows} index "
        f"rows copied, {stats.deleted} source rows deleted in {stats.seconds:.1f}s "
        f"(longest freeze {stats.longest_freeze * 1000:.0f} ms)"
    )


def _move_pacing(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``--duty``, ``--max-rate`` and ``--batch`` of ``shard move`` and ``shard rebalance``."""
    fn = click.option(
        "--batch",
        type=click.IntRange(1, 10_000),
        default=DEFAULT_BATCH,
        show_default=True,
        help="Rows per copy or delete step.",
    )(fn)
    return _pacing(
        DEFAULT_DUTY,
        "After each copy or delete step, pause this many times as long as it took "
        "(0: flat out); the final sync of a frozen bucket is never paced.",
    )(fn)


@shard_group.command("move")
@click.option("--to", "target", required=True, help="Target shard: its number or name.")
@click.option("--grace", type=float, default=None, help="Seconds to keep the source copy.")
@_move_pacing
@click.argument("buckets", nargs=-1, type=int, required=True)
@click.pass_context
def shard_move(
    ctx: click.Context,
    target: str,
    grace: float | None,
    duty: float,
    max_rate: float | None,
    batch: int,
    buckets: tuple[int, ...],
) -> None:
    """Move BUCKETS to a shard while serving (copy, freeze, sync, switch)."""
    to: int | str = int(target) if target.isdigit() else target
    ds = _store(ctx)
    _advise(ds)
    _move_report(
        ds.move_buckets(list(buckets), to, grace=grace, duty=duty, max_rate=max_rate, batch=batch)
    )


@shard_group.command("rebalance")
@click.option("--grace", type=float, default=None, help="Seconds to keep source copies.")
@_move_pacing
@click.pass_context
def shard_rebalance(
    ctx: click.Context, grace: float | None, duty: float, max_rate: float | None, batch: int
) -> None:
    """Move buckets until every shard holds an even share."""
    ds = _store(ctx)
    _advise(ds)
    _move_report(ds.rebalance(grace=grace, duty=duty, max_rate=max_rate, batch=batch))


@shard_group.command("resume")
@click.pass_context
def shard_resume(ctx: click.Context) -> None:
    """Finish the moves a killed process left unfinished."""
    _move_report(bagstore.Mover(_store(ctx)).resume())


@shard_group.command("rollback")
@click.argument("bucket", type=int)
@click.pass_context
def shard_rollback(ctx: click.Context, bucket: int) -> None:
    """Undo an unfinished move of BUCKET that has not switched yet."""
    bagstore.Mover(_store(ctx)).rollback(bucket)
    _out().print(f"bucket {bucket}: move rolled back")


# -- key -----------------------------------------------------------------------------
@cli.group("key")
def key_group() -> None:
    """Shard keys of kinds that use the directory shard map."""


@key_group.command("migrate")
@click.option("--kind", required=True, help="The kind (entities table).")
@click.option("--shard-key", required=True, help="The property the kind is placed by.")
@click.option("--wait", type=float, default=None, help="Seconds to let caches expire.")
@click.argument("key")
@click.argument("bucket", type=int)
@click.pass_context
def key_migrate(
    ctx: click.Context, kind: str, shard_key: str, wait: float | None, key: str, bucket: int
) -> None:
    """Move every entity of shard key KEY to BUCKET (KEY parsed as JSON when it
    parses, e.g. 42 or {"$hex": "..."}; else a string)."""
    placed = _store_of_kind(ctx, kind=kind, shard_key=shard_key, shard_map="directory")
    moved = placed.migrate_key(parse_value(key), bucket, wait=wait)
    _out().print(f"moved {moved} entities of {key!r} to bucket {bucket}")


def _store_of_kind(ctx: click.Context, **options: Any) -> bagstore.Datastore:
    """The command's store, opened for another kind (closed when it ends)."""
    target = ctx.find_object(Target)
    assert target is not None
    if target.config is not None:
        ds = load_config(target.config, **options)
    else:
        assert target.store is not None
        if not target.sqlite_exists():
            raise CliError(f"no bagstore store in {str(target.store)!r}")
        ds = bagstore.open(target.store, **options)
    return ctx.with_resource(ds)


# -- seq -----------------------------------------------------------------------------
@cli.group("seq")
def seq_group() -> None:
    """Integer id sequences shared by every process of the store."""


@seq_group.command("next")
@click.argument("name")
@click.option("-n", "count", default=1, show_default=True, help="How many ids.")
@click.pass_context
def seq_next(ctx: click.Context, name: str, count: int) -> None:
    """Print the next COUNT ids of sequence NAME, one per line."""
    if count < 1:
        raise CliError("-n must be at least 1")
    sequence = _store(ctx).sequence(name)
    for value in sequence.next_many(count):
        click.echo(value)


@seq_group.command("show")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def seq_show(ctx: click.Context, as_json: bool) -> None:
    """Every sequence with the highest id reserved so far."""
    from bagstore.ids.sequence import list_sequences

    rows = list_sequences(_store(ctx))
    if as_json:
        _print_json({name: value for name, value in rows})
        return
    table = Table(title="Sequences", title_justify="left")
    table.add_column("name")
    table.add_column("reserved up to", justify="right")
    for name, value in rows:
        table.add_row(name, str(value))
    _out().print(table)


# -- bench ---------------------------------------------------------------------------
@cli.command(
    short_help="Run the benchmarks (bagstore beside raw SQL).",
    context_settings={"ignore_unknown_options": True},
)
@click.argument(
    "suite",
    type=click.Choice(["core", "indexes", "sequences", "cache", "cleaner", "scaleout", "codec"]),
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def bench(suite: str, args: tuple[str, ...]) -> None:
    """Run a benchmark suite from a source checkout (its bench/ directory),
    e.g. `bagstore bench core --backend sqlite`.  Extra arguments go to the
    suite; `bagstore bench core --help` lists them."""
    root = _checkout()
    code = subprocess.call([sys.executable, "-m", f"bench.{suite}", *args], cwd=root)
    raise SystemExit(code)


def _checkout() -> Path:
    for place in (Path.cwd(), *Path.cwd().parents, Path(__file__).resolve().parents[2]):
        if (place / "bench" / "__init__.py").is_file() and (place / "pyproject.toml").is_file():
            return place
    raise CliError(
        "the benchmarks live in the bench/ directory of a bagstore source checkout: "
        "run this command from inside one"
    )
