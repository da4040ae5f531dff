"""`--json` of every command: strict JSON whose keys and types are the ones
docs/cli.md documents (parsed from the page, so that the two cannot drift), and
the page's examples run as written."""

from __future__ import annotations

import json
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner, Result

import bagstore
from bagstore.cli import cli
from tests import servers

DOC = Path(__file__).resolve().parent.parent / "docs" / "cli.md"


# -- the documented schema -------------------------------------------------------------
@dataclass(frozen=True)
class Key:
    path: str
    type: str
    optional: bool


def documented() -> dict[str, dict[str, Key]]:
    """``{command: {key path: Key}}`` from the tables of docs/cli.md's
    "--json, command by command" section."""
    text = DOC.read_text()
    section = text.split("## `--json`, command by command", 1)[1].split("\n## ", 1)[0]
    out: dict[str, dict[str, Key]] = {}
    for part in re.split(r"^### ", section, flags=re.M)[1:]:
        heading, body = part.split("\n", 1)
        keys: dict[str, Key] = {}
        for raw, kind in re.findall(r"^\| `([^`]+)` \| ([^|]+?) \|", body, re.M):
            path = raw.removesuffix("?")
            keys[path] = Key(path, kind.strip(), raw.endswith("?"))
        assert keys, f"no key table under {heading!r}"
        for command in re.findall(r"`([a-z ]+)`", heading):
            out[command] = keys
    return out


def _matches(value: Any, kind: str) -> bool:
    for alt in (a.strip() for a in kind.split(" or ")):
        if alt.startswith("list of "):
            if isinstance(value, list) and all(_matches(v, alt[8:]) for v in value):
                return True
            continue
        if {
            "any": True,
            "int": type(value) is int,
            "number": type(value) in (int, float),
            "string": isinstance(value, str),
            "bool": isinstance(value, bool),
            "null": value is None,
            "object": isinstance(value, dict),
            "list": isinstance(value, list),
        }[alt]:
            return True
    return False


def _descends(kind: str) -> bool:
    """Whether the documented keys go on below a value of this type."""
    return kind in ("object", "list of object")


@dataclass
class Seen:
    """What a command's JSON outputs held: every key path with its values, and
    the paths of the objects visited (whose keys are then required)."""

    values: dict[str, list[Any]] = field(default_factory=dict)
    objects: set[str] = field(default_factory=set)

    def visit(self, value: Any, path: str, keys: dict[str, Key]) -> None:
        if isinstance(value, list):
            for item in value:
                self.visit(item, f"{path}[]", keys)
        elif isinstance(value, dict):
            self.objects.add(path)
            mapped = _join(path, "*") in keys
            for name, item in value.items():
                at = _join(path, "*" if mapped else name)
                self.values.setdefault(at, []).append(item)
                if at in keys and _descends(keys[at].type):
                    self.visit(item, at, keys)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _parent(path: str) -> str:
    """The path of the object holding ``path``'s last key ("" for the top)."""
    return path.rsplit(".", 1)[0] if "." in path else ""


def _strict(text: str) -> Any:
    def refuse(name: str) -> Any:
        raise AssertionError(f"not strict JSON: {name}")

    return json.loads(text, parse_constant=refuse)


# -- running every command -------------------------------------------------------------
class Runner:
    def __init__(self, store: Path) -> None:
        self.store = store
        self.outputs: dict[str, list[Any]] = {}

    def run(self, *args: str, code: int = 0) -> Result:
        result = CliRunner().invoke(cli, ["--store", str(self.store), *args])
        assert result.exit_code == code, (args, result.output)
        return result

    def doc(self, command: str, *args: str, code: int = 0) -> Any:
        """Run ``command ARGS --json``; keep the JSON document it printed."""
        result = self.run(*command.split(), *args, "--json", code=code)
        doc = _strict(result.stdout)
        self.outputs.setdefault(command, []).append(doc)
        return doc

    def lines(self, command: str, *args: str, code: int = 0) -> list[Any]:
        """Run ``command ARGS --json``: entity lines, then the trailer (kept)."""
        result = self.run(*command.split(), *args, "--json", code=code)
        *entities, trailer = [_strict(line) for line in result.stdout.splitlines()]
        assert all(isinstance(e, dict) and "id" in e for e in entities)
        assert isinstance(trailer, dict) and "id" not in trailer
        self.outputs.setdefault(command, []).append(trailer)
        return list(entities)


def _unfinished_move(store: Path, bucket: int) -> None:
    """The catalog of a move killed right after it began (phase copy)."""
    with bagstore.open(store) as ds:
        source = ds.placement.shard_of_bucket[bucket]
        ds.catalog.set_move(bucket, source, (source + 1) % len(ds.shards), "copy")


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    """Every command with --json, run once on one SQLite store: {command: docs}."""
    root = tmp_path_factory.mktemp("json")
    r = Runner(root / "s")
    assert r.doc("init", "--shards", "2", "--buckets", "16")["created"] is True
    assert r.doc("init")["created"] is False
    assert r.doc("index add", "index_n", "--properties", "n")["state"] == "ready"
    entities = [
        {"n": i, "link": f"l{i % 5}", "x": float("nan") if i == 0 else i} for i in range(30)
    ]
    ids = r.doc("put", json.dumps(entities))["ids"]
    assert len(ids) == 30
    assert r.doc("index add", "index_link", "--properties", "link")["state"] == "building"
    assert r.doc("clean", "--index", "index_link", "--settle", "0", "--duty", "0")["written"] == 30
    found = r.lines("get", ids[0], "ff" * 16, code=1)
    assert [e["id"] for e in found] == [{"$hex": ids[0]}]
    assert found[0]["x"] == {"$float": "nan"}
    assert r.outputs["get"][-1] == {"missing": ["ff" * 16]}
    assert len(r.lines("query", "--limit", "4", "n__gte=0")) == 4
    assert isinstance(r.outputs["query"][-1]["cursor"], str)
    assert len(r.lines("query", "--all", "--limit", "4", "n__gte=0")) == 30
    assert r.outputs["query"][-1] == {"cursor": None}
    r.run("feed", "on", "--bodies")
    r.run("put", json.dumps({"n": -1}))
    with bagstore.open(r.store) as ds:
        ds.subscribe("reader", print).close()
    changed = [_strict(line) for line in r.run("changes", "--json").stdout.splitlines()]
    assert [c["op"] for c in changed] == ["put"] and changed[0]["entity"]["n"] == -1
    r.outputs["changes"] = changed
    r.doc("status")
    r.doc("index list")
    assert r.doc("check")["missing"] == 0
    with bagstore.open(r.store) as ds:
        ds.router.backends[0].execute("DELETE FROM index_link")
    assert r.doc("check", code=1)["missing"] > 0
    assert r.doc("clean", "--repair")["written"] > 0
    assert r.doc("index retire", "index_n") == {"table": "index_n", "state": "retired"}
    assert r.doc("index drop", "index_n") == {"table": "index_n", "state": "dropped"}
    renamed = r.doc("index rename", "index_link", "index_url", "--settle", "0")
    assert renamed == {"table": "index_url", "state": "ready", "replaced": "index_link"}
    assert r.doc("shard add", f"sqlite:///{root}/s/more.db")["shard"] == 2
    assert r.doc("shard rebalance", "--grace", "0", "--duty", "0")["buckets"] == 5
    assert r.doc("shard move", "--to", "0", "--grace", "0", "15")["buckets"] in (0, 1)
    _unfinished_move(r.store, 3)
    _unfinished_move(r.store, 4)
    assert set(r.doc("shard list")["unfinished_moves"]) == {"3", "4"}
    assert r.doc("shard rollback", "3") == {"bucket": 3, "rolled_back": True}
    assert r.doc("shard resume", "--grace", "0")["buckets"] == 1
    with bagstore.open(r.store, kind="posts", shard_key="user", shard_map="directory") as ds:
        ds.put_many([{"user": b"\x00ann", "n": i} for i in range(3)])
    migrated = r.doc(
        "key migrate", "--kind", "posts", "--shard-key", "user", "--wait", "0",
        '{"$hex": "00616e6e"}', "9",
    )  # fmt: skip
    assert migrated["key"] == {"$hex": "00616e6e"} and migrated["moved"] == 3
    assert r.doc("seq next", "photos", "-n", "2")["ids"] == [1, 2]
    assert r.doc("seq show")["photos"] >= 2
    return r.outputs


DOCUMENTED = documented()
#: Commands whose --json needs servers this module does not start: checked where
#: they run (tests/test_replicas.py, on a replication group).
ELSEWHERE = {"shard failover"}


@pytest.mark.parametrize("command", sorted(set(DOCUMENTED) - ELSEWHERE))
def test_json_keys_are_the_documented_ones(command: str, outputs: dict[str, list[Any]]) -> None:
    keys = DOCUMENTED[command]
    assert outputs.get(command), f"the test runs no `{command} --json`"
    seen = Seen()
    for doc in outputs[command]:
        seen.visit(doc, "", keys)
    undocumented = sorted(set(seen.values) - set(keys))
    assert not undocumented, f"`{command} --json` prints keys docs/cli.md lacks: {undocumented}"
    for path, values in seen.values.items():
        bad = [v for v in values if not _matches(v, keys[path].type)]
        assert not bad, f"{command}: {path} is documented as {keys[path].type}, not {bad[:3]}"
    absent = sorted(
        path
        for path, key in keys.items()
        if not key.optional and _parent(path) in seen.objects and path not in seen.values
    )
    assert not absent, f"`{command} --json` lacks documented keys {absent}"


def test_parent_paths() -> None:
    assert _parent("cursor") == ""
    assert _parent("*") == ""
    assert _parent("[].table") == "[]"
    assert _parent("shards[].shard") == "shards[]"
    assert _parent("sqlite.version") == "sqlite"
    assert _parent("indexes.*.examples[].keys") == "indexes.*.examples[]"
    assert _parent("indexes.*.state") == "indexes.*"


def _commands(group: click.Group, prefix: str = "") -> Iterator[tuple[str, click.Command]]:
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            yield from _commands(command, f"{prefix}{name} ")
        else:
            yield f"{prefix}{name}", command


def test_every_json_option_is_documented() -> None:
    with_json = {
        name
        for name, command in _commands(cli)
        if any("--json" in getattr(p, "opts", ()) for p in command.params)
    }
    assert with_json == set(DOCUMENTED)
    for must in ("init", "put", "get", "query", "index add", "shard move", "key migrate"):
        assert must in with_json


def test_exit_codes_are_documented() -> None:
    table = DOC.read_text().split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    assert re.findall(r"^\| (\d+) \|", table, re.M) == ["0", "1", "2", "130"]


# -- the page's examples -----------------------------------------------------------------
def _examples() -> list[tuple[list[str], int, list[str]]]:
    """``(args, exit code, stdout lines)`` of every ``$ bagstore`` line of the
    page's console blocks (no lines shown: stdout is not compared)."""
    found = []
    for block in re.findall(r"```console\n(.*?)```", DOC.read_text(), re.S):
        for command in re.split(r"^\$ ", block, flags=re.M)[1:]:
            line, *shown = command.rstrip("\n").split("\n")
            args = shlex.split(line, comments=True)
            code = re.search(r"# exit (\d+)", line)
            assert args[0] == "bagstore"
            found.append((args[1:], int(code.group(1)) if code else 0, shown))
    return found


def test_the_examples_in_docs_cli_md_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("BAGSTORE_STORE", raising=False)
    examples = _examples()
    assert len(examples) >= 6
    for args, code, shown in examples:
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == code, (args, result.output)
        if shown:
            assert result.stdout.splitlines() == shown, args
        if code == 2:
            assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1


def test_clean_follow_json_prints_a_line_per_pass_that_changed_something(
    tmp_path: Path,
) -> None:
    """A real process (it runs until Ctrl-C): each line is strict JSON with the
    documented keys of `clean`; SIGINT ends it with exit code 130."""
    store = tmp_path / "s"
    with bagstore.open(store, shards=2) as ds:
        ds.put_many([{"link": f"l{i}"} for i in range(20)])
        ds.add_index(bagstore.Index(table="index_link", properties=["link"]))
        bagstore.Cleaner(ds, settle=0).backfill("index_link")
        for backend in ds.router.backends:
            backend.execute("DELETE FROM index_link")
    command = [sys.executable, "-m", "bagstore", "--store", str(store), "clean", "--follow"]
    process = subprocess.Popen(
        [*command, "--json", "--interval", "0.1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=servers.sigint_default,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()  # (closes its pipes too)
    counts = _strict(line)
    assert set(counts) == set(DOCUMENTED["clean"]) and counts["written"] == 20
    assert process.returncode == 130, err
