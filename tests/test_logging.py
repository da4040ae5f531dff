"""Logging: the library logs under ``bagstore.*`` and prints nothing; the CLI's -v/-q."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

import bagstore
from bagstore.cli import cli
from bagstore.logs import ProgressLog


@pytest.fixture
def store(tmp_path: Path) -> Iterator[bagstore.Datastore]:
    ds = bagstore.open(tmp_path / "store", shards=2, buckets=8)
    ds.put_many([{"n": i, "tag": f"t{i % 3}"} for i in range(100)])
    yield ds
    ds.close()


def _lines(caplog: pytest.LogCaptureFixture, logger: str) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == logger and r.levelno == logging.INFO
    ]


def test_a_backfill_logs_its_start_checkpoints_and_end(
    store: bagstore.Datastore, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="bagstore")
    store.add_index(bagstore.Index("index_tag", ["tag"]))
    bagstore.Cleaner(store, settle=0, batch=5).backfill("index_tag")
    lines = [m for m in _lines(caplog, "bagstore.cleaner") if "index_tag" in m]
    assert lines[0].startswith("backfill of index index_tag (kind entities): starting")
    assert "about 100 entities to read on 2 shards" in lines[0]
    assert lines[-1].startswith("backfill of index index_tag (kind entities): done")
    assert "100 entities read, 100 rows written" in lines[-1] and "the index is ready" in lines[-1]
    # checkpoints: at most one a tenth of the way (20 batches were read), never the 100%
    middle = lines[1:-1]
    assert 1 <= len(middle) <= 9 and all("/100 entities (" in m for m in middle)
    assert "(kind entities): index_tag" not in " ".join(lines)


def test_progress_lines_come_at_tenths_not_per_batch(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="bagstore")
    progress = ProgressLog(logging.getLogger("bagstore.test"), "work", 1000, every=3600)
    for _ in range(1000):
        progress.advance(1)
    shares = [r.getMessage().split("(")[1].split(")")[0] for r in caplog.records]
    assert shares == [f"{p}%" for p in range(10, 100, 10)]


def test_each_bucket_moved_is_logged(
    store: bagstore.Datastore, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="bagstore")
    on_first = [b for b, s in enumerate(store.placement.shard_of_bucket) if s == 0][:2]
    stats = bagstore.Mover(store, grace=0).move(on_first, to=1)
    lines = _lines(caplog, "bagstore.scaleout")
    moved = [m for m in lines if m.startswith("bucket ")]
    assert [m.split()[1] for m in moved] == [str(b) for b in on_first]
    assert all("from shard sqlite:///" in m and "shard_1.db:" in m for m in moved)
    assert sum(int(m.split(": ")[1].split()[0]) for m in moved) == stats.entities > 0
    assert lines[-1].startswith(
        f"moved 2 buckets to shard sqlite:///{store.router.opener.root}/shard_1.db"
    )


def test_a_fenced_write_retried_is_logged(
    store: bagstore.Datastore, caplog: pytest.LogCaptureFixture
) -> None:
    stale = bagstore.open(
        store.router.opener.root or "", refresh_interval=3600
    )  # will not look again
    try:
        on_first = [b for b, s in enumerate(store.placement.shard_of_bucket) if s == 0]
        bagstore.Mover(store, grace=0).move(on_first, to=1)
        caplog.set_level(logging.INFO, logger="bagstore")
        ids = stale.put_many([{"n": i} for i in range(50)])  # some to the moved buckets
        assert all(e is not None for e in store.get_many(ids))
    finally:
        stale.close()
    refused = [m for m in _lines(caplog, "bagstore.datastore") if "refused a write" in m]
    assert refused and "placement was out of date; refreshing it and writing again" in refused[0]


def test_a_shard_unavailable_is_logged_without_its_password(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="bagstore")
    with pytest.raises(bagstore.ShardUnavailable):
        bagstore.Datastore(["mysql://app:sekrit@127.0.0.1:1/nowhere?connect_timeout=2"])
    lines = _lines(caplog, "bagstore.backends.base")
    assert any(m.startswith("shard mysql://app@127.0.0.1:1/nowhere unavailable") for m in lines)
    assert "sekrit" not in caplog.text


def test_the_library_prints_nothing_without_logging_configured(tmp_path: Path) -> None:
    """A script that configures no logging: put/get/query/backfill/move and a
    warning from a bagstore logger print nothing (the package's NullHandler
    keeps logging's last-resort handler away)."""
    script = textwrap.dedent(
        f"""
        import logging, bagstore
        ds = bagstore.open({str(tmp_path / "s")!r}, shards=2, buckets=8)
        ids = ds.put_many([{{"tag": f"t{{i % 3}}"}} for i in range(40)])
        ds.get(ids[0]); ds.get_many(ids)
        ds.add_index(bagstore.Index("index_tag", ["tag"]))
        bagstore.Cleaner(ds, settle=0).backfill("index_tag")
        assert len(ds.query(tag="t1")) == 13
        bagstore.Mover(ds, grace=0).move([0, 1], to=1)
        try:
            ds.query(nope=1)
        except bagstore.NoIndexForQuery:
            pass
        logging.getLogger("bagstore.datastore").warning("a warning nobody asked to see")
        ds.close()
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert (done.stdout, done.stderr) == ("", "")


def test_the_library_writes_nothing_to_stdout_or_stderr_in_process(
    store: bagstore.Datastore, capsys: pytest.CaptureFixture[str]
) -> None:
    logging.getLogger("bagstore").setLevel(logging.DEBUG)  # everything logged, nothing printed
    try:
        ids = store.put_many([{"tag": "x"} for _ in range(5)])
        store.get_many(ids)
        store.add_index(bagstore.Index("index_tag", ["tag"]))
        bagstore.Cleaner(store, settle=0).backfill("index_tag")
        store.query(tag="x")
        bagstore.Mover(store, grace=0).move([0], to=1)
    finally:
        logging.getLogger("bagstore").setLevel(logging.NOTSET)
    assert capsys.readouterr() == ("", "")


# -- the command line -----------------------------------------------------------------
@pytest.fixture
def cli_store(tmp_path: Path) -> str:
    runner = CliRunner()
    path = str(tmp_path / "store")
    assert runner.invoke(cli, ["--store", path, "init", "--shards", "2"]).exit_code == 0
    put = runner.invoke(cli, ["--store", path, "put"], input='[{"tag": "a"}, {"tag": "b"}]')
    assert put.exit_code == 0, put.output
    added = runner.invoke(
        cli, ["--store", path, "index", "add", "index_tag", "--properties", "tag"]
    )
    assert added.exit_code == 0, added.output
    return path


def test_cli_v_shows_the_log_on_stderr(cli_store: str) -> None:
    result = CliRunner().invoke(
        cli, ["-v", "--store", cli_store, "clean", "--index", "index_tag", "--settle", "0"]
    )
    assert result.exit_code == 0, result.output
    log = [line for line in result.stderr.splitlines() if " INFO bagstore." in line]
    assert any("INFO bagstore.cleaner: backfill of index index_tag" in x for x in log)
    assert any(x.endswith("the index is ready") for x in log)
    assert "INFO" not in result.stdout  # stdout keeps the command's own output
    assert "DEBUG" not in result.stderr


def test_cli_vv_adds_debug_and_q_silences_warnings(cli_store: str) -> None:
    runner = CliRunner()
    result = runner.invoke(
        cli, ["-vv", "--store", cli_store, "clean", "--index", "index_tag", "--settle", "0"]
    )
    assert result.exit_code == 0, result.output
    assert " DEBUG bagstore.cleaner: checkpoint backfill:entities:index_tag:" in result.stderr
    quiet = runner.invoke(
        cli, ["-q", "--store", cli_store, "clean", "--index", "index_tag", "--settle", "0"]
    )
    assert quiet.exit_code == 0 and "INFO" not in quiet.stderr
    both = runner.invoke(cli, ["-q", "-v", "--store", cli_store, "status"])
    assert both.exit_code == 2 and both.stderr.startswith("error: give -v or -q, not both")


def test_cli_without_v_logs_nothing_below_warnings(cli_store: str) -> None:
    result = CliRunner().invoke(
        cli, ["--store", cli_store, "clean", "--index", "index_tag", "--settle", "0"]
    )
    assert result.exit_code == 0, result.output
    assert "INFO" not in result.stderr and "backfill of index" not in result.stderr
    assert logging.getLogger("bagstore").handlers == [
        h for h in logging.getLogger("bagstore").handlers if isinstance(h, logging.NullHandler)
    ]  # the command's handler is gone once it ended
