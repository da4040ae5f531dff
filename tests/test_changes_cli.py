"""`bagstore feed`, `bagstore changes`, `bagstore consumers`: output and bad input."""

from __future__ import annotations

import json
import time
from pathlib import Path

from click.testing import CliRunner

import bagstore
from bagstore.cli import cli


def run(store: Path, *args: str, code: int = 0) -> tuple[str, str]:
    result = CliRunner().invoke(cli, ["--store", str(store), *args])
    assert result.exit_code == code, (args, result.output)
    return result.stdout, result.stderr


def test_changes_and_consumers_at_the_command_line(tmp_path: Path) -> None:
    store = tmp_path / "s"
    run(store, "init", "--shards", "2", "--buckets", "8")
    _, err = run(store, "changes", code=2)
    assert err.startswith("error: the change feed of kind 'entities' is off")
    assert run(store, "feed", "on")[0] == "change feed of kind 'entities': on\n"
    ids = json.loads(run(store, "put", "--json", '[{"n": 1}, {"n": 2}]')[0])["ids"]
    time.sleep(0.3)  # (the consumer's lag is the age of the oldest, not the newest)
    out, err = run(store, "changes", "--json")
    lines = [json.loads(line) for line in out.splitlines()]
    assert sorted(c["id"] for c in lines) == sorted(ids)
    assert all(c["op"] == "put" and c["entity"] is None for c in lines)
    cursor = err.strip().split("cursor: ")[-1]
    with bagstore.open(store) as ds:
        ds.delete(bytes.fromhex(ids[0]))
        ds.subscribe("mailer", lambda cs: None).close()
    put_version = next(c["version"] for c in lines if c["id"] == ids[0])
    out, _ = run(store, "changes", "--since", cursor)
    assert out.split() == ["delete", ids[0], f"v{put_version}", out.split()[3]]
    for bad in ("nonsense", cursor[:-2] + "00", ""):
        _, err = run(store, "changes", "--since", bad, code=2)
        assert err.startswith("error: ") and len(err.strip().splitlines()) == 1
    _, err = run(store, "changes", "--kind", "nope", code=2)
    assert "no kind 'nope'" in err
    out, _ = run(store, "consumers", "--json")
    (mailer,) = json.loads(out)
    assert {k: v for k, v in mailer.items() if k != "lag_seconds"} == {
        "name": "mailer", "kind": "entities", "lag_changes": 3, "lag_pruned": 0, "processes": 0
    }  # fmt: skip
    assert 0.3 <= mailer["lag_seconds"] < 60
    assert "consumer mailer: lag 3 changes" in run(store, "status")[0]
    run(store, "consumers", "reset", "mailer", "--to", "end")
    assert json.loads(run(store, "consumers", "--json")[0])[0]["lag_changes"] == 0
    _, err = run(store, "consumers", "drop", "ghost", code=2)
    assert err == "error: no consumer 'ghost' (consumers: ['mailer'])\n"
    assert run(store, "consumers", "prune")[0] == "0 changes deleted\n"
    run(store, "consumers", "drop", "mailer")
    assert run(store, "consumers")[0] == "No consumers.\n"
    run(store, "feed", "off")
    with bagstore.open(store) as ds:
        assert ds.feed.settings() is None


def test_changes_follow_prints_new_changes_as_they_commit(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    store = tmp_path / "s"
    run(store, "init", "--shards", "1")
    run(store, "feed", "on")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "bagstore", "--store", str(store), "changes", "--follow", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        with bagstore.open(store) as ds:
            first = ds.put({"n": 1})
            assert proc.stdout is not None
            assert json.loads(proc.stdout.readline())["id"] == first.hex()
            second = ds.put({"n": 2})  # written while it follows
            assert json.loads(proc.stdout.readline())["id"] == second.hex()
    finally:
        proc.kill()
        proc.communicate()


def test_a_consumer_behind_retention_is_told_at_the_command_line(tmp_path: Path) -> None:
    store = tmp_path / "s"
    run(store, "init", "--shards", "1", "--buckets", "2")
    run(store, "feed", "on", "--max-changes", "1")
    with bagstore.open(store) as ds:
        ds.put({"n": -1})
        late = ds.subscribe("late", lambda cs: None)
        assert late.poll() == 1  # (one batch handled: it is told what it missed)
        late.close()
        ds.put_many([{"n": i} for i in range(10)])
    deleted = int(run(store, "consumers", "prune")[0].split()[0])
    assert deleted == 11 - 2  # one change a bucket kept
    (late,) = json.loads(run(store, "consumers", "--json")[0])
    assert (late["lag_changes"], late["lag_pruned"]) == (10, deleted - 1)
    deleted -= 1  # (of the changes it had not handled)
    told = f"{deleted} of its changes were pruned before it handled them"
    assert told in run(store, "consumers")[0]
    status = run(store, "status")[0]
    assert "consumer late: lag 10 changes" in status and told in status
    assert "bagstore consumers reset late" in status
    run(store, "consumers", "reset", "late")
    (late,) = json.loads(run(store, "consumers", "--json")[0])
    assert (late["lag_changes"], late["lag_pruned"]) == (2, 0)
