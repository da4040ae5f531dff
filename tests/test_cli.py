"""The ``bagstore`` command line, through click's CliRunner on SQLite stores."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, date, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

import bagstore
from bagstore.cli import cli, dumps_entity, loads_json, main, parse_filter_args

USER = bytes.fromhex("f48b0440ca0c4f66991c4d5f6a078eaf")
OTHER = bytes.fromhex("0123456789abcdef0123456789abcdef")


def hexj(b: bytes) -> str:
    """A bytes value as a command-line JSON argument."""
    return json.dumps({"$hex": b.hex()})


class Cli:
    """Runs ``bagstore --store DIR ...`` in-process."""

    def __init__(self, store: Path) -> None:
        self.store = store
        self.runner = CliRunner()

    def __call__(self, *args: str, input: str | None = None, store: bool = True) -> Result:
        argv = ["--store", str(self.store), *args] if store else list(args)
        return self.runner.invoke(cli, argv, input=input, catch_exceptions=False)

    def ok(self, *args: str, input: str | None = None) -> Result:
        result = self(*args, input=input)
        assert result.exit_code == 0, result.output
        return result

    def put(self, entity: dict[str, Any]) -> bytes:
        return bytes.fromhex(self.ok("put", dumps_entity(entity)).stdout.strip())

    def query(self, *args: str) -> tuple[list[dict[str, Any]], str | None]:
        result = self.ok("query", *args)
        entities = [loads_json(line) for line in result.stdout.splitlines()]
        cursor = None
        for line in result.stderr.splitlines():
            if line.startswith("next cursor: "):
                cursor = line.removeprefix("next cursor: ")
        return entities, cursor


def assert_error(result: Result, fragment: str) -> None:
    """Exit code 2, one ``error: ...`` line on stderr, no traceback."""
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert fragment in lines[0]
    assert "Traceback" not in result.output


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("BAGSTORE_STORE", raising=False)
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def run(tmp_path: Path) -> Iterator[Cli]:
    c = Cli(tmp_path / "store")
    c.ok("init", "--shards", "3", "--buckets", "64")
    yield c


# -- init and choosing the store ------------------------------------------------------
def test_init_creates_a_store_and_is_idempotent(tmp_path: Path) -> None:
    c = Cli(tmp_path / "s")
    first = c.ok("init", "--shards", "2", "--buckets", "16")
    assert "Created a SQLite store" in first.stdout
    assert "2 shards, 16 buckets" in first.stdout
    assert sorted(p.name for p in (tmp_path / "s").glob("shard_*.db")) == [
        "shard_0.db",
        "shard_1.db",
    ]
    again = c.ok("init")
    assert "already exists" in again.stdout and "2 shards, 16 buckets" in again.stdout
    assert_error(c("init", "--shards", "3"), "has 2 shards; 3 were asked for")
    assert_error(c("init", "--buckets", "32"), "created with 16 buckets")


def test_commands_other_than_init_need_an_existing_store(tmp_path: Path) -> None:
    c = Cli(tmp_path / "nothing")
    assert_error(c("status"), "bagstore init")
    assert not (tmp_path / "nothing").exists()


def test_default_store_env_and_config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = CliRunner()
    assert runner.invoke(cli, ["init"]).exit_code == 0
    assert (tmp_path / "bagstore-data" / "shard_0.db").exists()

    monkeypatch.setenv("BAGSTORE_STORE", str(tmp_path / "from-env"))
    assert runner.invoke(cli, ["init", "--shards", "1"]).exit_code == 0
    assert (tmp_path / "from-env" / "shard_0.db").exists()
    monkeypatch.delenv("BAGSTORE_STORE")

    (tmp_path / "bagstore.toml").write_text(
        '[bagstore]\npath = "from-config"\nshards = 2\n\n'
        '[[bagstore.index]]\ntable = "index_user_id"\nproperties = ["user_id"]\n'
    )
    result = runner.invoke(cli, ["init"])
    assert result.exit_code == 0, result.output
    assert "bagstore.toml" in result.stdout and "index_user_id" in result.stdout
    status = json.loads(runner.invoke(cli, ["status", "--json"]).stdout)
    assert len(status["shards"]) == 2
    assert [i["table"] for i in status["indexes"]] == ["index_user_id"]
    # An explicit --store beats ./bagstore.toml; --config beats BAGSTORE_STORE.
    status = json.loads(runner.invoke(cli, ["--store", "bagstore-data", "status", "--json"]).stdout)
    assert len(status["shards"]) == 4
    monkeypatch.setenv("BAGSTORE_STORE", str(tmp_path / "from-env"))
    status = json.loads(
        runner.invoke(cli, ["--config", "bagstore.toml", "status", "--json"]).stdout
    )
    assert len(status["shards"]) == 2


def test_config_and_store_together_is_a_usage_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["--config", "x.toml", "--store", "d", "status"])
    assert_error(result, "not both")  # click's usage errors come out in our style too


def test_file_system_errors_are_one_line(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    assert_error(Cli(tmp_path / "a-file" / "store")("init"), "a-file")


def test_config_errors_are_one_line(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["--config", "missing.toml", "status"])
    assert_error(result, "does not exist")
    (tmp_path / "bad.toml").write_text("[bagstore]\nshards = 3\ncolour = 1\n")
    assert_error(CliRunner().invoke(cli, ["--config", "bad.toml", "status"]), "unknown key")
    result = CliRunner().invoke(cli, ["--config", "bad.toml", "init", "--shards", "2"])
    assert result.exit_code == 2 and "config file" in result.stderr


# -- put and get ----------------------------------------------------------------------
def test_put_get_round_trip_with_bytes_and_datetimes(run: Cli) -> None:
    entity = {
        "user_id": USER,
        "title": "We just launched a new backend system for FriendFeed! ✓",
        "published": datetime(2009, 2, 27, 1, 10, 46, 123456, tzinfo=UTC),
        "local": datetime(2009, 2, 27, 9, 0, tzinfo=timezone(timedelta(hours=8))),
        "naive": datetime(2009, 2, 27, 1, 10),
        "day": date(2010, 6, 1),
        "nested": {"blobs": [b"\x00\xff", {"deep": b""}], "n": None},
        "big": 2**80,
        "f": 1.5,
        "flag": True,
    }
    text = dumps_entity(entity)
    assert '{"$hex": "f48b0440ca0c4f66991c4d5f6a078eaf"}' in text
    assert '{"$datetime": "2009-02-27T01:10:46.123456+00:00"}' in text
    assert '{"$date": "2010-06-01"}' in text
    entity_id = run.put(entity)
    assert len(entity_id) == 16

    result = run.ok("get", entity_id.hex())
    assert len(result.stdout.splitlines()) == 1
    assert loads_json(result.stdout) == {**entity, "id": entity_id}
    with bagstore.open(run.store) as ds:  # the library sees real bytes and datetimes
        assert ds.get(entity_id) == {**entity, "id": entity_id}


def test_put_with_an_id_replaces_the_whole_body(run: Cli) -> None:
    entity_id = bytes.fromhex("71f0c4d2291844cca2df6f486e96e37c")
    assert run.put({"id": entity_id, "title": "one", "extra": 1}) == entity_id
    assert run.put({"id": entity_id, "title": "two"}) == entity_id
    assert loads_json(run.ok("get", entity_id.hex()).stdout) == {"id": entity_id, "title": "two"}


def test_put_a_list_from_stdin_is_put_many(run: Cli) -> None:
    docs = [{"user_id": USER, "n": i} for i in range(5)]
    result = run.ok("put", input=json.dumps([json.loads(dumps_entity(d)) for d in docs]))
    ids = [bytes.fromhex(line) for line in result.stdout.split()]
    assert len(ids) == 5
    got = run.ok("get", *[i.hex() for i in ids]).stdout.splitlines()
    assert [loads_json(line)["n"] for line in got] == list(range(5))
    assert run.ok("put", "-", input='{"n": 9}').stdout.strip() != ""


def test_get_of_a_missing_id_exits_1(run: Cli) -> None:
    present = run.put({"n": 1})
    missing = bytes(16)
    result = run("get", present.hex(), missing.hex())
    assert result.exit_code == 1
    assert len(result.stdout.splitlines()) == 1
    assert f"not found: {missing.hex()}" in result.stderr


@pytest.mark.parametrize(
    ("args", "stdin", "fragment"),
    [
        (["put", "{bad"], None, "bad JSON"),
        (["put"], "[1, 2", "bad JSON"),
        (["put"], "", "nothing to put"),
        (["put", "5"], None, "JSON object or a list"),
        (["put", '{"b": {"$hex": "xyz"}}'], None, '"$hex"'),
        (["put", '{"d": {"$datetime": "yesterday"}}'], None, "ISO-8601"),
        (["put", '{"d": {"$date": "2010-06-01T00:00"}}'], None, "YYYY-MM-DD"),
        (["put", '{"d": {"$date": "2010-13-01"}}'], None, "YYYY-MM-DD"),
        (["put", '{"d": {"$date": 20100601}}'], None, "YYYY-MM-DD"),
        (["put", '{"id": "71f0c4d2291844cca2df6f486e96e37c"}'], None, '"$hex"'),
        (["put", '{"id": {"$hex": "abcd"}}'], None, "16 bytes"),
        (["put", "[1]"], None, "must be a dict"),
        (["get", "not-hex"], None, "32 hex digits"),
        (["get", "abcd"], None, "16 bytes"),
    ],
)
def test_bad_input_is_one_red_line_and_exit_2(
    run: Cli, args: list[str], stdin: str | None, fragment: str
) -> None:
    assert_error(run(*args, input=stdin), fragment)


def test_nothing_is_stored_by_a_failed_put(run: Cli) -> None:
    run("put", '[{"n": 1}, {"id": {"$hex": "00"}}]')
    assert json.loads(run.ok("status", "--json").stdout)["entities"] == 0


# -- queries --------------------------------------------------------------------------
@pytest.fixture
def scored(run: Cli) -> Cli:
    run.ok("index", "add", "index_user_score", "--properties", "user_id,score")
    with bagstore.open(run.store) as ds:
        ds.put_many(
            [{"user_id": USER, "score": i, "name": f"e{i}", "tag": ["odd", "even"][i % 2 == 0]}
             for i in range(25)]
            + [{"user_id": OTHER, "score": i, "name": "other"} for i in range(5)]
        )  # fmt: skip
    return run


def test_query_with_lookups(scored: Cli) -> None:
    found, cursor = scored.query(f"user_id={hexj(USER)}", "score__gte=10", "score__lt=13")
    assert [e["score"] for e in found] == [10, 11, 12] and cursor is None
    found, _ = scored.query(f"user_id__in=[{hexj(USER)}, {hexj(OTHER)}]", "score__lte=1")
    assert sorted(e["score"] for e in found) == [0, 0, 1, 1]
    found, _ = scored.query(f"user_id={hexj(OTHER)}", "--order=-score")
    assert [e["score"] for e in found] == [4, 3, 2, 1, 0]


def test_query_pages_with_cursor(scored: Cli) -> None:
    pages: list[list[int]] = []
    cursor: str | None = None
    while True:
        extra = ["--cursor", cursor] if cursor else []
        found, cursor = scored.query(
            f"user_id={hexj(USER)}", "--order", "-score", "--limit", "10", *extra
        )
        pages.append([e["score"] for e in found])
        if cursor is None:
            break
    assert pages == [list(range(24, 14, -1)), list(range(14, 4, -1)), [4, 3, 2, 1, 0]]


def test_query_values_are_json_when_they_parse(run: Cli) -> None:
    run.ok("index", "add", "index_name", "--properties", "name")
    for name in ("ann", "5", 5, True, 1):
        run.put({"name": name})
    for arg, expected in [
        ("name=ann", ["ann"]),
        ('name="5"', ["5"]),
        ("name=5", [5]),
        ("name=true", [True]),  # bool and int are different types in indexes
        ("name=1", [1]),
    ]:
        found, _ = run.query("--index", "index_name", arg)
        assert [e["name"] for e in found] == expected, arg


def test_query_through_a_building_index_needs_partial(run: Cli) -> None:
    before = run.put({"link": "http://a/"})
    assert "building" in run.ok("index", "add", "index_link", "--properties", "link").stdout
    after = run.put({"link": "http://b/"})
    assert_error(run("query", "link=http://a/"), "building")
    assert_error(run("query", "--index", "index_link", "link=http://b/"), "building")
    found, _ = run.query("--index", "index_link", "--partial", "link=http://b/")
    assert [e["id"] for e in found] == [after]
    found, _ = run.query("--index", "index_link", "--partial", "link=http://a/")
    assert found == [] and before  # not backfilled yet


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["title=x"], "no ready index answers this query"),
        (["--index", "index_nope", "title=x"], "no index 'index_nope'"),
        (["user_id__contains=x"], "unknown lookup"),
        (["user_id__in=x"], "takes a JSON list"),
        (["user_id__in=[null]"], "None is never indexed"),
        (["user_id=x", "--cursor", "garbage"], "cursor"),
        (["user_id=x", "--limit", "0"], "limit"),
        (["user_id=x", "--order", "title"], "index add index_user_id_title --properties user_id,t"),
        (["--index", "index_user_score", "user_id=x", "--order", "name"], "cannot order by"),
        (["order=1"], "needs --index"),
        ([], "at least one filter"),
    ],
)
def test_query_errors(scored: Cli, args: list[str], fragment: str) -> None:
    assert_error(scored("query", *args), fragment)


def test_query_usage_errors(scored: Cli) -> None:
    assert_error(scored("query", "--partial", "user_id=x"), "--partial reads one building")
    assert_error(scored("query", "user_id"), "key=value")
    assert_error(scored("query", "a=1", "a=2"), "twice")


def test_parse_filter_args() -> None:
    assert parse_filter_args(
        ["a=1", "b=x y", 'c="1"', "d__in=[1, 2]", 'e={"$hex": "00ff"}', "f=", "g=a=b"]
    ) == {"a": 1, "b": "x y", "c": "1", "d__in": [1, 2], "e": b"\x00\xff", "f": "", "g": "a=b"}
    when = parse_filter_args(['t__gte={"$datetime": "2009-01-01T00:00:00+00:00"}'])["t__gte"]
    assert when == datetime(2009, 1, 1, tzinfo=UTC)


# -- indexes --------------------------------------------------------------------------
def test_index_add_list_retire_drop(run: Cli) -> None:
    assert run.ok("index", "list").stdout.strip() == "No indexes."
    assert "ready" in run.ok("index", "add", "index_user_id", "--properties", "user_id").stdout
    add = run.ok(
        "index", "add", "index_email", "--properties", "email", "--shard-on", "email", "--unique"
    )
    assert add.stdout.strip() == "index index_email: ready"
    listed = json.loads(run.ok("index", "list", "--json").stdout)
    assert listed == [
        {"table": "index_email", "properties": ["email"], "shard_on": "email", "unique": True,
         "state": "ready"},
        {"table": "index_user_id", "properties": ["user_id"], "shard_on": "user_id",
         "unique": False, "state": "ready"},
    ]  # fmt: skip
    assert "index_email" in run.ok("index", "list").stdout

    run.put({"email": "a@example.com"})
    assert_error(run("put", '{"email": "a@example.com"}'), "already holds this value")

    assert_error(run("index", "drop", "index_email"), "retire it before dropping it")
    assert run.ok("index", "retire", "index_email").stdout.strip() == "index index_email: retired"
    assert_error(run("query", "--index", "index_email", "email=a@example.com"), "retired")
    assert run.ok("index", "drop", "index_email").stdout.strip() == "index index_email: dropped"
    assert [i["table"] for i in json.loads(run.ok("index", "list", "--json").stdout)] == [
        "index_user_id"
    ]
    assert_error(run("index", "drop", "index_email"), "no index 'index_email'")
    assert_error(run("index", "retire", "index_nope"), "no index 'index_nope'")


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["bad-name", "--properties", "x"], "not a plain identifier"),
        (["index_x", "--properties", "a,b", "--shard-on", "c"], "must be one of its properties"),
        (["index_x", "--properties", ""], "1 to 8 properties"),
        (["bagstore_x", "--properties", "a"], "reserved"),
    ],
)
def test_index_add_errors(run: Cli, args: list[str], fragment: str) -> None:
    assert_error(run("index", "add", *args), fragment)


def test_index_add_of_a_different_definition_is_refused(run: Cli) -> None:
    run.ok("index", "add", "index_a", "--properties", "a")
    assert_error(run("index", "add", "index_a", "--properties", "b"), "registered as")


# -- status and check ---------------------------------------------------------------
def test_status(run: Cli) -> None:
    run.ok("index", "add", "index_user_id", "--properties", "user_id")
    run.ok("put", input=json.dumps([{"user_id": {"$hex": "01"}}] * 7))
    report = json.loads(run.ok("status", "--json").stdout)
    assert report["buckets"] == 64 and report["entities"] == 7 and report["kind"] == "entities"
    assert [s["shard"] for s in report["shards"]] == [0, 1, 2]
    assert sum(s["buckets"] for s in report["shards"]) == 64
    assert sum(s["entities"] for s in report["shards"]) == 7
    assert report["indexes"] == [
        {"table": "index_user_id", "properties": ["user_id"], "shard_on": "user_id",
         "unique": False, "state": "ready"}
    ]  # fmt: skip
    status = run.ok("status")
    human = status.stdout
    assert "Shards" in human and "index_user_id" in human and "64 buckets" in human
    from bagstore.backends.sqlite import has_wal_reset_bug

    assert report["sqlite"] == {
        "version": sqlite3.sqlite_version,
        "wal_reset_bug": has_wal_reset_bug(),
    }
    assert "WAL-reset" not in human  # the warning, when it applies, is on stderr
    assert status.stderr.count("has the WAL-reset bug") == int(has_wal_reset_bug())


@pytest.mark.parametrize(
    ("version", "affected"),
    [
        ("3.6.23", False),  # before WAL
        ("3.7.0", True),
        ("3.40.1", True),
        ("3.44.5", True),
        ("3.44.6", False),  # patch releases with the fix
        ("3.45.0", True),
        ("3.50.7", False),
        ("3.51.2", True),
        ("3.51.3", False),
        ("3.52.0", False),
        ("4.0", False),
    ],
)
def test_which_sqlite_versions_have_the_wal_reset_bug(version: str, affected: bool) -> None:
    from bagstore.backends.sqlite import has_wal_reset_bug

    assert has_wal_reset_bug(version) is affected


def test_check_reports_missing_rows_and_exit_code(run: Cli) -> None:
    clean = run.ok("check")
    assert "0 missing, 0 stale" in clean.stdout
    run.ok("index", "add", "index_user_id", "--properties", "user_id")
    run.put({"user_id": USER})
    assert "consistent" in run.ok("check").stdout

    run.put({"link": "http://a/"})
    run.put({"link": "http://b/"})
    run.ok("index", "add", "index_link", "--properties", "link")  # building: 2 rows missing
    result = run("check")
    assert result.exit_code == 1
    assert "2 missing, 0 stale" in result.stdout and "index_link" in result.stdout
    report = json.loads(run("check", "--json").stdout)
    assert report["missing"] == 2 and report["stale"] == 0
    assert report["indexes"]["index_link"]["missing"] == 2
    assert report["indexes"]["index_user_id"]["missing"] == 0


# -- demo -----------------------------------------------------------------------------
def test_demo_on_a_small_store(tmp_path: Path) -> None:
    runner = CliRunner()
    where = tmp_path / "demo"
    result = runner.invoke(cli, ["demo", "--dir", str(where), "--entries", "150"])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "Wrote 150 entries" in out and "index_user_id finds all 150" in out
    assert "building" in out and "Summary" in out
    assert "it is now ready" in out and "finds 1 entity" in out
    with bagstore.open(where) as ds:
        assert ds.count() == 151
        assert set(ds.indexes()) == {"index_user_id", "index_link"}

    assert_error(runner.invoke(cli, ["demo", "--dir", str(where)]), "--reset")
    again = runner.invoke(cli, ["demo", "--dir", str(where), "--entries", "20", "--reset"])
    assert again.exit_code == 0, again.output
    with bagstore.open(where) as ds:
        assert ds.count() == 21


# -- entry points and help ------------------------------------------------------------
@pytest.mark.parametrize(
    "command",
    [[], ["init"], ["status"], ["put"], ["get"], ["query"], ["index"], ["index", "list"],
     ["index", "add"], ["index", "retire"], ["index", "drop"], ["check"], ["demo"],
     ["clean"], ["shard"], ["shard", "list"], ["shard", "add"], ["shard", "move"],
     ["shard", "rebalance"], ["shard", "resume"], ["shard", "rollback"], ["key"],
     ["key", "migrate"], ["seq"], ["seq", "next"], ["seq", "show"], ["bench"]],
)  # fmt: skip
def test_every_command_has_help(command: list[str]) -> None:
    result = CliRunner().invoke(cli, [*command, "--help"])
    assert result.exit_code == 0 and "Usage:" in result.stdout
    assert len(result.stdout.splitlines()) > 4


def test_main_and_python_m(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    done = subprocess.run(
        [sys.executable, "-m", "bagstore", "--store", str(tmp_path / "s"), "status"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr.startswith("error: no bagstore store") and "Traceback" not in done.stderr
