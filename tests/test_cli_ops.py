"""The operational commands: clean, shard, key, seq, bench."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner, Result

import bagstore
from bagstore.cli import cli


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
        for backend in ds._backends:
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
