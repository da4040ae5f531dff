"""Unplanned failover on a real MariaDB replication group (its own three
servers: the test kills the primary), with semi-synchronous replication on:
no acknowledged write is lost, reads go on from replicas during the outage,
writers resume after the failover, and a revived old primary is fenced off."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import bagstore
from bagstore.errors import ConfigurationError
from bagstore.sharding.failover import add_replica
from tests import servers
from tests.replication import (
    APP_PASSWORD,
    APP_USER,
    REPL_PASSWORD,
    REPL_USER,
    ReplicationGroup,
    started_group,
)

INDEX = bagstore.Index("index_user", ["user_id"], shard_on="user_id")

WRITER = """
    import sys, time
    import bagstore
    from bagstore.errors import BackendError
    ds = bagstore.Datastore([{url!r}], indexes=[bagstore.Index("index_user", ["user_id"],
                            shard_on="user_id")])
    n = 0
    print("ready", flush=True)
    while True:
        try:
            entity_id = ds.put({{"user_id": b"w{k}", "n": n}})
        except BackendError as exc:
            b = ds.router.backends[0]
            print("E", time.time(), type(exc).__name__, b.suspect, b.server,
                  str(exc)[:300].replace(" ", "_"), flush=True)
            time.sleep(0.02)
            continue
        print("P", entity_id.hex(), time.time(), flush=True)
        n += 1
"""


@pytest.fixture(scope="module")
def group() -> Iterator[ReplicationGroup]:
    with started_group(3) as g:
        for s in g.servers:  # whichever is promoted keeps semi-sync on
            s.sql("SET GLOBAL rpl_semi_sync_master_wait_point = 'AFTER_SYNC'")
            s.sql("SET GLOBAL rpl_semi_sync_master_timeout = 10000")
            s.sql("SET GLOBAL rpl_semi_sync_master_enabled = ON")
        g.semi_sync(True)
        yield g


def _lines(proc: subprocess.Popen[str], until: Any, timeout: float = 60) -> list[str]:
    """Lines of a writer's output until ``until(lines)`` holds."""
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while not until(lines):
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"writer ended: {proc.stderr.read() if proc.stderr else ''}")
        lines.append(line.split())
        if time.monotonic() > deadline:
            raise AssertionError(f"writer too slow: {lines[-5:]}")
    return lines


def test_semi_sync_falling_back_to_async_is_surfaced(
    group: ReplicationGroup, tmp_path: Path
) -> None:
    """No replica acknowledges in time: MariaDB goes on asynchronously and
    says nothing; ``bagstore status`` says it, and logs it."""
    from click.testing import CliRunner

    from bagstore.cli import cli

    db = servers.unique_name("semisync")
    with bagstore.Datastore([group.url(db)]) as ds:
        ds.put({"n": 1})
        assert _semi_sync(ds)["enabled"] and _semi_sync(ds)["active"]
        group.primary.sql("SET GLOBAL rpl_semi_sync_master_timeout = 100")
        for r in group.replicas:
            r.sql("STOP SLAVE IO_THREAD")
        try:
            ds.put({"n": 2})  # waits 100 ms for an acknowledgement, then goes on
            assert _semi_sync(ds)["enabled"] and not _semi_sync(ds)["active"]
            result = CliRunner().invoke(
                cli, ["--config", _config(group, db, tmp_path), "status"], catch_exceptions=False
            )
            assert result.exit_code == 0
            assert "fell back to async" in result.output
            assert "fell back to asynchronous" in result.output  # the warning, on stderr
        finally:
            for r in group.replicas:
                r.sql("START SLAVE IO_THREAD")
            group.primary.sql("SET GLOBAL rpl_semi_sync_master_timeout = 10000")
        group.sync()
        deadline = time.monotonic() + 10
        while not _semi_sync(ds)["active"]:
            ds.put({"n": 3})  # the next acknowledged commit turns it back on
            assert time.monotonic() < deadline
    group.drop([db])


def _semi_sync(ds: bagstore.Datastore) -> dict[str, Any]:
    from bagstore.sharding.replicas import servers_status

    states = servers_status(ds.router)
    return dict(next(s for s in states if s["role"] == "primary")["semi_sync"])


def _config(group: ReplicationGroup, db: str, where: Path) -> str:
    path = where / "app.toml"
    path.write_text(f'[bagstore]\nshards = ["{group.url(db)}"]\n')
    return str(path)


def _acked_after(lines: list[Any], moment: float) -> int:
    return sum(1 for x in lines if x[0] == "P" and float(x[2]) > moment)


def test_sigkill_the_primary_under_two_writers(group: ReplicationGroup) -> None:
    db = servers.unique_name("failover")
    root_url = group.url(db)
    app_url = group.url(db, user=APP_USER, password=APP_PASSWORD)
    admin = bagstore.Datastore([root_url], indexes=[INDEX])
    reader = bagstore.Datastore([root_url], read_from="replica", connect_timeout=1)
    stale_root = bagstore.Datastore([root_url])
    stale_app = bagstore.Datastore([app_url])
    admin.feed.enable()
    known = [admin.put({"user_id": b"r", "n": n}) for n in range(10)]
    group.sync()
    cursor = admin.changes().cursor  # the change feed's epoch before the failover
    procs = [servers.spawn_python(WRITER.format(url=root_url, k=k)) for k in range(2)]
    outputs: list[list[Any]] = [[], []]
    try:
        for k, p in enumerate(procs):
            outputs[k] += _lines(p, lambda ls: sum(1 for x in ls if x[0] == "P") >= 30)
        assert group.primary.one("SHOW STATUS LIKE 'Rpl_semi_sync_master_status'") is not None
        killed_at = time.time()
        group.primary.kill()
        # reads are answered by the replicas during the outage
        for entity_id in known:
            assert reader.get(entity_id) is not None
        with pytest.raises(ConfigurationError, match="not a replica"):
            admin.failover(0, to=group.primary.addr)
        done = admin.failover(0, replication_user=REPL_USER, replication_password=REPL_PASSWORD)
        assert not done["planned"] and done["old_primary"] == group.primary.addr
        # the old primary may have committed changes no replica received: a
        # cursor from before is refused rather than silently skipping
        with pytest.raises(bagstore.ChangesLost, match="before a failover"):
            admin.changes(cursor)
        new_primary = next(s for s in group.replicas if s.addr == done["primary"])
        resumed: list[float] = []
        for k, p in enumerate(procs):
            outputs[k] += _lines(p, lambda ls: _acked_after(ls, killed_at) >= 30)
            resumed.append(
                min(float(x[2]) for x in outputs[k] if x[0] == "P" and float(x[2]) > killed_at)
            )
        unavailable = max(resumed) - killed_at
        print(f"writes unavailable for {unavailable:.2f} s (failover took {done['seconds']} s)")
    finally:
        for p in procs:
            p.send_signal(signal.SIGKILL)
            out, _ = p.communicate()
            k = procs.index(p)
            outputs[k] += [line.split() for line in out.splitlines()]
    acked = [bytes.fromhex(x[1]) for lines in outputs for x in lines if x and x[0] == "P"]
    assert len(acked) >= 120
    # semi-sync (AFTER_SYNC): every acknowledged write is on the new primary
    table = f"{servers.quote_ident(db)}.entities"
    stored = {bytes(r[0]) for r in new_primary.sql(f"SELECT id FROM {table}")}
    assert set(acked) <= stored
    assert all(e is not None for e in admin.get_many(acked))
    bagstore.Cleaner(admin).repair()
    report = admin.check()
    assert report["missing"] == 0 and report["stale"] == 0
    # the old primary comes back (read_only off, its old role row): processes
    # that missed the failover write to the new primary, as root and as the
    # application's user; so does a process started with the old configuration
    group.primary.restart()
    assert not group.primary.one("SELECT @@read_only")
    marks = [stale_root.put({"stale": "root"}), stale_app.put({"stale": "app"})]
    with bagstore.Datastore([root_url]) as fresh:
        marks.append(fresh.put({"stale": "fresh"}))
        assert fresh.router.backends[0].server == new_primary.addr
    on_old = group.primary.sql(f"SELECT COUNT(*) FROM {table} WHERE id IN (%s, %s, %s)", marks)
    on_new = new_primary.sql(f"SELECT COUNT(*) FROM {table} WHERE id IN (%s, %s, %s)", marks)
    assert on_old[0][0] == 0 and on_new[0][0] == 3
    # it is refused as a target: it must be rebuilt first
    with pytest.raises(ConfigurationError, match="refused"):
        admin.failover(0, to=group.primary.addr)
    # rebuilt from a copy of a replica's data (as from mariadb-backup), it is a
    # replica again once it replicates read-only from the new primary
    with pytest.raises(ConfigurationError, match="must replicate from the primary"):
        add_replica(admin.router, 0, group.primary.addr)
    other = next(s for s in group.replicas if s is not new_primary)
    other.terminate()
    group.primary.terminate()
    shutil.rmtree(group.primary.datadir)
    shutil.copytree(other.datadir, group.primary.datadir)
    other.restart()
    group.primary.restart()
    for server in (other, group.primary):
        server.sql("SET GLOBAL read_only = ON")
        server.sql("START SLAVE")
    done = add_replica(admin.router, 0, group.primary.addr)
    assert done["epoch"] > 1
    role = admin.router.replication.role_of(admin.router.backends[0])
    assert role is not None and group.primary.addr in role.replicas and not role.retired
    group.primary.wait_for(new_primary.gtid())
    assert group.primary.one(f"SELECT COUNT(*) FROM {table} WHERE id = %s", (marks[0],)) == 1
    for ds in (admin, reader, stale_root, stale_app):
        ds.close()


def test_without_semi_sync_an_acknowledged_write_can_be_lost(group: ReplicationGroup) -> None:
    """What docs/replication.md says can be lost without semi-sync (here: after
    it fell back to asynchronous): a write acknowledged while no replica
    received it is not on the promoted replica; it stays in the old primary's
    data, which is retired, never repointed."""
    db = servers.unique_name("async_loss")
    options = {"replication_user": REPL_USER, "replication_password": REPL_PASSWORD}
    with bagstore.Datastore([group.url(db)]) as probe:  # where the primary is now
        role = probe.router.replication.role_of(probe.router.backends[0])
    assert role is not None
    primary = next(s for s in group.servers if s.addr == role.primary)
    replicas = [s for s in group.servers if s.addr in role.replicas and s.running]
    with bagstore.Datastore([group.url(db)]) as ds:
        kept = ds.put({"n": 1})
        for r in replicas:
            r.wait_for(primary.gtid())
            r.sql("STOP SLAVE IO_THREAD")
        primary.sql("SET GLOBAL rpl_semi_sync_master_timeout = 100")
        lost = ds.put({"n": 2})  # acknowledged after 100 ms, asynchronously
        primary.kill()
        for r in replicas:
            r.sql("START SLAVE IO_THREAD")
        done = ds.failover(0, **options)
        assert not done["planned"] and done["old_primary"] == primary.addr
        assert ds.get(kept) is not None
        assert ds.get(lost) is None  # acknowledged, and lost
    primary.restart()
    table = f"{servers.quote_ident(db)}.entities"
    assert primary.one(f"SELECT COUNT(*) FROM {table} WHERE id = %s", (lost,)) == 1
    with bagstore.Datastore([group.url(db)]) as fresh:  # the old primary is not chosen
        assert fresh.router.backends[0].server == done["primary"]
        assert fresh.get(lost) is None
