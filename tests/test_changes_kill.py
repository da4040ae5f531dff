"""The change feed under SIGKILL: writers and consumers killed at random points.

Rounds are bounded with a fixed seed (``BAGSTORE_FEED_ROUNDS``, default 3);
``-m soak`` runs 30.  Every acknowledged write appears in the feed, each
entity's changes carry increasing versions in feed order, the last change of
each entity matches what the store holds, and a consumer killed at any point
and restarted handles every change (at least once).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import bagstore
from tests.conftest import Topology

ROUNDS = int(os.environ.get("BAGSTORE_FEED_ROUNDS", "3"))

WRITER = textwrap.dedent(
    """
    import json, random, sys
    import bagstore
    spec = json.loads(sys.argv[1])
    rng = random.Random(spec["seed"])
    ds = bagstore.Datastore(spec["urls"], buckets=32)
    ids = [bytes.fromhex(h) for h in spec["ids"]]
    n = spec["start"]
    print("ready", flush=True)
    while True:
        n += 1
        if rng.random() < 0.1:
            entity_id = ds.put({"n": n, "doomed": True})
            print(json.dumps(["put", entity_id.hex(), n]), flush=True)
            ds.delete(entity_id)
            print(json.dumps(["delete", entity_id.hex(), n]), flush=True)
        else:
            batch = rng.sample(ids, rng.randint(1, 3))
            ds.put_many([{"id": i, "n": n} for i in batch])
            for i in batch:
                print(json.dumps(["put", i.hex(), n]), flush=True)
    """
)

CONSUMER = textwrap.dedent(
    """
    import json, sys
    import bagstore
    spec = json.loads(sys.argv[1])
    ds = bagstore.Datastore(spec["urls"], buckets=32)
    out = open(spec["log"], "a")
    if out.tell():  # a line a killed process left torn ends here (else: an empty line)
        out.write("\\n")

    def handle(changes):
        for c in changes:
            out.write(json.dumps([c.id.hex(), c.op, c.version, c.bucket, c.position]) + "\\n")
        out.flush()

    consumer = ds.subscribe("killed", handle, batch=7, lease=2.0)
    print("ready", flush=True)
    consumer.run(idle=0.01)
    """
)


def _spawn(code: str, spec: dict[str, object]) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", code, json.dumps(spec)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    assert line == "ready", proc.stderr.read() if proc.stderr else line
    return proc


def _kill(proc: subprocess.Popen[str]) -> list[str]:
    proc.send_signal(signal.SIGKILL)
    out, _ = proc.communicate()
    return out.splitlines()


def _run(topo: Topology, tmp_path: Path, rounds: int) -> None:
    rng = random.Random(26)
    ds = topo.open(buckets=32)
    ds.feed.enable(bodies=True)
    ids = ds.put_many([{"n": 0} for _ in range(12)])
    acked: list[tuple[str, str, int]] = [("put", i.hex(), 0) for i in ids]
    log = tmp_path / "handled.jsonl"
    consumer = _spawn(CONSUMER, {"urls": topo.urls, "log": str(log)})
    kills = 1  # (the last, below)
    try:
        for r in range(rounds):
            writer = _spawn(
                WRITER,
                {"urls": topo.urls, "ids": [i.hex() for i in ids], "seed": r, "start": r * 10**6},
            )
            time.sleep(rng.uniform(0.1, 0.5))
            if rng.random() < 0.5:  # the consumer dies too, at another point
                _kill(consumer)
                kills += 1
                consumer = _spawn(CONSUMER, {"urls": topo.urls, "log": str(log)})
            for line in _kill(writer):
                if line.startswith("["):
                    op, h, n = json.loads(line)
                    acked.append((op, h, n))
    finally:
        _kill(consumer)
    # the feed: every acknowledged write, versions rising per entity
    feed: list[bagstore.Change] = []
    since = None
    while True:
        page = ds.changes(since=since, limit=500)
        feed += page
        since = page.cursor
        if not page:
            break
    recorded = {(c.op, c.id.hex(), (c.entity or {}).get("n")) for c in feed if c.op == "put"}
    deleted = {c.id.hex() for c in feed if c.op == "delete"}
    for op, h, n in acked:
        assert (op == "put" and ("put", h, n) in recorded) or (op == "delete" and h in deleted)
    history: dict[bytes, list[tuple[str, int]]] = {}
    last: dict[bytes, bagstore.Change] = {}
    for c in feed:
        history.setdefault(c.id, []).append((c.op, c.version))
        last[c.id] = c
    for entity_id, ops in history.items():
        puts = [v for op, v in ops if op == "put"]
        assert puts == sorted(set(puts)), (entity_id.hex(), ops)  # strictly rising
        for (op, v), prev in zip(ops[1:], ops, strict=False):
            assert op == "put" or v == prev[1], (entity_id.hex(), ops)  # a delete: last put's
    stored = ds.fetch_many(list(last))
    for entity_id, c in last.items():
        if c.op == "delete":
            assert entity_id not in stored
        else:
            assert stored[entity_id].version == c.version
    # the consumer, killed and restarted: every change handled, at least once
    handled: set[tuple[object, ...]] = set()
    torn = 0
    for line in filter(None, log.read_text().splitlines()):
        try:
            handled.add(tuple(json.loads(line)))
        except json.JSONDecodeError:  # cut by a SIGKILL (its batch was not checkpointed)
            torn += 1
    assert torn <= kills, torn
    finish = ds.subscribe("killed", lambda cs: handled.update(
        (c.id.hex(), c.op, c.version, c.bucket, c.position) for c in cs), lease=2.0)  # fmt: skip
    deadline = time.monotonic() + 60  # the killed process's leases lapse in 2 s
    while finish.poll() or ds.feed.consumers()[0]["lag_changes"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    finish.close()
    assert {(c.id.hex(), c.op, c.version, c.bucket, c.position) for c in feed} <= handled


def test_sigkilled_writers_and_consumers(topo: Topology, tmp_path: Path) -> None:
    _run(topo, tmp_path, ROUNDS)


@pytest.mark.soak
def test_sigkilled_writers_and_consumers_soak(
    topo: Topology, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if os.environ.get("BAGSTORE_SOAK") != "1" and "soak" not in (
        request.config.getoption("markexpr") or ""
    ):
        pytest.skip("soak test: run with -m soak or BAGSTORE_SOAK=1")
    _run(topo, tmp_path, 30)


def test_two_processes_of_one_consumer(topo: Topology, tmp_path: Path) -> None:
    """Two real processes of one consumer while writes go on: every change
    handled, none by both (ranges change hands only after a checkpoint)."""
    ds = topo.open(buckets=32)
    ds.feed.enable()
    logs = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    procs = [
        _spawn(CONSUMER.replace('"killed"', '"pair"'), {"urls": topo.urls, "log": str(log)})
        for log in logs
    ]
    written = 0
    try:
        deadline = time.monotonic() + 60
        while written < 200 or not all(log.exists() and log.stat().st_size for log in logs):
            assert time.monotonic() < deadline, "the second process never took a share"
            ds.put_many([{"n": i} for i in range(20)])
            written += 20
            time.sleep(0.05)
        while ds.feed.consumers()[0]["lag_changes"]:
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.05)
    finally:
        for p in procs:
            _kill(p)
    handled = [
        [tuple(json.loads(line)) for line in log.read_text().splitlines() if line] for log in logs
    ]
    assert all(handled), "both processes took a share"
    a, b = (set(h) for h in handled)
    assert len(a) + len(b) == sum(len(h) for h in handled) == written  # none twice
    assert not a & b
