"""docs/changes.md runs as written: its small examples in this process, and
the Redis consumer (the latest 20 entries of each user) as a real process,
killed with SIGKILL and started again while entries are written and deleted."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

import bagstore

DOC = Path(__file__).resolve().parent.parent / "docs" / "changes.md"


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)


def test_the_small_examples_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    small = [b for b in _blocks() if "redis" not in b]
    assert len(small) == 3
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    for block in small:
        exec(compile(block, str(DOC), "exec"), {})


def _redis() -> object:
    redis = pytest.importorskip("redis")
    client = redis.Redis(host="127.0.0.1", port=6379)
    try:
        client.ping()
    except redis.RedisError as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI requires Redis: {exc}")
        pytest.skip(f"Redis at 127.0.0.1:6379: {exc}")
    return client


def test_the_redis_consumer_survives_sigkill(tmp_path: Path) -> None:
    client = _redis()
    (script,) = [b for b in _blocks() if "redis" in b]
    path = tmp_path / "latest.py"
    path.write_text(script)
    store = str(tmp_path / "store")
    prefix = f"bagstore-test:{uuid.uuid4().hex[:12]}:"
    by_user = bagstore.Index(table="index_user_published", properties=["user", "published"])
    ds = bagstore.open(store, indexes=[by_user])
    ds.feed.enable(bodies=True)
    env = {
        **os.environ,
        "BAGSTORE_STORE": store,
        "LATEST_PREFIX": prefix,
        "PYTHONPATH": os.pathsep.join(sys.path),
    }

    errors = tmp_path / "stderr.log"

    def start() -> subprocess.Popen[bytes]:
        with errors.open("ab") as err:
            return subprocess.Popen([sys.executable, str(path)], env=env, stderr=err)

    def wait_for(condition: object, what: str) -> None:
        deadline = time.monotonic() + 90  # a killed process's leases lapse in 5 s
        while not condition():  # type: ignore[operator]
            assert time.monotonic() < deadline, f"{what}: {errors.read_text()[-2000:]}"
            assert proc.poll() is None, errors.read_text()[-2000:]
            time.sleep(0.1)

    rng = random.Random(26)
    users = [f"user{i}" for i in range(4)]
    live: list[bytes] = []
    published = 0
    proc = start()
    try:
        wait_for(lambda: ds.feed.consumers(), "the consumer did not start")
        for _ in range(3):
            for _ in range(60):
                published += 1
                if live and rng.random() < 0.25:
                    victim = live.pop(rng.randrange(len(live)))
                    ds.delete(victim)
                else:
                    user = rng.choice(users)
                    live.append(ds.put({"user": user, "published": published}))
            time.sleep(rng.uniform(0.05, 0.4))
            proc.send_signal(signal.SIGKILL)  # at whatever point it had reached
            proc.wait()
            proc = start()
        wait_for(lambda: ds.feed.consumers()[0]["lag_changes"] == 0, "it did not catch up")
        for user in users:
            newest = ds.query(user=user, order="-published", limit=20)
            want = {e["id"].hex().encode() for e in newest}
            held = set(client.zrange(prefix + user, 0, -1))  # type: ignore[attr-defined]
            assert held == want, user
            mine = sum(1 for e in ds.get_many(live) if e and e["user"] == user)
            assert len(held) == min(20, mine)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        keys = list(client.scan_iter(match=prefix + "*"))  # type: ignore[attr-defined]
        if keys:
            client.delete(*keys)  # type: ignore[attr-defined]
        ds.close()
