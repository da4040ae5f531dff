"""The benchmarks' smallest units at a tiny size, on SQLite: that every bench
module imports, that the raw baselines write exactly what bagstore writes
(else a ratio compares different work), and the common table.  CI runs
`python -m bench all --quick` for the whole thing; no timing is checked here."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest
from bench import common
from bench.all import SUITES

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("suite", SUITES)
def test_every_suite_imports_and_has_a_main(suite: str) -> None:
    module = importlib.import_module(f"bench.{suite}")
    assert callable(module.main)


def test_bench_all_lists_every_bench_module() -> None:
    helpers = {"__init__", "__main__", "all", "common", "live", "scatter"}
    modules = {p.stem for p in (ROOT / "bench").glob("*.py")} - helpers
    assert modules == set(SUITES)


def test_bagstore_bench_offers_every_suite() -> None:
    """The CLI's list (the package cannot import bench/) names the same suites."""
    import click

    from bagstore.cli import cli

    command = cli.commands["bench"]
    suite = next(p for p in command.params if p.name == "suite")
    assert isinstance(suite.type, click.Choice)
    assert set(suite.type.choices) == {*SUITES, "all"}


def test_the_table_has_one_row_per_metric(capsys: pytest.CaptureFixture[str]) -> None:
    rows = [
        common.Row("sqlite: put", 900.0, 1000.0, goal=">= 0.9x raw", met=True),
        common.Row("sqlite: p99 during/before", 1.5, None, unit="x"),
    ]
    before = len(common.RECORDED)
    common.print_rows("bench.test", rows, fmt="plain")
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[1].split() == ["metric", "bagstore", "raw", "ratio", "goal", "met?"]
    for text in ("sqlite: put", "900/s", "1,000/s", "0.90", ">= 0.9x raw"):
        assert text in lines[2]
    assert lines[2].rstrip().endswith("yes")
    assert "1.50x" in lines[3] and lines[3].rstrip().endswith("—")
    assert common.RECORDED[before:] == [("bench.test", r) for r in rows]
    assert rows[0].ratio == pytest.approx(0.9)


def test_core_works_compare_on_sqlite() -> None:
    from bench import core

    with common.open_env("sqlite", shards=2, raw_ddl=core._entities_ddl) as env:
        ids = core.prefill(env, 50)
        for work in core.works(env, ids):
            if "x500" in work.name:
                continue  # 500 entities a call: not tiny
            r = common.compare(work, env.label, rounds=1, seconds=0.005, min_ops=2, max_ops=8)
            assert r.bag_rate > 0 and r.raw_rate > 0


def _index_rows(conn: Any, table: str) -> set[tuple[bytes, bytes, int]]:
    rows = common.rows_of(conn, f"SELECT user_id, entity_id, bagstore_bucket FROM {table}")
    return {(bytes(k), bytes(e), int(b)) for k, e, b in rows}


def test_raw_one_transaction_puts_write_what_bagstore_writes() -> None:
    from bench import indexes

    with common.open_env(
        "sqlite",
        shards=1,
        indexes=[indexes.USER_INDEX],
        raw_ddl=indexes.raw_ddl,
    ) as env:
        raw = indexes.Raw(env)
        one = [common.friendfeed_entity() for _ in range(3)]
        many = [common.friendfeed_entity() for _ in range(20)]
        for e in one:
            env.ds.put(e)
            raw.put_user(e)
        env.ds.put_many(many)
        raw.put_many_user(many)
        shard = env.ds.router.backends[0]
        import sqlite3

        bag = sqlite3.connect(shard.path)
        try:
            assert _index_rows(bag, "index_user_id") == _index_rows(env.raw, "index_user_id")
        finally:
            bag.close()
        assert len(_index_rows(env.raw, "index_user_id")) == 23
        got = common.rows_of(env.raw, "SELECT COUNT(*) FROM entities")
        assert got[0][0] == 23


def test_backfill_by_hand_writes_the_rows_the_cleaner_writes() -> None:
    from bench import cleaner

    with cleaner.open_side("sqlite") as side:
        cleaner.load(side, 300)
        cleaner.bag_backfill(side)
        cleaner.fresh_table(side, "hand_rows")
        assert cleaner.by_hand(side, "hand_rows") == 300
        cleaner.fresh_table(side, "ceiling_rows")
        for sql, params in cleaner.ceiling_statements(side, "ceiling_rows"):
            side.write(side.shard, sql, params)
        bag = _index_rows(side.shard, cleaner.TABLE)
        assert len(bag) == 300
        assert _index_rows(side.shard, "hand_rows") == bag
        assert _index_rows(side.shard, "ceiling_rows") == bag


def test_python_dash_m_bench_without_a_suite_says_how(capsys: pytest.CaptureFixture[str]) -> None:
    import sys

    from bench.__main__ import main

    saved = sys.argv
    sys.argv = ["bench"]
    try:
        assert main() == 2
    finally:
        sys.argv = saved
    assert "usage: python -m bench {all," in capsys.readouterr().err


def test_tables_baselines_read_what_load_reads() -> None:
    """bench.tables: ds.get and the raw SELECT read the very row load reads."""
    from bench import tables

    with tables._tables("sqlite") as (photos, raw):
        row = photos.insert(tables.Photo(user_id=3, title="t", tags=["a"]))
        assert row.pk is not None
        loaded = photos.load(3, row.pk)
        assert loaded is not None
        entity_id = tables.id_of_pk(row.pk)
        body, version = raw(entity_id)
        assert body == photos.ds.get(entity_id) == {**loaded.as_dict(), "id": entity_id}
        assert version == loaded._version and version > 0
