"""The ``bagstore`` command: a thin layer over the library (click + rich).

Every command parses its arguments, calls the library and prints the answer::

    $ bagstore demo                                  # sample data, an index added live
    $ bagstore --store data/ init --shards 4
    $ echo '{"user_id": {"$hex": "f48b0440ca0c4f66991c4d5f6a078eaf"}}' | bagstore put
    $ bagstore query --index index_user_id user_id='{"$hex": "f48b0440ca0c4f66991c4d5f6a078eaf"}'

JSON in and out (see :mod:`bagstore.cli_json`): every line printed is strict JSON;
bytes are written ``{"$hex": "..."}``, datetimes ``{"$datetime": "ISO-8601"}``,
dates ``{"$date": "YYYY-MM-DD"}``, ints
of over 640 digits ``{"$int": "..."}``, nan and infinities ``{"$float": "nan"}``
(``"inf"``, ``"-inf"``), and a dict that would read as one of these ``{"$dict": {...}}``.
Input takes the same forms, plain ints of any length, and ``NaN``/``Infinity``.
Text on stdin must be UTF-8.

Errors: no traceback reaches the user.  Every failure is one red line
``error: ...`` on stderr (click's usage errors too, with a ``try 'bagstore X --help'``
hint on the same line), and the exit code says what happened:

    ====  ===========================================================================
    code  meaning
    ====  ===========================================================================
    0     done
    1     ``get``: an id was not found; ``check``: missing or stale index rows found;
          or an internal error (a bug: ``error: internal error: ...``; rerun with
          ``BAGSTORE_DEBUG=1`` for the traceback)
    2     bad input (arguments, options, JSON, config file) or an error of the store
          (any :class:`bagstore.BagstoreError`, or the file system)
    130   interrupted (Ctrl-C): ``error: interrupted``, and for work that can be
          resumed the command that resumes it (``bagstore shard resume`` after
          ``shard move/rebalance/resume``; the same command again after
          ``clean --index NAME``, which goes on from its checkpoint, and after
          ``key migrate``)
    ====  ===========================================================================
"""

from __future__ import annotations

import logging
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource
from rich.console import Console
from rich.markup import escape
from rich.table import Table

import bagstore
from bagstore import check as consistency
from bagstore.backends.sqlite import wal_reset_advice
from bagstore.cli_errors import (
    BagstoreGroup,
    CliError,
    Interrupted,
    resumable,
    shown,
    utf8_output,
)
from bagstore.cli_json import (
    dumps_entity,
    dumps_json,
    loads_json,
    parse_value,
)
from bagstore.cli_logging import setup_logging
from bagstore.cli_progress import bar
from bagstore.datastore import SQLITE_SHARD_FILE
from bagstore.status import gate_notes

__all__ = [
    "CliError",
    "Interrupted",
    "cli",
    "dumps_entity",
    "loads_json",
    "main",
    "parse_filter_args",
    "parse_value",
    "resumable",
]

DEFAULT_STORE = "bagstore-data"
DEFAULT_CONFIG = "bagstore.toml"
QUERY_KEYWORDS = frozenset({"order", "limit", "cursor"})
ALL_PAGE = 1000  # entities per page of `query --all` without --limit


# -- command-line input ------------------------------------------------------------
def parse_filter_args(args: Sequence[str]) -> dict[str, Any]:
    """``["user_id={"$hex": "..."}", "published__gte=..."]`` -> keyword filters.

    >>> parse_filter_args(["n__gte=5", "name=ann", "tag__in=[1, 2]"])
    {'n__gte': 5, 'name': 'ann', 'tag__in': [1, 2]}
    """
    filters: dict[str, Any] = {}
    for arg in args:
        name, sep, raw = arg.partition("=")
        if not sep or not name:
            raise click.UsageError(
                f"filter {shown(arg)} is not key=value (e.g. user_id=... n__gte=5)"
            )
        if name in filters:
            raise click.UsageError(f"filter {shown(name)} is given twice")
        value = parse_value(raw)
        if name.endswith("__in") and not isinstance(value, list):
            raise CliError(f'filter {name!r} takes a JSON list, e.g. {name}=\'["a", "b"]\'')
        filters[name] = value
    return filters


def _parse_id(text: str) -> bytes:
    try:
        return bytes.fromhex(text.strip())
    except ValueError:
        raise CliError(f"bad id {shown(text)}: an id is 32 hex digits") from None


def _read_json_input(data: str | None) -> str:
    """The text of ``put``: the argument, or stdin (``None`` or ``-``) as strict UTF-8
    (a byte-order mark is skipped)."""
    if data not in (None, "-"):
        assert data is not None
        try:
            data.encode("utf-8")
        except UnicodeEncodeError:  # undecodable argv bytes arrive as lone surrogates
            raise CliError("the DATA argument is not UTF-8 text") from None
        return data
    stream = sys.stdin
    if stream is None:
        raise CliError("nothing to put: stdin is closed (give the JSON as an argument)")
    buffer = getattr(stream, "buffer", None)
    if buffer is None:  # a text-only stream someone put in place of stdin
        return stream.read()
    raw: bytes = buffer.read()
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise CliError(
            f"stdin is not UTF-8: byte 0x{raw[exc.start]:02x} at offset {exc.start} "
            f"({exc.reason}); JSON text must be UTF-8"
        ) from None


# -- which store -------------------------------------------------------------------
@dataclass(frozen=True)
class Target:
    """The store a command works on: a config file, or a SQLite store directory."""

    config: Path | None = None
    store: Path | None = None

    def describe(self) -> str:
        return f"config {self.config}" if self.config else f"SQLite store {self.store}"

    def sqlite_exists(self) -> bool:
        return self.store is not None and (self.store / SQLITE_SHARD_FILE.format(0)).exists()

    def open(self, ctx: click.Context) -> bagstore.Datastore:
        """Open the existing store (closed when the command ends)."""
        if self.config is not None:
            ds = bagstore.Datastore.from_config(self.config)
        else:
            assert self.store is not None
            if not self.sqlite_exists():
                raise CliError(
                    f"no bagstore store in {str(self.store)!r}: run `bagstore init` first "
                    "(or give --store DIR or --config FILE)"
                )
            ds = bagstore.open(self.store)
        return ctx.with_resource(ds)


def _this_store(ctx: click.Context, command: str) -> str:
    """``command`` (``bagstore ...``) with the --config or --store given here."""
    root = ctx.find_root()
    words = shlex.split(command)
    for name in ("config", "store"):
        if root.get_parameter_source(name) is ParameterSource.COMMANDLINE:
            words[1:1] = [f"--{name}", str(root.params[name])]
    return shlex.join(words)


def _store(ctx: click.Context) -> bagstore.Datastore:
    target = ctx.find_object(Target)
    assert target is not None
    return target.open(ctx)


def _out() -> Console:
    return Console(highlight=False, soft_wrap=True)


def _err() -> Console:
    return Console(stderr=True, highlight=False, soft_wrap=True)


def _print_json(doc: Any) -> None:
    click.echo(dumps_json(doc, indent=2))  # strict JSON: nan, bytes... in tagged forms


def _index_doc(index: bagstore.Index, state: str) -> dict[str, Any]:
    return {**index.definition(), "state": state}


def _index_table(
    indexes: Mapping[str, tuple[bagstore.Index, str]], writes: Mapping[str, str] | None = None
) -> Table:
    """The indexes' table; ``writes``: how each is written (``status()``'s
    ``index_writes``), as one more column."""
    table = Table(title="Indexes", title_justify="left")
    for column in ("index", "properties", "shard_on", "unique", "state"):
        table.add_column(column)
    if writes is not None:
        table.add_column("written with the entity", overflow="fold")
    styles = {"ready": "green", "building": "yellow", "retired": "dim"}
    for name, (index, state) in sorted(indexes.items()):
        table.add_row(
            name,
            ", ".join(index.properties),
            index.shard_on,
            "yes" if index.unique else "",
            f"[{styles.get(state, '')}]{state}[/]",
            *([writes.get(name, "")] if writes is not None else []),
        )
    return table


# -- the command group ---------------------------------------------------------------
@click.group(cls=BagstoreGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--config",
    type=click.Path(dir_okay=False, path_type=Path),
    help=f"A TOML config file (see docs/configuration.md). Default: ./{DEFAULT_CONFIG} "
    "when it exists and no --store is given.",
)
@click.option(
    "--store",
    type=click.Path(file_okay=False, path_type=Path),
    envvar="BAGSTORE_STORE",
    show_envvar=True,
    help=f"A SQLite store directory (every shard a file). Default: ./{DEFAULT_STORE}.",
)
@click.option(
    "-v", "--verbose", count=True, help="Log progress and events to stderr (-vv: debug too)."
)
@click.option("-q", "--quiet", is_flag=True, help="Log errors only (no warnings).")
@click.version_option(bagstore.__version__, prog_name="bagstore")
@click.pass_context
def cli(
    ctx: click.Context, config: Path | None, store: Path | None, verbose: int, quiet: bool
) -> None:
    """bagstore: schema-less entities sharded over SQLite files or MariaDB/MySQL
    databases, with secondary indexes added online.

    JSON in and out: bytes are {"$hex": "..."}, datetimes {"$datetime": "ISO-8601"},
    dates {"$date": "YYYY-MM-DD"}, ints of over 640 digits {"$int": "..."}, NaN and
    infinities {"$float": "nan"} ("inf", "-inf").  Exit codes: 0 done, 1 not found
    or problems found, 2 bad input or a store error, 130 interrupted.  Start with `bagstore demo`.
    """
    setup_logging(ctx, verbose, quiet)
    if config is not None and store is not None:
        if ctx.get_parameter_source("store") is ParameterSource.ENVIRONMENT:
            store = None  # an explicit --config beats BAGSTORE_STORE
        else:
            raise click.UsageError("give --config or --store, not both")
    if config is None and store is None and Path(DEFAULT_CONFIG).is_file():
        config = Path(DEFAULT_CONFIG)
    if config is None and store is None:
        store = Path(DEFAULT_STORE)
    ctx.obj = Target(config=config, store=store)


@cli.command(short_help="Create the store (SQLite directory or configured shards).")
@click.option(
    "--shards",
    type=click.IntRange(min=1),
    help="SQLite files for a new store (default 4; 1 to 256); an existing store keeps its count.",
)
@click.option(
    "--buckets",
    type=click.IntRange(1, 65536),
    help="Logical shards, fixed at creation (default 1024).",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON (as `status --json`).")
@click.pass_context
def init(ctx: click.Context, shards: int | None, buckets: int | None, as_json: bool) -> None:
    """Create the store: a SQLite directory, or the shards a config file lists.

    Idempotent: on an existing store it checks the shards and changes nothing.
    """
    target: Target = ctx.obj
    if target.config is not None:
        if shards is not None:
            raise click.UsageError("with --config the shards are the URLs in the config file")
        if buckets is not None:
            raise click.UsageError("with --config set `buckets = N` in the config file")
        ds = ctx.with_resource(bagstore.Datastore.from_config(target.config))
        made = f"Store of {target.config} ready (databases and tables created where missing)"
        created: bool | None = None  # (what a config's servers held before is not known)
    else:
        assert target.store is not None
        existed = target.sqlite_exists()
        ds = ctx.with_resource(bagstore.open(target.store, shards=shards, buckets=buckets))
        made = (
            f"A store already exists in {target.store}: nothing changed"
            if existed
            else f"Created a SQLite store in {target.store}"
        )
        created = not existed
    status = ds.status()
    if as_json:
        docs = [_index_doc(i, state) for _, (i, state) in sorted(ds.indexes().items())]
        _print_json({"created": created, **status, "indexes": docs})
        return
    out = _out()
    out.print(
        f"{escape(made)}\n{len(status['shards'])} shards, {status['buckets']} buckets, "
        f"kind {status['kind']!r}, {status['entities']} entities"
    )
    for shard in status["shards"]:
        out.print(f"  shard {shard['shard']}: {escape(shard['name'])} ({shard['buckets']} buckets)")
    indexes = ds.indexes()
    if indexes:
        out.print(_index_table(indexes))


@cli.command(short_help="Shards, buckets, entity counts and index states.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
@click.pass_context
def status(ctx: click.Context, as_json: bool) -> None:
    """Shards (name, buckets, entity count), bucket count and index states."""
    from bagstore.cli_replication import replication_table, status_part

    ds = _store(ctx)
    report = ds.status()
    indexes = ds.indexes()
    replicated = status_part(ds)  # each server's role, lag, semi-sync (docs/replication.md)
    if replicated:
        report["replication"] = replicated
    lags = ds.feed.consumers()  # the change feed's consumers (bagstore.subscriber)
    if as_json:
        report["indexes"] = [_index_doc(i, s) for _, (i, s) in sorted(indexes.items())]
        report["consumers"] = lags
        _print_json(report)
        return
    out = _out()
    out.print(
        f"[bold]{escape(ctx.obj.describe())}[/]  kind {report['kind']!r}, "
        f"{report['buckets']} buckets, {report['entities']} entities"
    )
    shards = Table(title="Shards", title_justify="left")
    shards.add_column("#", justify="right")
    shards.add_column("name", overflow="fold")
    shards.add_column("buckets", justify="right")
    shards.add_column("entities", justify="right")
    for s in report["shards"]:
        shards.add_row(str(s["shard"]), s["name"], str(s["buckets"]), str(s["entities"]))
    out.print(shards)
    for line in gate_notes(report["shards"]):
        out.print(line)
    if replicated:
        out.print(replication_table(replicated))
    if indexes:
        out.print(_index_table(indexes, report["index_writes"]))
    else:
        out.print("No indexes (add one with `bagstore index add`).")
    cli_changes.print_lags(out, lags, status=True)
    advice = wal_reset_advice() if report.get("sqlite") else None
    if advice is not None:  # one line on stderr, only for a store of SQLite files
        logging.getLogger("bagstore.cli").warning(advice)


@cli.command(short_help="Store entities given as JSON.")
@click.argument("data", required=False)
@click.option("--json", "as_json", is_flag=True, help='Print {"ids": [...]} instead.')
@click.pass_context
def put(ctx: click.Context, data: str | None, as_json: bool) -> None:
    """Store entities given as JSON: an object, or a list of objects (put_many).

    DATA is the JSON text; without it (or with -) it is read from stdin.  The
    whole entity is stored, replacing any previous body.  An entity without an
    "id" gets a new one; give one as {"$hex": "<32 hex digits>"}.  Prints each
    id in hex, one a line.

    \b
    Example:
      bagstore put '{"title": "hi", "user_id": {"$hex": "f48b0440ca0c4f66991c4d5f6a078eaf"},
                     "published": {"$datetime": "2009-08-03T12:00:00+00:00"}}'
    """
    text = _read_json_input(data)
    if not text.strip():
        raise CliError("nothing to put: give a JSON object as the argument or on stdin")
    doc = loads_json(text)
    if not isinstance(doc, (dict, list)):
        raise CliError(f"put takes a JSON object or a list of objects, not {type(doc).__name__}")
    ds = _store(ctx)
    try:
        ids = [ds.put(doc)] if isinstance(doc, dict) else ds.put_many(doc)
    except bagstore.InvalidEntity as exc:
        entities = [doc] if isinstance(doc, dict) else doc
        if any(isinstance(e, dict) and isinstance(e.get("id"), str) for e in entities):
            raise CliError(f'{exc} (in JSON an id is {{"$hex": "<32 hex digits>"}})') from exc
        raise
    if as_json:
        _print_json({"ids": [entity_id.hex() for entity_id in ids]})
        return
    for entity_id in ids:
        click.echo(entity_id.hex())


@cli.command(short_help="Print entities by id (hex).")
@click.argument("ids", nargs=-1, required=True)
@click.option(
    "--json", "as_json", is_flag=True, help='End with a line {"missing": [ids]} (see docs/cli.md).'
)
@click.pass_context
def get(ctx: click.Context, ids: tuple[str, ...], as_json: bool) -> None:
    """Print the entities with these ids (hex), one JSON line each.

    A missing id is reported on stderr (with --json: in a last line
    {"missing": [ids]}) and the exit code is 1.
    """
    wanted = [_parse_id(i) for i in ids]
    ds = _store(ctx)
    missing = []
    for entity_id, entity in zip(wanted, ds.get_many(wanted), strict=True):
        if entity is None:
            missing.append(entity_id.hex())
            if not as_json:
                click.echo(f"not found: {entity_id.hex()}", err=True)
        else:
            click.echo(dumps_entity(entity))
    if as_json:
        click.echo(dumps_json({"missing": missing}))
    if missing:
        ctx.exit(1)


@cli.command(short_help="Find entities by key=value filters.")
@click.argument("filters", nargs=-1)
@click.option(
    "--index", "index_name", help="Query through this index (default: the best ready one)."
)
@click.option("--limit", type=int, help="At most this many entities (a page).")
@click.option("--order", help="Order by this property; -prop for descending.")
@click.option("--cursor", help="Continue after the page that printed this cursor.")
@click.option("--partial", is_flag=True, help="Read a building index (needs --index).")
@click.option(
    "--all", "all_pages", is_flag=True, help="Page through to the end (--limit: the page size)."
)
@click.option(
    "--json", "as_json", is_flag=True, help='End with a line {"cursor": ...} (see docs/cli.md).'
)
@click.pass_context
def query(
    ctx: click.Context,
    filters: tuple[str, ...],
    index_name: str | None,
    limit: int | None,
    order: str | None,
    cursor: str | None,
    partial: bool,
    all_pages: bool,
    as_json: bool,
) -> None:
    """Find entities: FILTERS are key=value, with lookups key__gt, __gte, __lt,
    __lte and __in.

    Values are JSON when they parse (5, true, "quoted", {"$hex": "..."},
    {"$datetime": "..."}), else plain strings; __in takes a JSON list.  Prints
    one JSON line per entity, and the next page's cursor on stderr (with
    --json: a last line {"cursor": "..."} on stdout, or {"cursor": null} at
    the end).  --all reads page after page to the end.

    \b
    Examples:
      bagstore query user_id='{"$hex": "f48b0440ca0c4f66991c4d5f6a078eaf"}' --limit 20
      bagstore query --index index_link link=http://example.com/1
      bagstore query n__gte=5 n__lt=10 --order=-n
    """
    parsed = parse_filter_args(filters)
    if partial and index_name is None:
        raise click.UsageError("--partial reads one building index: give it with --index")
    ds = _store(ctx)
    page = limit if limit is not None or not all_pages else ALL_PAGE
    if index_name is not None:
        entry = ds.indexes().get(index_name)
        if entry is None:
            known = ", ".join(sorted(ds.indexes())) or "none"
            raise CliError(f"no index {index_name!r} on kind {ds.kind!r} (indexes: {known})")

        def run(cursor: str | None) -> Any:
            return ds.query_index(
                entry[0], parsed, order=order, limit=page, cursor=cursor, allow_partial=partial
            )

    else:
        clash = sorted(QUERY_KEYWORDS & parsed.keys())
        if clash:
            raise CliError(f"a filter on property {clash[0]!r} needs --index")

        def run(cursor: str | None) -> Any:
            return ds.query(order=order, limit=page, cursor=cursor, **parsed)

    try:
        result = run(cursor)
    except bagstore.NoIndexForQuery as exc:
        if not exc.command:
            raise
        raise CliError(
            "no ready index answers this query; add one with: " + _this_store(ctx, exc.command)
        ) from exc
    while True:
        for entity in result:
            click.echo(dumps_entity(entity))
        if not all_pages or result.cursor is None:
            break
        result = run(result.cursor)
    if as_json:
        click.echo(dumps_json({"cursor": result.cursor}))
    elif result.cursor is not None:
        click.echo(f"next cursor: {result.cursor}", err=True)


# -- consistency -------------------------------------------------------------------
@cli.command(short_help="Report missing and stale index rows.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.pass_context
def check(ctx: click.Context, as_json: bool) -> None:
    """Report index rows missing and stale (changes nothing).

    Reads every entity and every index row (a bar on stderr, on a terminal,
    counts the entities read).  Exit code 1 when anything is missing or stale,
    or when a name clash is found (an index named like a kind's table, made by
    an older bagstore: `bagstore index rename` fixes it).
    """
    ds = _store(ctx)
    with bar("check", "entities") as checking:
        report = consistency.check(ds, progress=checking.update)
    if as_json:
        _print_json(report)
    else:
        out = _out()
        per_index: Mapping[str, Mapping[str, Any]] = report.get("indexes", {})
        if per_index:
            table = Table(title="Index consistency", title_justify="left")
            for column in ("index", "state", "missing", "stale"):
                table.add_column(
                    column, justify="right" if column in ("missing", "stale") else "left"
                )
            for name, detail in sorted(per_index.items()):
                table.add_row(
                    name,
                    str(detail.get("state", "")),
                    str(detail.get("missing", 0)),
                    str(detail.get("stale", 0)),
                )
            out.print(table)
            for name, detail in sorted(per_index.items()):
                for ex in detail.get("examples", []):
                    out.print(
                        f"  {name}: {ex.get('problem')} row of entity {ex.get('entity_id')} "
                        f"on shard {ex.get('shard')}"
                    )
        else:
            out.print("No building or ready indexes to check.")
        for clash in report.get("clashes", []):  # names that meet (bagstore.names)
            out.print(
                f"[red]name clash[/]: {clash['sort']} {clash['name']} (kind {clash['kind']}) "
                f"meets {clash['with']}; fix: {clash['remedy']}",
                markup=True,
                highlight=False,
            )
        bad = int(report["missing"]) or int(report["stale"]) or report.get("clashes")
        verdict = "[red]inconsistent[/]" if bad else "[green]consistent[/]"
        out.print(f"{verdict}: {report['missing']} missing, {report['stale']} stale index rows")
    if int(report["missing"]) or int(report["stale"]) or report.get("clashes"):
        ctx.exit(1)


# The operational commands (clean, shard, key, seq, bench) and the demo register on `cli`.
from bagstore import cli_changes, cli_demo, cli_index, cli_ops, cli_replication  # noqa: E402, F401


def main(argv: Sequence[str] | None = None) -> None:
    """The console script ``bagstore`` (and ``python -m bagstore``)."""
    utf8_output()
    cli.main(args=list(argv) if argv is not None else None, prog_name="bagstore")


if __name__ == "__main__":
    main()
