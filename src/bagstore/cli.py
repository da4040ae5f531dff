"""The ``bagstore`` command: a thin layer over the library (click + rich).

Every command parses its arguments, calls the library and prints the answer::

    $ bagstore demo                                  # sample data, an index added live
    $ bagstore --store data/ init --shards 4
    $ echo '{"user_id": {"$hex": "f48b0440ca0c4f66991c4d5f6a078eaf"}}' | bagstore put
    $ bagstore query --index index_user_id user_id='{"$hex": "f48b0440ca0c4f66991c4d5f6a078eaf"}'

JSON in and out: bytes are written ``{"$hex": "..."}`` and datetimes
``{"$datetime": "ISO-8601"}``.  Any :class:`bagstore.BagstoreError` (and bad JSON)
is one red line ``error: ...`` on stderr with exit code 2.
"""

from __future__ import annotations

import errno
import json
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import IO, Any

import click
from click.core import ParameterSource
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

import bagstore
from bagstore.datastore import SQLITE_SHARD_FILE

__all__ = ["cli", "dumps_entity", "loads_json", "main", "parse_filter_args"]

DEFAULT_STORE = "bagstore-data"
DEFAULT_CONFIG = "bagstore.toml"
QUERY_KEYWORDS = frozenset({"order", "limit", "cursor"})
DEMO_WORDS = (
    "python", "mysql", "sharding", "index", "cache", "friendfeed",
    "yupoo", "photo", "link", "video", "music",
)  # fmt: skip


# -- errors ----------------------------------------------------------------------
class CliError(click.ClickException):
    """A failure the user can act on: one red ``error: ...`` line, exit code 2."""

    exit_code = 2

    def show(self, file: IO[Any] | None = None) -> None:
        console = Console(file=file, stderr=file is None, highlight=False, soft_wrap=True)
        console.print(f"[red]error: {escape(self.format_message())}[/red]")


class _Group(click.Group):
    """Turns library errors (and file-system errors such as an unwritable store
    directory) raised by any subcommand into :class:`CliError`."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except bagstore.BagstoreError as exc:
            raise CliError(str(exc)) from exc
        except OSError as exc:
            if exc.errno == errno.EPIPE:  # click handles a closed pipe itself
                raise
            raise CliError(str(exc)) from exc


# -- JSON with bytes and datetimes -----------------------------------------------
def _object_hook(obj: dict[str, Any]) -> Any:
    if len(obj) != 1:
        return obj
    if "$hex" in obj:
        text = obj["$hex"]
        try:
            return bytes.fromhex(text)
        except (TypeError, ValueError):
            raise CliError(f'bad {{"$hex": ...}} value {text!r}: expected hex digits') from None
    if "$datetime" in obj:
        text = obj["$datetime"]
        try:
            return datetime.fromisoformat(text)
        except (TypeError, ValueError):
            raise CliError(
                f'bad {{"$datetime": ...}} value {text!r}: expected ISO-8601, '
                'e.g. "2009-08-03T12:00:00+00:00"'
            ) from None
    return obj


def loads_json(text: str, what: str = "input") -> Any:
    """Parse JSON, turning ``{"$hex": ...}`` into bytes and ``{"$datetime": ...}``
    into datetimes; bad JSON raises :class:`CliError`.

    >>> loads_json('{"id": {"$hex": "00ff"}}')
    {'id': b'\\x00\\xff'}
    """
    try:
        return json.loads(text, object_hook=_object_hook)
    except json.JSONDecodeError as exc:
        raise CliError(f"bad JSON in {what}: {exc}") from None


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return {"$hex": value.hex()}
    if isinstance(value, datetime):
        return {"$datetime": value.isoformat()}
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    return value


def dumps_entity(entity: Mapping[str, Any]) -> str:
    """One entity as one line of JSON (bytes as ``{"$hex": ...}``, datetimes as
    ``{"$datetime": ...}``).

    >>> dumps_entity({"id": b"\\x01", "n": 1})
    '{"id": {"$hex": "01"}, "n": 1}'
    """
    data = _jsonable(dict(entity))
    text = json.dumps(data, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates: keep them as \\u escapes
        text = json.dumps(data)
    return text


def parse_value(text: str) -> Any:
    """A filter value: JSON when it parses (``5``, ``true``, ``"5"``, ``{"$hex": ..}``),
    else the text itself as a string."""
    try:
        return json.loads(text, object_hook=_object_hook)
    except json.JSONDecodeError:
        return text


def parse_filter_args(args: Sequence[str]) -> dict[str, Any]:
    """``["user_id={"$hex": "..."}", "published__gte=..."]`` -> keyword filters.

    >>> parse_filter_args(["n__gte=5", "name=ann", "tag__in=[1, 2]"])
    {'n__gte': 5, 'name': 'ann', 'tag__in': [1, 2]}
    """
    filters: dict[str, Any] = {}
    for arg in args:
        name, sep, raw = arg.partition("=")
        if not sep or not name:
            raise click.UsageError(f"filter {arg!r} is not key=value (e.g. user_id=... n__gte=5)")
        if name in filters:
            raise click.UsageError(f"filter {name!r} is given twice")
        value = parse_value(raw)
        if name.endswith("__in") and not isinstance(value, list):
            raise CliError(f'filter {name!r} takes a JSON list, e.g. {name}=\'["a", "b"]\'')
        filters[name] = value
    return filters


def _parse_id(text: str) -> bytes:
    try:
        return bytes.fromhex(text.strip())
    except ValueError:
        raise CliError(f"bad id {text!r}: an id is 32 hex digits") from None


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


def _store(ctx: click.Context) -> bagstore.Datastore:
    target = ctx.find_object(Target)
    assert target is not None
    return target.open(ctx)


def _out() -> Console:
    return Console(highlight=False, soft_wrap=True)


def _err() -> Console:
    return Console(stderr=True, highlight=False, soft_wrap=True)


def _print_json(doc: Any) -> None:
    click.echo(json.dumps(doc, indent=2, ensure_ascii=False))


def _index_doc(index: bagstore.Index, state: str) -> dict[str, Any]:
    return {**index.definition(), "state": state}


def _index_table(indexes: Mapping[str, tuple[bagstore.Index, str]]) -> Table:
    table = Table(title="Indexes", title_justify="left")
    for column in ("index", "properties", "shard_on", "unique", "state"):
        table.add_column(column)
    styles = {"ready": "green", "building": "yellow", "retired": "dim"}
    for name, (index, state) in sorted(indexes.items()):
        table.add_row(
            name,
            ", ".join(index.properties),
            index.shard_on,
            "yes" if index.unique else "",
            f"[{styles.get(state, '')}]{state}[/]",
        )
    return table


# -- the command group ---------------------------------------------------------------
@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
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
@click.version_option(bagstore.__version__, prog_name="bagstore")
@click.pass_context
def cli(ctx: click.Context, config: Path | None, store: Path | None) -> None:
    """bagstore: schema-less entities sharded over SQLite files or MariaDB/MySQL
    databases, with secondary indexes added online.

    JSON in and out: bytes are {"$hex": "..."}, datetimes {"$datetime": "ISO-8601"}.
    Start with `bagstore demo`.
    """
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
    help="SQLite files for a new store (default 4); an existing store keeps its count.",
)
@click.option(
    "--buckets",
    type=click.IntRange(1, 65536),
    help="Logical shards, fixed at creation (default 1024).",
)
@click.pass_context
def init(ctx: click.Context, shards: int | None, buckets: int | None) -> None:
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
    else:
        assert target.store is not None
        existed = target.sqlite_exists()
        ds = ctx.with_resource(bagstore.open(target.store, shards=shards, buckets=buckets))
        made = (
            f"A store already exists in {target.store}: nothing changed"
            if existed
            else f"Created a SQLite store in {target.store}"
        )
    status = ds.status()
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
    ds = _store(ctx)
    report = ds.status()
    indexes = ds.indexes()
    if as_json:
        report["indexes"] = [_index_doc(i, s) for _, (i, s) in sorted(indexes.items())]
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
    if indexes:
        out.print(_index_table(indexes))
    else:
        out.print("No indexes (add one with `bagstore index add`).")
    sqlite = report.get("sqlite")
    if sqlite and sqlite["wal_reset_bug"]:
        out.print(
            f"[yellow]SQLite {sqlite['version']} has the WAL-reset bug (fixed in 3.51.3): "
            "rare corruption with several writing connections; see "
            "docs/configuration.md.[/]"
        )


@cli.command(short_help="Store entities given as JSON.")
@click.argument("data", required=False)
@click.pass_context
def put(ctx: click.Context, data: str | None) -> None:
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
    text = click.get_text_stream("stdin").read() if data in (None, "-") else data
    assert text is not None
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
    for entity_id in ids:
        click.echo(entity_id.hex())


@cli.command(short_help="Print entities by id (hex).")
@click.argument("ids", nargs=-1, required=True)
@click.pass_context
def get(ctx: click.Context, ids: tuple[str, ...]) -> None:
    """Print the entities with these ids (hex), one JSON line each.

    A missing id is reported on stderr and the exit code is 1.
    """
    wanted = [_parse_id(i) for i in ids]
    ds = _store(ctx)
    missing = 0
    for entity_id, entity in zip(wanted, ds.get_many(wanted), strict=True):
        if entity is None:
            missing += 1
            click.echo(f"not found: {entity_id.hex()}", err=True)
        else:
            click.echo(dumps_entity(entity))
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
@click.pass_context
def query(
    ctx: click.Context,
    filters: tuple[str, ...],
    index_name: str | None,
    limit: int | None,
    order: str | None,
    cursor: str | None,
    partial: bool,
) -> None:
    """Find entities: FILTERS are key=value, with lookups key__gt, __gte, __lt,
    __lte and __in.

    Values are JSON when they parse (5, true, "quoted", {"$hex": "..."},
    {"$datetime": "..."}), else plain strings; __in takes a JSON list.  Prints
    one JSON line per entity, and the next page's cursor on stderr.

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
    if index_name is not None:
        entry = ds.indexes().get(index_name)
        if entry is None:
            known = ", ".join(sorted(ds.indexes())) or "none"
            raise CliError(f"no index {index_name!r} on kind {ds.kind!r} (indexes: {known})")
        result = ds.query_index(
            entry[0], parsed, order=order, limit=limit, cursor=cursor, allow_partial=partial
        )
    else:
        clash = sorted(QUERY_KEYWORDS & parsed.keys())
        if clash:
            raise CliError(f"a filter on property {clash[0]!r} needs --index")
        result = ds.query(order=order, limit=limit, cursor=cursor, **parsed)
    for entity in result:
        click.echo(dumps_entity(entity))
    if result.cursor is not None:
        click.echo(f"next cursor: {result.cursor}", err=True)


# -- indexes -----------------------------------------------------------------------
@cli.group("index", short_help="List, add, retire and drop indexes.")
def index_group() -> None:
    """List, add, retire and drop secondary indexes (each a table on every shard)."""


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
@click.pass_context
def index_add(
    ctx: click.Context, name: str, properties: str, shard_on: str | None, unique: bool
) -> None:
    """Register index NAME; its tables are created on every shard at once.

    On a kind with no entities it is ready at once; otherwise it is building
    (every write maintains it, old entities are not in it until backfilled).
    """
    props = [p.strip() for p in properties.split(",") if p.strip()]
    index = bagstore.Index(table=name, properties=props, shard_on=shard_on, unique=unique)
    state = _store(ctx).add_index(index)
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
@click.pass_context
def index_retire(ctx: click.Context, name: str) -> None:
    """Stop maintaining index NAME (queries on it fail; its tables stay)."""
    _store(ctx).retire_index(name)
    click.echo(f"index {name}: retired")


@index_group.command("drop")
@click.argument("name")
@click.pass_context
def index_drop(ctx: click.Context, name: str) -> None:
    """Drop the tables of retired index NAME on every shard and forget it."""
    _store(ctx).drop_index(name)
    click.echo(f"index {name}: dropped")


# -- consistency -------------------------------------------------------------------
@cli.command(short_help="Report missing and stale index rows.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.pass_context
def check(ctx: click.Context, as_json: bool) -> None:
    """Report index rows missing and stale (changes nothing).

    Reads every entity and every index row.  Exit code 1 when anything is
    missing or stale.
    """
    ds = _store(ctx)
    report = ds.check()
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
        bad = int(report["missing"]) or int(report["stale"])
        verdict = "[red]inconsistent[/]" if bad else "[green]consistent[/]"
        out.print(f"{verdict}: {report['missing']} missing, {report['stale']} stale index rows")
    if int(report["missing"]) or int(report["stale"]):
        ctx.exit(1)


# -- demo --------------------------------------------------------------------------
def _rate(count: int | None, seconds: float) -> str:
    return f"{count / seconds:,.0f}/s" if count and seconds > 0 else ""


def _make_entries(count: int, rng: random.Random) -> list[dict[str, Any]]:
    """FriendFeed-style entries from about 50 users, oldest first."""
    users = [rng.randbytes(16) for _ in range(50)]
    words = DEMO_WORDS
    start = datetime(2009, 8, 3, 12, 0, tzinfo=UTC)
    return [
        {
            "id": bagstore.new_id(),
            "user_id": rng.choice(users),
            "title": " ".join(rng.sample(words, 3)).capitalize(),
            "link": f"http://example.com/entry/{n}",
            "published": start + timedelta(seconds=37 * n + rng.randrange(30)),
            "tags": rng.sample(words, rng.randrange(1, 4)),
        }
        for n in range(count)
    ]


@cli.command(short_help="FriendFeed-style sample data, an index added live.")
@click.option(
    "--dir",
    "directory",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("bagstore-demo"),
    show_default=True,
    help="Where to create the demo's SQLite store.",
)
@click.option("--entries", type=click.IntRange(1, 1_000_000), default=3000, show_default=True)
@click.option("--reset", is_flag=True, help="Replace a store already in --dir.")
def demo(directory: Path, entries: int, reset: bool) -> None:
    """FriendFeed-style sample data in a fresh SQLite store, read back by id and
    through an index, then a second index added live and queried.

    Ignores --store and --config: the demo always makes its own store in --dir.
    """
    shard_files = sorted(directory.glob("shard_*.db*"))
    if shard_files and not reset:
        raise CliError(
            f"{str(directory)!r} already holds a bagstore store: pass --reset to replace it, "
            "or --dir for another directory"
        )
    for f in shard_files:
        f.unlink()
    out, err = _out(), _err()
    rng = random.Random(2009)
    user_id_index = bagstore.Index(
        table="index_user_id", properties=["user_id"], shard_on="user_id"
    )
    link_index = bagstore.Index(table="index_link", properties=["link"], shard_on="link")
    timings: list[tuple[str, int | None, float]] = []

    with bagstore.open(directory, indexes=[user_id_index], shards=4) as ds:
        status = ds.status()
        out.print(
            f"[bold]bagstore demo[/]: a SQLite store in {escape(str(directory))}: "
            f"{len(status['shards'])} shards, {status['buckets']} buckets, index_user_id ready"
        )

        # 1. Write entries in batches.
        batch = 250
        data = _make_entries(entries, rng)
        started = time.perf_counter()
        with Progress(
            TextColumn("writing entries"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=err,
        ) as progress:
            task = progress.add_task("put", total=entries)
            for i in range(0, entries, batch):
                part = data[i : i + batch]
                ds.put_many(part)
                progress.advance(task, len(part))
        timings.append(("put_many (batches of 250)", entries, time.perf_counter() - started))

        # 2. Read some back by id.
        sample = rng.sample(data, min(200, entries))
        started = time.perf_counter()
        for entity in sample[:50]:
            if ds.get(entity["id"]) != entity:
                raise CliError(f"entity {entity['id'].hex()} did not read back as written")
        timings.append(("get by id", len(sample[:50]), time.perf_counter() - started))
        started = time.perf_counter()
        if ds.get_many([e["id"] for e in sample]) != sample:
            raise CliError("get_many did not read back what was written")
        timings.append(("get_many by id", len(sample), time.perf_counter() - started))

        # 3. Every user's entries through index_user_id.
        users = sorted({e["user_id"] for e in data})
        started = time.perf_counter()
        found = sum(len(user_id_index.get_all(ds, user_id=u)) for u in users)
        timings.append(
            ("index_user_id.get_all per user", len(users), time.perf_counter() - started)
        )
        if found != entries:
            raise CliError(f"index_user_id found {found} entries, {entries} were written")
        first = users[0]
        page = user_id_index.get_all(ds, user_id=first, limit=5)
        pages = 1
        while page.cursor is not None:
            page = user_id_index.get_all(ds, user_id=first, limit=5, cursor=page.cursor)
            pages += 1
        out.print(
            f"Wrote {entries} entries from {len(users)} users; index_user_id finds all "
            f"{found}; user {first.hex()[:8]}... pages through in {pages} pages of 5."
        )

        # 4. Add index_link on the existing data: it is building.
        started = time.perf_counter()
        state = ds.add_index(link_index)
        timings.append(
            ("add index_link (tables on every shard)", None, time.perf_counter() - started)
        )
        out.print(f"Added index_link live on {entries} existing entries: it is [yellow]{state}[/].")
        old_link = data[0]["link"]
        try:
            ds.query(link=old_link)
        except bagstore.IndexNotReady as exc:
            out.print(f"  ds.query(link=...) says: {escape(str(exc))}")
        fresh = {
            "user_id": first,
            "title": "Written after the index",
            "link": "http://example.com/new",
        }
        ds.put(fresh)
        seen = link_index.get_all(ds, link=fresh["link"], allow_partial=True)
        old = link_index.get_all(ds, link=old_link, allow_partial=True)
        out.print(
            f"  a new entry is in it at once ({len(seen)} found with allow_partial=True); "
            f"an old one is not yet ({len(old)} found)."
        )

        # 5. Backfill it (no other process writes this store: no need to let
        # other writers learn of the index first).
        started = time.perf_counter()
        counts = bagstore.Cleaner(ds, settle=0).backfill("index_link")
        timings.append(("Cleaner backfill of index_link", entries, time.perf_counter() - started))
        state = ds.indexes()["index_link"][1]
        out.print(f"Backfilled index_link ({counts.written} rows written): it is now {state}.")
        result = link_index.get_all(ds, link=old_link, allow_partial=state != "ready")
        out.print(f"  the old entry's link now finds {len(result)} entity.")

        # 6. Consistency report.
        started = time.perf_counter()
        report = ds.check()
        timings.append(
            ("check (every entity and index row)", entries + 1, time.perf_counter() - started)
        )
        per_index = report["indexes"]
        out.print(
            "check(): "
            + ", ".join(
                f"{name} {d['missing']} missing / {d['stale']} stale"
                for name, d in sorted(per_index.items())
            )
        )
        final = ds.status()

    summary = Table(title="Summary", title_justify="left")
    summary.add_column("step")
    summary.add_column("items", justify="right")
    summary.add_column("seconds", justify="right")
    summary.add_column("rate", justify="right")
    for step, count, seconds in timings:
        items = "" if count is None else str(count)
        summary.add_row(step, items, f"{seconds:.3f}", _rate(count, seconds))
    out.print(summary)
    out.print(
        f"{final['entities']} entities over {len(final['shards'])} shards in "
        f"{escape(str(directory))}.  Look around: bagstore --store {escape(str(directory))} status"
    )


# The operational commands (clean, shard, key, seq, bench) register on `cli`.
from bagstore import cli_ops  # noqa: E402, F401


def main(argv: Sequence[str] | None = None) -> None:
    """The console script ``bagstore`` (and ``python -m bagstore``)."""
    cli.main(args=list(argv) if argv is not None else None, prog_name="bagstore")


if __name__ == "__main__":
    main()
