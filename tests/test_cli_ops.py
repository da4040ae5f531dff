"""The operational commands: clean, shard, key, seq, bench."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from rich.progress import Progress

import bagstore
from bagstore.cli import cli
from bagstore.cli_progress import RateColumn


def run(store: Path, *args: str) -> Result:
    return CliRunner().invoke(cli, ["--store", str(store), *args])


def ok(store: Path, *args: str) -> Result:
    result = run(store, *args)
    assert result.exit_code == 0, result.output
    return result


def test_clean_backfills_and_repairs(tmp_path: Path) -> None:
    store = tmp_path / "s"
    with bagstore.open(store) as ds:
        ds.put_many([{"link": f"l{i % 7}"} for i in range(70)])
        ds.add_index(bagstore.Index(table="index_link", properties=["link"]))
    result = run(store, "clean", "--index", "index_link", "--duty", "-1")
    assert result.exit_code == 2 and "--duty" in result.output
    result = ok(store, "clean", "--index", "index_link", "--duty", "0", "--json")
    assert json.loads(result.stdout)["written"] == 70
    with bagstore.open(store) as ds:
        assert ds.indexes()["index_link"][1] == "ready"
        for backend in ds.router.backends:
            backend.execute("DELETE FROM index_link")
    assert run(store, "check").exit_code == 1
    result = ok(store, "clean", "--repair", "--json")
    assert json.loads(result.stdout)["written"] == 70
    ok(store, "check")


def test_clean_needs_one_mode(tmp_path: Path) -> None:
    ok(tmp_path / "s", "init")
    result = run(tmp_path / "s", "clean")
    assert result.exit_code == 2 and "exactly one" in result.output
    result = run(tmp_path / "s", "clean", "--index", "index_nothing")
    assert result.exit_code == 2 and "no index" in result.output


def test_shard_add_rebalance_list(tmp_path: Path) -> None:
    store = tmp_path / "s"
    ok(store, "init", "--shards", "2", "--buckets", "16")
    with bagstore.open(store) as ds:
        ids = ds.put_many([{"n": i} for i in range(100)])
    ok(store, "shard", "add", f"sqlite:///{tmp_path}/s/more.db")
    result = ok(store, "shard", "rebalance", "--grace", "0")
    assert "moved 5 buckets" in result.stdout
    shards = json.loads(ok(store, "shard", "list", "--json").stdout)["shards"]
    assert [s["buckets"] for s in shards] == [6, 5, 5]
    with bagstore.open(store) as ds:
        assert len(ds.shards) == 3
        assert [e["n"] for e in ds.get_many(ids)] == list(range(100))  # type: ignore[index]
    result = run(store, "shard", "move", "--to", "0", "--duty", "-1", "15")
    assert result.exit_code == 2 and "--duty" in result.output
    result = run(store, "shard", "rebalance", "--max-rate", "0")
    assert result.exit_code == 2 and "max_rate must be a positive number" in result.output
    for command in (["move", "--to", "0", "15"], ["rebalance"]):
        result = run(store, "shard", *command, "--batch", "0")
        assert result.exit_code == 2 and "--batch" in result.output
    assert [
        s["buckets"] for s in json.loads(ok(store, "shard", "list", "--json").stdout)["shards"]
    ] == [6, 5, 5]  # refused options moved nothing
    result = ok(store, "shard", "move", "--to", "0", "--grace", "0", "--batch", "3", "15")
    assert "moved 1 buckets" in result.stdout
    assert run(store, "shard", "rollback", "3").exit_code == 2  # nothing unfinished


def test_key_migrate(tmp_path: Path) -> None:
    store = tmp_path / "s"
    with bagstore.open(
        store, kind="posts", shard_key="user", shard_map="directory", buckets=16
    ) as ds:
        ids = [ds.put({"user": "ann", "n": i}) for i in range(5)]
    result = ok(
        store, "key", "migrate", "--kind", "posts", "--shard-key", "user", "--wait", "0",
        '"ann"', "9",
    )  # fmt: skip
    assert "moved 5 entities" in result.stdout
    with bagstore.open(store, kind="posts", shard_key="user", shard_map="directory") as ds:
        assert {ds.bucket_of_id(i) for i in ids} == {9}


def test_seq_next_and_show(tmp_path: Path) -> None:
    store = tmp_path / "s"
    ok(store, "init")
    first = ok(store, "seq", "next", "photos", "-n", "3").stdout.split()
    assert [int(x) for x in first] == [1, 2, 3]
    again = int(ok(store, "seq", "next", "photos").stdout)
    assert again > 3  # a new process skips the rest of the block, never repeats
    shown = json.loads(ok(store, "seq", "show", "--json").stdout)
    assert shown["photos"] >= again
    assert run(store, "seq", "next", "photos", "-n", "0").exit_code == 2


def test_bench_outside_a_checkout_says_so(tmp_path: Path, monkeypatch: object) -> None:
    import bagstore.cli_ops as ops

    monkeypatch.chdir(tmp_path)  # type: ignore[attr-defined]
    monkeypatch.setattr(ops, "__file__", str(tmp_path / "x" / "y" / "z.py"))  # type: ignore[attr-defined]
    result = CliRunner().invoke(cli, ["bench", "core"])
    assert result.exit_code == 2 and "source checkout" in result.output


# -- progress, durations and unknown names (issue 20) -------------------------------------
def _no_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("TTY_COMPATIBLE", "FORCE_COLOR"):
        monkeypatch.delenv(key, raising=False)


def _store_with_index(store: Path, entities: int = 70) -> None:
    with bagstore.open(store, shards=2, buckets=16) as ds:
        ds.put_many([{"link": f"l{i % 7}", "n": i} for i in range(entities)])
        ds.add_index(bagstore.Index(table="index_link", properties=["link"]))


def test_clean_reports_a_duration_that_includes_the_settle_wait(tmp_path: Path) -> None:
    """The backfill waits --settle seconds after the index's registration before
    reading; the seconds reported count that wait (they used to start after it)."""
    store = tmp_path / "s"
    _store_with_index(store)
    # (the wait ends --settle seconds after the registration, which came a
    # moment before: the figure is a little under --settle plus the work)
    result = ok(store, "clean", "--index", "index_link", "--settle", "2", "--duty", "0", "--json")
    counts = json.loads(result.stdout)
    assert counts["written"] == 70 and counts["seconds"] >= 1.0
    with bagstore.open(store) as ds:  # the library's own figure, too
        ds.add_index(bagstore.Index(table="index_n", properties=["n"]))
        stats = bagstore.Cleaner(ds, settle=1.0, duty=0).backfill("index_n")
        assert stats.written == 70 and stats.seconds >= 0.9


def test_shard_resume_reports_a_duration_that_includes_the_grace_wait(tmp_path: Path) -> None:
    """`shard resume` reported 0.0 s (Mover.resume never set it): now every
    wait counts, the grace period included."""
    store = tmp_path / "s"
    ok(store, "init", "--shards", "2", "--buckets", "16")
    with bagstore.open(store) as ds:
        ids = ds.put_many([{"n": i} for i in range(40)])
        for bucket in (3, 4):
            source = ds.placement.shard_of_bucket[bucket]
            ds.catalog.set_move(bucket, source, 1 - source, "copy")  # killed at its start
    result = ok(store, "shard", "resume", "--grace", "1", "--json")
    moved = json.loads(result.stdout)
    assert moved["buckets"] == 2 and moved["seconds"] >= 1.0
    text = ok(store, "shard", "resume", "--grace", "1")  # nothing left: no wait
    assert text.stdout.startswith("moved 0 buckets")
    with bagstore.open(store) as ds:
        assert bagstore.Mover(ds).unfinished() == {}
        assert [e["n"] for e in ds.get_many(ids)] == list(range(40))  # type: ignore[index]


def test_no_progress_output_without_a_terminal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a terminal the long commands print no bar (rich used to print the
    final bar of `clean` anyway): stderr holds only the sentences for people."""
    _no_terminal(monkeypatch)
    store = tmp_path / "s"
    _store_with_index(store)
    result = ok(store, "clean", "--index", "index_link", "--settle", "0", "--json")
    assert result.stderr.splitlines() == ["index_link: ready"]
    assert ok(store, "clean", "--repair", "--json").stderr == ""
    assert ok(store, "check").stderr == ""
    ok(store, "shard", "add", f"sqlite:///{tmp_path}/s/more.db")
    assert ok(store, "shard", "rebalance", "--grace", "0", "--duty", "0").stderr == ""


def test_bars_on_a_terminal_count_entities_not_kilobytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a terminal `clean` draws its bar on stderr (stdout keeps the result
    alone), with the rate in entities/s: it used to say kB/s."""
    monkeypatch.setenv("TTY_COMPATIBLE", "1")  # rich 14 and later
    monkeypatch.setenv("FORCE_COLOR", "1")  # rich 13
    store = tmp_path / "s"
    _store_with_index(store)
    result = ok(store, "clean", "--index", "index_link", "--settle", "0", "--json")
    assert "backfill index_link" in result.stderr and "70/70" in result.stderr
    assert "kB/s" not in result.stderr
    assert json.loads(result.stdout)["written"] == 70
    with Progress(disable=True) as progress:
        task_id = progress.add_task("x", total=10)
        task = next(t for t in progress.tasks if t.id == task_id)
        task.finished_speed = 1234.4
        assert RateColumn("entities").render(task).plain == "1,234 entities/s"


UNKNOWN_NAMES = [
    ("clean", "--index", "nope"),
    ("clean", "--index", "index_gone"),  # retired: nothing to backfill
    ("query", "--index", "nope", "link=l1"),
    ("index", "retire", "nope"),
    ("index", "drop", "nope"),
    ("shard", "move", "--to", "nope", "1"),
    ("shard", "move", "--to", "7", "1"),
    ("shard", "rollback", "3"),
    ("key", "migrate", "--kind", "nope", "--shard-key", "user", "--wait", "0", "ann", "3"),
]


@pytest.mark.parametrize("args", UNKNOWN_NAMES, ids=" ".join)
def test_an_unknown_name_is_one_error_line_and_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: tuple[str, ...]
) -> None:
    """Exit 2 with one `error:` line and nothing before it, even on a terminal
    (`clean` drew an empty `0/?` bar first; `key migrate --kind nope` printed
    `moved 0 entities` and registered the kind)."""
    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    store = tmp_path / "s"
    _store_with_index(store)
    with bagstore.open(store) as ds:
        ds.add_index(bagstore.Index(table="index_gone", properties=["n"]))
        ds.retire_index("index_gone")
        before = (ds.catalog.kinds(), ds.indexes(), ds.status()["shards"])
    result = run(store, *args)
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    with bagstore.open(store) as ds:
        assert (ds.catalog.kinds(), ds.indexes(), ds.status()["shards"]) == before


def test_the_library_hooks_the_bars_use(tmp_path: Path) -> None:
    """Mover.progress counts over a whole rebalance (it restarted for each
    target shard) and resume; on_step sees every copied row and each wait;
    check() and repair() report entities read."""
    store = tmp_path / "s"
    _store_with_index(store, entities=300)
    with bagstore.open(store) as ds:
        bagstore.Cleaner(ds, settle=0).backfill("index_link")
        ds.add_shard(f"sqlite:///{tmp_path}/s/c.db")
        ds.add_shard(f"sqlite:///{tmp_path}/s/d.db")
        calls: list[tuple[int, int]] = []
        steps: dict[str, int] = {}

        def step(phase: str, rows: int) -> None:
            steps[phase] = steps.get(phase, 0) + rows

        mover = bagstore.Mover(ds, grace=0, duty=0, progress=lambda d, t: calls.append((d, t)))
        mover.on_step = step
        stats = mover.rebalance()
        assert stats.buckets == 8 and len({target for _, target in mover.plan()}) == 0
        assert calls == [(i, 8) for i in range(1, 9)]  # two target shards, one count
        assert steps["copy"] == stats.entities + stats.index_rows
        assert steps["delete"] == stats.deleted and "grace" in steps
        seen: list[tuple[int, int]] = []
        report = bagstore.check.check(ds, progress=lambda d, t: seen.append((d, t)))
        assert report["missing"] == 0 and seen[-1] == (300, 300)
        seen.clear()
        repaired = bagstore.Cleaner(ds).repair(progress=lambda d, t: seen.append((d, t)))
        assert repaired.entities == 300
        assert seen[-1] == (300, 300)
