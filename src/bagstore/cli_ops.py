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
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from rich.markup import escape
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
    resumable,
)
from bagstore.cli_errors import Numbers
from bagstore.cli_json import dumps_json
from bagstore.cli_progress import Bar, bar
from bagstore.config import load_config
from bagstore.scaleout import DEFAULT_BATCH, DEFAULT_DUTY

__all__ = ["bench", "clean", "key_group", "seq_group", "shard_group"]


def _pacing(duty: float, duty_help: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``--duty`` (with this default and help) and ``--max-rate``: the options that
    pace bulk work (``clean``, ``shard move``, ``shard rebalance``)."""

    def add(fn: Callable[..., Any]) -> Callable[..., Any]:
        fn = click.option(
            "--duty", type=Numbers(0, 10), default=duty, show_default=True, help=duty_help
        )(fn)
        return click.option(
            "--max-rate", type=float, default=None, help="At most this many rows per second."
        )(fn)

    return add


def _index_state(ds: bagstore.Datastore, name: str, states: tuple[str, ...], why: str) -> str:
    """The state of index ``name``, which must be one of ``states``: else a
    CliError (``index NAME is retired: WHY``), before any work or bar starts."""
    indexes = ds.indexes()
    if name not in indexes:
        known = ", ".join(sorted(indexes)) or "none"
        raise CliError(f"no index {name!r} on kind {ds.kind!r} (indexes: {known})")
    state = indexes[name][1]
    if state not in states:
        raise CliError(f"index {name!r} is {state}: {why}")
    return state


# -- clean ---------------------------------------------------------------------------
@cli.command(short_help="Backfill an index, or repair indexes (once or continuously).")
@click.option("--index", "table", metavar="NAME", help="Backfill this (building) index.")
@click.option("--repair", "repair", is_flag=True, help="One repair pass over every index.")
@click.option("--follow", is_flag=True, help="Repair continuously until Ctrl-C.")
@click.option(
    "--batch",
    type=int,
    default=None,
    help="Entities per statement [default: 1000; a backfill with --duty 0: 5000].",
)
@_pacing(
    0.5,
    "Pause this fraction of each batch's time after it; batches of one server "
    "take turns (0: every shard at once, flat out).",
)
@click.option(
    "--interval",
    type=Numbers(0.001, 86400),
    default=1.0,
    show_default=True,
    help="Seconds between --follow passes.",
)
@click.option(
    "--settle",
    type=Numbers(0, 86400),
    help="Seconds between an index's registration and its backfill's first read "
    "(default: the store's refresh_interval + 1, so that every writer maintains it "
    "by then; 0 when no other process writes).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the counts as JSON.")
@click.pass_context
def clean(
    ctx: click.Context,
    table: str | None,
    repair: bool,
    follow: bool,
    batch: int | None,
    max_rate: float | None,
    duty: float,
    interval: float,
    settle: float | None,
    as_json: bool,
) -> None:
    """Run the Cleaner.

    --index NAME backfills a building index from the existing entities, shows
    progress with rate and ETA, and marks it ready.  Ctrl-C stops after the
    current batch; run the same command again to resume from the checkpoint.
    --repair writes missing and deletes stale index rows once; --follow keeps
    doing it from the last time it saw (with --json: one JSON line per pass
    that changed something).  The time reported includes every wait.
    """
    if sum(map(bool, (table, repair, follow))) != 1:
        raise click.UsageError("give exactly one of --index NAME, --repair, --follow")
    ds = _store(ctx)
    if table is not None:
        resumable(ctx)  # Ctrl-C: the same command resumes from the backfill's checkpoint
        _index_state(ds, table, ("building", "ready"), "nothing to backfill")
    cleaner = bagstore.Cleaner(ds, batch=batch, max_rate=max_rate, duty=duty, settle=settle)
    stats: bagstore.CleanStats
    try:
        if table is not None:
            with bar(f"backfill {table}", "entities") as shown:
                shown.describe(f"backfill {table}: waiting for every writer to maintain it")

                def advance(done: int, total: int) -> None:
                    shown.describe(f"backfill {table}")
                    shown.update(done, total)

                stats = cleaner.backfill(table, progress=advance)
            ready = ds.indexes().get(table, (None, "?"))[1]
            _err().print(f"{table}: {ready}")
        elif repair:
            with bar("repair", "entities") as shown:
                stats = cleaner.repair(progress=shown.update)
        else:
            err = _err()
            err.print("repairing continuously; Ctrl-C stops")

            def report(s: bagstore.CleanStats) -> None:
                if (s.written or s.removed) and as_json:
                    click.echo(dumps_json(s.as_dict()))
                elif s.written or s.removed:
                    err.print(f"wrote {s.written}, removed {s.removed} ({s.entities} entities)")

            stats = cleaner.follow(interval=interval, on_pass=report)
    except KeyboardInterrupt:
        raise  # the group prints `error: interrupted` (and how to resume), exit 130
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
        advice = bagstore.Mover(ds).server_advice()
        _print_json({"shards": status["shards"], "unfinished_moves": moves, "advice": advice})
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
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def shard_add(ctx: click.Context, url: str, as_json: bool) -> None:
    """Register a new, empty shard (a database URL).  Then move buckets to it
    with `shard rebalance` or `shard move`."""
    number = _store(ctx).add_shard(url)
    if as_json:
        _print_json({"shard": number, "url": url})
    else:
        _out().print(f"added shard {number}: {url}")


def _advise(ds: bagstore.Datastore, *, to_stderr: bool = False) -> None:
    """Print what the shards' servers should change before buckets move."""
    out = _err() if to_stderr else _out()
    for line in bagstore.Mover(ds).server_advice():
        out.print(f"[yellow]{escape(line)}[/]")


def _move_report(stats: bagstore.MoveStats, as_json: bool) -> None:
    if as_json:
        _print_json(
            {
                "buckets": stats.buckets,
                "entities": stats.entities,
                "index_rows": stats.index_rows,
                "deleted": stats.deleted,
                "longest_freeze": round(stats.longest_freeze, 3),
                "seconds": round(stats.seconds, 3),
            }
        )
        return
    _out().print(
        f"moved {stats.buckets} buckets: {stats.entities} entities, {stats.index_rows} index "
        f"rows copied, {stats.deleted} source rows deleted in {stats.seconds:.1f}s "
        f"(longest freeze {stats.longest_freeze * 1000:.0f} ms)"
    )


def _mover(ds: bagstore.Datastore, shown: Bar, **options: Any) -> bagstore.Mover:
    """A Mover whose buckets, copied rows and waits advance the bar ``shown``."""

    def step(phase: str, rows: int) -> None:
        if phase == "copy":
            shown.describe("moving buckets")
            shown.add_rows(rows)
        elif phase == "grace":
            shown.describe(f"keeping the source copies {mover.grace:g}s for stale readers")
        elif phase == "delete":
            shown.describe("deleting the source copies")

    mover = bagstore.Mover(ds, progress=shown.update, on_step=step, **options)
    return mover


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


_GRACE = Numbers(0, 86400)
_GRACE_HELP = "Seconds to keep the source copies for stale readers (default: refresh_interval + 1)."


@shard_group.command("move")
@click.option("--to", "target", required=True, help="Target shard: its number or name.")
@click.option("--grace", type=_GRACE, default=None, help=_GRACE_HELP)
@_move_pacing
@click.option("--json", "as_json", is_flag=True, help="Print the counts as JSON.")
@click.argument("buckets", nargs=-1, type=int, required=True)
@click.pass_context
def shard_move(
    ctx: click.Context,
    target: str,
    grace: float | None,
    duty: float,
    max_rate: float | None,
    batch: int,
    as_json: bool,
    buckets: tuple[int, ...],
) -> None:
    """Move BUCKETS to a shard while serving (copy, freeze, sync, switch).
    A bar on stderr (on a terminal) counts the buckets and the rows copied."""
    resumable(ctx, "shard", "resume")
    to: int | str = int(target) if target.isdigit() else target
    ds = _store(ctx)
    _advise(ds, to_stderr=True)
    pacing = {"grace": grace, "duty": duty, "max_rate": max_rate, "batch": batch}
    with bar("moving buckets", "buckets", rows="rows copied") as shown:
        stats = _mover(ds, shown, **pacing).move(list(buckets), to)
    _move_report(stats, as_json)


@shard_group.command("rebalance")
@click.option("--grace", type=_GRACE, default=None, help=_GRACE_HELP)
@_move_pacing
@click.option("--json", "as_json", is_flag=True, help="Print the counts as JSON.")
@click.pass_context
def shard_rebalance(
    ctx: click.Context,
    grace: float | None,
    duty: float,
    max_rate: float | None,
    batch: int,
    as_json: bool,
) -> None:
    """Move buckets until every shard holds an even share.  A bar on stderr
    (on a terminal) counts the buckets and the rows copied."""
    resumable(ctx, "shard", "resume")
    ds = _store(ctx)
    _advise(ds, to_stderr=True)
    pacing = {"grace": grace, "duty": duty, "max_rate": max_rate, "batch": batch}
    with bar("moving buckets", "buckets", rows="rows copied") as shown:
        stats = _mover(ds, shown, **pacing).rebalance()
    _move_report(stats, as_json)


@shard_group.command("resume")
@click.option("--grace", type=_GRACE, default=None, help=_GRACE_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print the counts as JSON.")
@click.pass_context
def shard_resume(ctx: click.Context, grace: float | None, as_json: bool) -> None:
    """Finish the moves a killed process left unfinished (with a bar, as
    `shard move`)."""
    resumable(ctx, "shard", "resume")
    ds = _store(ctx)
    with bar("resuming moves", "buckets", rows="rows copied") as shown:
        stats = _mover(ds, shown, grace=grace).resume()
    _move_report(stats, as_json)


@shard_group.command("rollback")
@click.argument("bucket", type=int)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def shard_rollback(ctx: click.Context, bucket: int, as_json: bool) -> None:
    """Undo an unfinished move of BUCKET that has not switched yet."""
    bagstore.Mover(_store(ctx)).rollback(bucket)
    if as_json:
        _print_json({"bucket": bucket, "rolled_back": True})
    else:
        _out().print(f"bucket {bucket}: move rolled back")


# -- key -----------------------------------------------------------------------------
@cli.group("key")
def key_group() -> None:
    """Shard keys of kinds that use the directory shard map."""


@key_group.command("migrate")
@click.option("--kind", required=True, help="The kind (entities table).")
@click.option("--shard-key", required=True, help="The property the kind is placed by.")
@click.option(
    "--wait",
    type=Numbers(0, 86400),
    default=None,
    help="Seconds to let processes drop cached directory entries (default: the cache's lifetime).",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.argument("key")
@click.argument("bucket", type=int)
@click.pass_context
def key_migrate(
    ctx: click.Context,
    kind: str,
    shard_key: str,
    wait: float | None,
    as_json: bool,
    key: str,
    bucket: int,
) -> None:
    """Move every entity of shard key KEY to BUCKET, in KIND and in every other
    kind placed by the same shard key through the directory, as one migration
    (KEY parsed as JSON when it parses, e.g. 42 or {"$hex": "..."}; else a
    string).  KIND must exist.  A bar on stderr (on a terminal) shows the wait,
    then the old buckets being read."""
    resumable(ctx)  # re-running it finishes the job (the key stays migrating until then)
    kinds = _store(ctx).catalog.kinds()
    if kind not in kinds:  # opening it would register it: refuse before that
        raise CliError(f"no kind {kind!r} in this store (kinds: {', '.join(kinds) or 'none'})")
    placed = _store_of_kind(ctx, kind=kind, shard_key=shard_key, shard_map="directory")
    value = parse_value(key)
    started = time.monotonic()
    with bar(f"migrating {key}", "entities") as shown:

        def step(phase: str, rows: int) -> None:
            if phase == "wait":
                shown.describe(f"{key}: waiting for processes to drop cached directory entries")
            else:
                shown.describe(f"migrating {key}: reading bucket")

        mover = bagstore.Mover(placed, progress=shown.update, on_step=step)
        by_kind = mover.migrate_key_by_kind(value, bucket, wait=wait)
    moved = sum(by_kind.values())
    seconds = time.monotonic() - started
    if as_json:
        _print_json(
            {
                "kind": kind,
                "key": value,  # in the tagged forms of entity values
                "bucket": bucket,
                "moved": moved,
                "kinds": by_kind,
                "seconds": round(seconds, 3),
            }
        )
    else:
        each = ", ".join(f"{k} {n}" for k, n in by_kind.items())
        _out().print(
            f"moved {moved} entities of {key!r} to bucket {bucket} ({each}) in {seconds:.1f}s"
        )


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
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def seq_next(ctx: click.Context, name: str, count: int, as_json: bool) -> None:
    """Print the next COUNT ids of sequence NAME, one per line (a sequence
    is created by its first use)."""
    if count < 1:
        raise CliError("-n must be at least 1")
    sequence = _store(ctx).sequence(name)
    values = sequence.next_many(count)
    if as_json:
        _print_json({"name": name, "ids": list(values)})
        return
    for value in values:
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
    type=click.Choice(
        [
            "all",
            "core",
            "indexes",
            "update",
            "sequences",
            "cache",
            "cleaner",
            "scaleout",
            "codec",
            "tables",
            "replicas",
            "changes",
        ]
    ),
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def bench(suite: str, args: tuple[str, ...]) -> None:
    """Run a benchmark suite from a source checkout (its bench/ directory),
    e.g. `bagstore bench core --backend sqlite`, or every suite at a small
    size: `bagstore bench all --quick`.  Extra arguments go to the suite;
    `bagstore bench core --help` lists them."""
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
