"""``bagstore demo``: FriendFeed-style sample data in a fresh SQLite store, read
back by id and through an index, then a second index added live and queried.

It registers on the ``cli`` group of :mod:`bagstore.cli` (which imports this
module at its end)."""

from __future__ import annotations

import random
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import click
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

import bagstore
from bagstore.cli import CliError, _err, _out, cli

DEMO_WORDS = (
    "python", "mysql", "sharding", "index", "cache", "friendfeed",
    "yupoo", "photo", "link", "video", "music",
)  # fmt: skip


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
