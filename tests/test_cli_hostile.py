"""Hostile input at the command line: never a traceback (issue #20, item 2).

Every command that reads user input is driven with random and hostile input, through
click's CliRunner (most examples) and through real ``python -m bagstore`` processes
(a few dozen, derandomized): every outcome is exit code 0, 1 or 2, at most one
``error:`` line on stderr, never a traceback and never an internal error.  Entities of
every kind the codec stores round-trip through ``put`` and ``get`` as strict JSON.
All on SQLite stores in a temporary directory.
"""

from __future__ import annotations

import decimal
import doctest
import json
import math
import os
import random
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bagstore
from bagstore import cli_errors, cli_json
from bagstore.cli import cli, dumps_entity, loads_json
from tests import servers

FAST = settings(
    max_examples=60,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
FEW = settings(FAST, max_examples=8)  # real processes: ~0.2 s each


# -- how an outcome must look -------------------------------------------------------
def _no_constants(name: str) -> Any:
    raise AssertionError(f"not strict JSON: {name}")


def strict_json(line: str) -> Any:
    """Parse one printed line as RFC 8259 JSON (no NaN or Infinity)."""
    return json.loads(line, parse_constant=_no_constants)


def check_outcome(code: int, stdout: str, stderr: str, *, json_lines: bool = False) -> None:
    """Exit 0, 1 or 2; at most one ``error:`` line (exactly one on exit 2), never
    an internal error or a traceback; printed entities are strict JSON."""
    assert code in (0, 1, 2), (code, stderr)
    assert "Traceback" not in stderr and "Traceback" not in stdout, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) <= 1, stderr
    assert not any("internal error" in line for line in errors), stderr
    if code == 2:
        assert len(errors) == 1, stderr
    if json_lines and code in (0, 1):
        for line in stdout.splitlines():
            strict_json(line)


def check_result(result: Result, *, json_lines: bool = False) -> None:
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(
        result.exception
    )
    check_outcome(result.exit_code, result.stdout, result.stderr, json_lines=json_lines)


def assert_one_error(result: Result, fragment: str, code: int = 2) -> str:
    assert result.exit_code == code, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert fragment in lines[0], lines[0]
    assert "Traceback" not in result.output
    return lines[0]


class Cli:
    """``bagstore --store DIR ...`` in-process, or as a real process."""

    def __init__(self, store: Path) -> None:
        self.store = store
        self.runner = CliRunner()

    def __call__(self, *args: str, input: str | bytes | None = None) -> Result:
        return self.runner.invoke(cli, ["--store", str(self.store), *args], input=input)

    def ok(self, *args: str, input: str | bytes | None = None) -> Result:
        result = self(*args, input=input)
        assert result.exit_code == 0, result.output
        return result

    def process(
        self, *args: str | bytes, input: bytes = b"", store: bool = True
    ) -> subprocess.CompletedProcess[bytes]:
        prefix: list[str | bytes] = ["--store", str(self.store)] if store else []
        return subprocess.run(
            [sys.executable, "-m", "bagstore", *prefix, *args],
            input=input,
            capture_output=True,
            timeout=120,
            check=False,
        )


def check_process(done: subprocess.CompletedProcess[bytes], *, json_lines: bool = False) -> None:
    stdout = done.stdout.decode("utf-8")  # everything printed is UTF-8
    stderr = done.stderr.decode("utf-8")
    check_outcome(done.returncode, stdout, stderr, json_lines=json_lines)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("BAGSTORE_STORE", raising=False)
    monkeypatch.delenv("BAGSTORE_DEBUG", raising=False)
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def run(tmp_path: Path) -> Iterator[Cli]:
    c = Cli(tmp_path / "store")
    c.ok("init", "--shards", "2", "--buckets", "16")
    c.ok("index", "add", "index_n", "--properties", "n")
    yield c


# -- hostile input ------------------------------------------------------------------
any_char = st.characters(exclude_categories=())  # surrogates, NUL, controls too
odd_text = st.one_of(
    st.text(max_size=40),
    st.text(any_char, max_size=40),
    st.sampled_from(
        [
            "", " ", "-", "--", "\x00", "\ud800", "\u202e\u0301", "\ufeff{}", "\u2028",
            "NaN", "-Infinity", "1e999", "-0", "0x10", "\uff11\uff12\uff13", "true", "null",
        ]
    ),
)  # fmt: skip
tag_keys = st.sampled_from(["$hex", "$datetime", "$int", "$float", "$dict", "$x", "id"])
json_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=10),
    ),
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.one_of(tag_keys, st.text(max_size=5)), children, max_size=4),
    ),
    max_leaves=15,
)
json_text = json_values.map(lambda v: json.dumps(v, allow_nan=True))
digits = st.integers(4300, 6000).map(lambda n: "9" + "0123456789" * (n // 10))
big_number_text = st.one_of(
    digits.map(lambda d: '{"n": ' + d + "}"),
    digits.map(lambda d: '{"n": -' + d + "}"),
    digits.map(lambda d: '{"n": {"$int": "' + d + '"}}'),
    digits.map(lambda d: '{"n": ' + d + ".5e3}"),
    digits.map(lambda d: "[" + d + "]"),
)
deep_text = st.sampled_from([10, 500, 600, 1500, 100_000]).flatmap(
    lambda n: st.sampled_from(["[" * n + "]" * n, '{"a": ' * n + "1" + "}" * n, "[" * n])
)
tag_text = st.one_of(
    st.tuples(tag_keys, json_values).map(lambda kv: json.dumps({"e": {kv[0]: kv[1]}})),
    st.sampled_from(
        [
            '{"a": {"$hex": "zz"}}', '{"a": {"$int": 5}}', '{"a": {"$int": "1e5"}}',
            '{"a": {"$float": "1.5"}}', '{"a": {"$float": "NaN"}}', '{"a": {"$dict": 1}}',
            '{"a": {"$dict": {"$hex": "00"}}}', '{"a": {"$datetime": "2009-13-45"}}',
            '{"a": {"$int": "5", "k": 1}}', '{"id": {"$hex": "00"}}', '{"id": 5}',
            '[{"n": 1}, 5]', '{"a": NaN, "b": -Infinity}', '{"a": "\\ud800"}',
        ]
    ),
)  # fmt: skip
put_text = st.one_of(odd_text, json_text, big_number_text, deep_text, tag_text)
stdin_bytes = st.one_of(
    st.binary(max_size=60),
    put_text.map(lambda t: t.encode("utf-8", "surrogatepass")),
    st.sampled_from([b'{"a": "\xff\xfe"}', b"\xef\xbb\xbf{}", b"\xef\xbb\xbf", b'{"a": 1}\xc0']),
)


@FAST
@given(text=put_text, via_stdin=st.booleans())
def test_put_never_tracebacks(run: Cli, text: str, via_stdin: bool) -> None:
    if via_stdin:
        result = run("put", input=text.encode("utf-8", "surrogatepass"))
    else:
        result = run("put", "--", text)
    check_result(result)
    if result.exit_code == 0:
        for line in result.stdout.split():
            assert len(bytes.fromhex(line)) == 16


@FAST
@given(data=stdin_bytes)
def test_put_of_random_bytes_on_stdin(run: Cli, data: bytes) -> None:
    check_result(run("put", input=data))


hex_ids = st.binary(min_size=0, max_size=20).map(bytes.hex)


@FAST
@given(ids=st.lists(st.one_of(odd_text, hex_ids), min_size=1, max_size=4))
def test_get_never_tracebacks(run: Cli, ids: list[str]) -> None:
    check_result(run("get", "--", *ids), json_lines=True)


filter_names = st.one_of(
    st.sampled_from(["n", "n__gt", "n__lte", "n__in", "n__nope", "name", "order", "id", "", "="]),
    odd_text,
)
filter_values = st.one_of(odd_text, json_text, big_number_text, tag_text, deep_text)


@FAST
@given(
    filters=st.lists(st.tuples(filter_names, filter_values), max_size=3),
    raw=st.lists(odd_text, max_size=1),
    cursor=st.one_of(st.none(), odd_text, st.binary(max_size=30).map(bytes.hex)),
    index=st.one_of(st.none(), st.sampled_from(["index_n", "index_nope"]), odd_text),
    partial=st.booleans(),
)
def test_query_never_tracebacks(
    run: Cli,
    filters: list[tuple[str, str]],
    raw: list[str],
    cursor: str | None,
    index: str | None,
    partial: bool,
) -> None:
    args = ["query"]
    if cursor is not None:
        args += ["--cursor", cursor]
    if index is not None:
        args += ["--index", index]
    if partial:
        args.append("--partial")
    args += ["--", *(f"{k}={v}" for k, v in filters), *raw]
    check_result(run(*args), json_lines=True)


toml_scalar = st.one_of(
    st.integers(-5, 70_000),
    st.booleans(),
    st.text(st.characters(exclude_characters="/\\:.\x00"), min_size=1, max_size=8),
    st.lists(st.text(st.characters(exclude_characters="/\\:.\x00"), max_size=5), max_size=2),
)
toml_keys = st.sampled_from(
    ["path", "shards", "buckets", "kind", "shard_key", "shard_map", "catalog", "colour"]
)
toml_docs = st.one_of(
    st.binary(max_size=80),
    st.text(any_char, max_size=60).map(lambda t: t.encode("utf-8", "surrogatepass")),
    st.dictionaries(toml_keys, toml_scalar, max_size=4).map(
        lambda d: ("[bagstore]\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in d.items())).encode(
            "utf-8", "surrogatepass"
        )
    ),
)


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string (mostly)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return str(value)


@FAST
@given(doc=toml_docs, command=st.sampled_from([["status"], ["init"], ["get", "00" * 16]]))
def test_config_files_never_traceback(tmp_path: Path, doc: bytes, command: list[str]) -> None:
    config = tmp_path / "hostile.toml"
    config.write_bytes(doc)
    result = CliRunner().invoke(cli, ["--config", str(config), *command])
    check_result(result)


@FAST
@given(name=odd_text, count=st.one_of(st.none(), odd_text, st.integers(-3, 3).map(str)))
def test_seq_next_never_tracebacks(run: Cli, name: str, count: str | None) -> None:
    args = ["seq", "next"] + (["-n", count] if count is not None else []) + ["--", name]
    result = run(*args)
    check_result(result)
    if result.exit_code == 0:
        assert all(line.isdigit() for line in result.stdout.split())


def _urls(store: Path) -> st.SearchStrategy[str]:
    """Shard URLs that never reach a server: no ':' in random text (so no host:port),
    SQLite files in the test's directory, MySQL on a closed port."""
    plain = st.text(st.characters(exclude_characters=":\x00"), max_size=30)
    return st.one_of(
        plain,
        plain.map(lambda t: f"sqlite:///{store.parent}/{t.replace('/', '_')[:20]}.db"),
        plain.map(lambda t: f"sqlite:{t}"),
        plain.map(lambda t: f"mysql://root@127.0.0.1:1/{t}?connect_timeout=1"),
        # (a bare "mysql://" means the local server's default database: a real one)
        st.sampled_from(
            ["sqlite:///", "sqlite://", "mysql://127.0.0.1:1", "sqlite:////nonexistent/x/y.db"]
        ),
    )


@FAST
@given(data=st.data())
def test_shard_add_never_tracebacks(run: Cli, data: st.DataObject) -> None:
    url = data.draw(_urls(run.store))
    check_result(run("shard", "add", "--", url))


@FAST
@given(
    name=st.one_of(odd_text, st.sampled_from(["index_a", "index_b", "bagstore_x", "id"])),
    properties=st.one_of(odd_text, st.sampled_from(["n", "a,b", "a,a", ",", "n,m,o"])),
    shard_on=st.one_of(st.none(), odd_text, st.just("n")),
    unique=st.booleans(),
)
def test_index_add_never_tracebacks(
    run: Cli, name: str, properties: str, shard_on: str | None, unique: bool
) -> None:
    args = ["index", "add", "--properties", properties]
    if shard_on is not None:
        args += ["--shard-on", shard_on]
    if unique:
        args.append("--unique")
    check_result(run(*args, "--", name))


@pytest.fixture
def posts(tmp_path: Path) -> Cli:
    store = tmp_path / "posts"
    with bagstore.open(store, kind="posts", shard_key="user", shard_map="directory") as ds:
        ds.put_many([{"user": "ann", "n": i} for i in range(3)])
    return Cli(store)


@FAST
@given(key=st.one_of(odd_text, json_text, tag_text), bucket=st.one_of(odd_text, st.just("3")))
def test_key_migrate_never_tracebacks(posts: Cli, key: str, bucket: str) -> None:
    args = ["key", "migrate", "--kind", "posts", "--shard-key", "user", "--wait", "0"]
    check_result(posts(*args, "--", key, bucket))


# -- the same through real processes ------------------------------------------------
argv_bytes = st.binary(max_size=30).filter(lambda b: b"\x00" not in b)


@FEW
@given(data=stdin_bytes, arg=st.one_of(st.none(), argv_bytes))
def test_put_in_a_real_process(run: Cli, data: bytes, arg: bytes | None) -> None:
    args: list[str | bytes] = ["put"] if arg is None else ["put", "--", arg]
    check_process(run.process(*args, input=data))


@FEW
@given(args=st.lists(argv_bytes, min_size=1, max_size=3), command=st.integers(0, 3))
def test_other_commands_in_a_real_process(run: Cli, args: list[bytes], command: int) -> None:
    words: list[str | bytes] = [["get"], ["query"], ["seq", "next"], ["index", "add"]][command]
    if command == 3:
        words = [*words, "--properties", args[-1] or b"p"]
    done = run.process(*words, "--", *args)
    check_process(done, json_lines=command < 2)


@FEW
@given(doc=toml_docs)
def test_config_file_in_a_real_process(run: Cli, tmp_path: Path, doc: bytes) -> None:
    config = tmp_path / "hostile.toml"
    config.write_bytes(doc)
    check_process(run.process("--config", str(config), "status", store=False))


@FEW
@given(args=st.lists(argv_bytes, max_size=4))
def test_random_words_in_a_real_process(run: Cli, args: list[bytes]) -> None:
    check_process(run.process(*args))


# -- the inputs of the issue --------------------------------------------------------
def test_the_three_tracebacks_of_the_issue_are_one_line_errors(run: Cli) -> None:
    deep = run.process("put", input=("[" * 100000 + "]" * 100000 + "\n").encode())
    assert deep.returncode == 2
    assert deep.stderr.decode().strip() == (
        "error: JSON nested too deeply (an entity nests at most 512 levels)"
    )
    latin = run.process("put", input=b'{"a": "\xff\xfe"}')
    assert latin.returncode == 2
    assert latin.stderr.decode().strip() == (
        "error: stdin is not UTF-8: byte 0xff at offset 7 (invalid start byte); "
        "JSON text must be UTF-8"
    )
    big = 10**5000 + 12345
    put = run.process("put", input=f'{{"n": {int_text(big)}}}'.encode())
    assert put.returncode == 0, put.stderr
    got = run.process("get", put.stdout.decode().strip())
    assert got.returncode == 0, got.stderr
    assert loads_json(got.stdout.decode())["n"] == big
    assert strict_json(got.stdout.decode())["n"] == {"$int": int_text(big)}


def int_text(value: int) -> str:
    """Decimal digits of a big int, computed without int.__str__'s limit (reference)."""
    return format(decimal.Decimal(value), "f")


def test_big_ints_round_trip_without_touching_the_digit_limit(run: Cli) -> None:
    limit = sys.get_int_max_str_digits()
    values = [10**5000, -(10**5000) - 7, 7 * 10**20000 + 1, 10**640 - 1, 10**640, -(2**64)]
    with bagstore.open(run.store) as ds:  # stored through Python, printed by the CLI
        entity_id = ds.put({"big": values})
    line = run.ok("get", entity_id.hex()).stdout
    assert sys.get_int_max_str_digits() == limit
    printed = strict_json(line)["big"]
    assert printed[3] == int("9" * 640) and printed[5] == -(2**64)  # plain numbers
    assert printed[4] == {"$int": "1" + "0" * 640}
    assert loads_json(line)["big"] == values
    again = bytes.fromhex(run.ok("put", line).stdout.strip())  # and back in
    assert again == entity_id
    with bagstore.open(run.store) as ds:
        assert ds.get(entity_id) == {"big": values, "id": entity_id}
    plain = run.ok("put", '{"big": -' + "3" * 9000 + "}").stdout.strip()  # a plain JSON int
    assert loads_json(run.ok("get", plain).stdout)["big"] == -int(decimal.Decimal("3" * 9000))
    assert sys.get_int_max_str_digits() == limit


def test_big_ints_under_the_lowest_digit_limit_python_allows(run: Cli) -> None:
    values = [10**639, -(10**640) + 1, 10**640, 10**1000 + 3]
    with bagstore.open(run.store) as ds:
        entity_id = ds.put({"v": values})
    env = {**os.environ, "PYTHONINTMAXSTRDIGITS": "640"}
    got = subprocess.run(
        [sys.executable, "-m", "bagstore", "--store", str(run.store), "get", entity_id.hex()],
        capture_output=True,
        env=env,
        check=False,
    )
    assert got.returncode == 0, got.stderr
    assert loads_json(got.stdout.decode())["v"] == values
    put = subprocess.run(
        [sys.executable, "-m", "bagstore", "--store", str(run.store), "put"],
        input=got.stdout,
        capture_output=True,
        env=env,
        check=False,
    )
    assert put.returncode == 0 and bytes.fromhex(put.stdout.decode()) == entity_id, put.stderr


def test_int_conversion_matches_decimal_arithmetic() -> None:
    rng = random.Random(20)
    for size in (1, 639, 640, 641, 1281, 5000, 40_000):
        text = str(rng.randrange(1, 10)) + "".join(rng.choices("0123456789", k=size - 1))
        reference = int(decimal.Decimal(text))  # exact, and not limited by the digit limit
        assert cli_json.int_from_digits(text) == reference
        assert cli_json.int_from_digits("-" + text) == -reference
        assert cli_json.int_to_digits(reference) == text
        assert cli_json.int_to_digits(-reference) == "-" + text
    assert cli_json.int_to_digits(0) == "0" and cli_json.int_from_digits("0000") == 0


def test_nan_and_infinity_are_printed_tagged(run: Cli) -> None:
    entity_id = run.ok("put", '{"x": NaN, "y": Infinity, "z": -Infinity, "w": [1e999]}').stdout
    line = run.ok("get", entity_id.strip()).stdout
    doc = strict_json(line)
    assert doc["x"] == {"$float": "nan"} and doc["y"] == {"$float": "inf"}
    assert doc["z"] == {"$float": "-inf"} and doc["w"] == [{"$float": "inf"}]
    back = loads_json(line)
    assert math.isnan(back["x"]) and back["y"] == math.inf and back["z"] == -math.inf
    tagged = run.ok("put", '{"x": {"$float": "nan"}, "y": {"$float": "-inf"}}').stdout.strip()
    assert strict_json(run.ok("get", tagged).stdout)["y"] == {"$float": "-inf"}


def test_status_json_is_strict_too(run: Cli) -> None:
    strict_json(run.ok("status", "--json").stdout)


@pytest.mark.parametrize(
    "stored",
    [
        {"$hex": "00"},  # a str, not bytes
        {"$int": "5"},
        {"$float": "nan"},
        {"$datetime": "2009-01-01"},
        {"$dict": {"a": 1}},
        {"$dict": {"$hex": "00"}},
        {"$int": "5", "k": 1},  # two keys: never a tag
        {"$colour": "red"},  # not a tag key
        {"$hex": b"\x00"},
    ],
)
def test_dicts_that_look_like_tags_read_back_as_stored(run: Cli, stored: dict[str, Any]) -> None:
    with bagstore.open(run.store) as ds:
        entity_id = ds.put({"v": stored, "top": [stored]})
    line = run.ok("get", entity_id.hex()).stdout
    assert loads_json(line) == {"v": stored, "top": [stored], "id": entity_id}
    assert bytes.fromhex(run.ok("put", line).stdout.strip()) == entity_id
    with bagstore.open(run.store) as ds:
        assert ds.get(entity_id) == {"v": stored, "top": [stored], "id": entity_id}


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ('{"a": {"$int": 5}}', '"$int"'),
        ('{"a": {"$int": "12a"}}', "decimal digits"),
        ('{"a": {"$float": "1.5"}}', '"nan", "inf" or "-inf"'),
        ('{"a": {"$dict": [1]}}', "a JSON object"),
        ('{"a": {"$hex": "x"}}', "hex digits"),
    ],
)
def test_bad_tags_are_errors_not_dicts(run: Cli, text: str, fragment: str) -> None:
    assert_one_error(run("put", text), fragment)
    assert json.loads(run.ok("status", "--json").stdout)["entities"] == 0


def test_a_byte_order_mark_on_stdin_is_skipped_and_a_closed_argument_is_refused(
    run: Cli,
) -> None:
    entity_id = run.ok("put", input=b'\xef\xbb\xbf{"n": 1}').stdout.strip()
    assert loads_json(run.ok("get", entity_id).stdout)["n"] == 1
    assert_one_error(run("put", '{"a": "\udcff"}'), "not UTF-8")
    done = run.process("put", b'{"a": "\xff"}')
    assert done.returncode == 2 and done.stderr.decode().startswith("error: the DATA argument")


# -- one error style ----------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "fragment", "command"),
    [
        (["get"], "missing argument", "get"),
        (["put", "--bogus"], "no such option", "put"),
        (["nope"], "no such command", ""),
        (["shard", "move", "--to", "1", "x"], "is not a valid integer", "shard move"),
        (["seq", "next", "a", "-n", "many"], "is not a valid integer", "seq next"),
        (["clean", "--duty", "-1", "--repair"], "--duty", "clean"),
        (["query", "n"], "not key=value", "query"),
        (["--config", "a.toml", "--store", "b", "status"], "not both", ""),
    ],
)
def test_usage_errors_are_our_one_line(args: list[str], fragment: str, command: str) -> None:
    result = CliRunner().invoke(cli, args, prog_name="bagstore")
    line = assert_one_error(result, fragment)
    path = f"bagstore {command}".strip()
    assert line.endswith(f"(try '{path} --help')"), line
    assert "Usage:" not in result.output


def test_a_real_process_prints_usage_errors_in_our_style(run: Cli) -> None:
    done = run.process("get", store=False)
    assert done.returncode == 2
    assert done.stderr.decode().splitlines() == [
        "error: missing argument 'IDS...' (try 'bagstore get --help')"
    ]


def test_an_unexpected_exception_is_one_line_and_exit_1(
    run: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(self: bagstore.Datastore) -> dict[str, Any]:
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(bagstore.Datastore, "status", broken)  # a bug, put there on purpose
    line = assert_one_error(run("status"), "internal error", code=1)
    assert line == (
        "error: internal error: ZeroDivisionError: a bug "
        "(a bug; rerun with BAGSTORE_DEBUG=1 for the traceback)"
    )
    monkeypatch.setenv("BAGSTORE_DEBUG", "1")
    result = run("status")
    assert isinstance(result.exception, ZeroDivisionError)  # the traceback, when asked for


def test_error_lines_stay_one_line() -> None:
    assert cli_errors._one_line("a\nb\r\u2028c\udcff") == "a\\nb\\r\\u2028c\\udcff"
    assert cli_errors.shown("x" * 200).endswith("...'") and len(cli_errors.shown("x" * 200)) == 80


def test_doctests_of_the_cli_modules() -> None:
    for module in (cli_json, cli_errors):
        failed, _ = doctest.testmod(module)
        assert failed == 0
    assert doctest.testmod(cli_json).attempted >= 6


# -- Ctrl-C -------------------------------------------------------------------------
def _interrupt_when(
    args: list[str], ready: Callable[[], bool], cwd: Path
) -> subprocess.CompletedProcess[str]:
    """Start ``python -m bagstore ARGS``, send it SIGINT once ``ready()``."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "bagstore", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        preexec_fn=servers.sigint_default,
    )
    try:
        deadline = time.monotonic() + 60
        while not ready():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the command never got going"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()  # (closes its pipes too)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _resume_command(stderr: str) -> list[str]:
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr
    prefix = "error: interrupted; resume with: "
    assert errors[0].startswith(prefix), errors[0]
    words = shlex.split(errors[0].removeprefix(prefix))
    assert words[0] == "bagstore"
    return [sys.executable, "-m", "bagstore", *words[1:]]


def test_ctrl_c_during_rebalance_exits_130_and_names_shard_resume(tmp_path: Path) -> None:
    store = tmp_path / "s"
    with bagstore.open(store, shards=1, buckets=16) as ds:
        # enough that the rebalance is far from done when the first move shows
        # (at 50 entities/s, ~20 s of moves): the SIGINT cannot come after its end
        ids = ds.put_many([{"n": i} for i in range(2000)])
        ds.add_shard(f"sqlite:///{tmp_path}/s/more.db")

    def moving() -> bool:
        with bagstore.open(store) as ds:
            return bool(bagstore.Mover(ds).unfinished())

    args = ["--store", str(store), "shard", "rebalance", "--max-rate", "50", "--batch", "5"]
    done = _interrupt_when(args, moving, tmp_path)
    assert done.returncode == 130, done.stderr
    assert "Traceback" not in done.stderr
    resume = _resume_command(done.stderr)
    assert resume[3:] == ["--store", str(store), "shard", "resume"]
    finished = subprocess.run(resume, capture_output=True, text=True, check=False, cwd=tmp_path)
    assert finished.returncode == 0, finished.stderr
    with bagstore.open(store) as ds:
        assert not bagstore.Mover(ds).unfinished()
        assert [e["n"] for e in ds.get_many(ids)] == list(range(2000))  # type: ignore[index]


def test_ctrl_c_during_a_backfill_names_the_same_command(tmp_path: Path) -> None:
    store = tmp_path / "s"
    with bagstore.open(store, shards=2) as ds:
        ds.put_many([{"link": f"l{i}"} for i in range(600)])
        ds.add_index(bagstore.Index(table="index_link", properties=["link"]))

    def started() -> bool:
        with bagstore.open(store) as ds:
            return any(b.fetchall("SELECT 1 FROM index_link LIMIT 1") for b in ds.router.backends)

    args = ["--store", str(store), "clean", "--index", "index_link", "--max-rate", "100"]
    args += ["--batch", "10"]
    done = _interrupt_when(args, started, tmp_path)
    assert done.returncode == 130, done.stderr
    assert "Traceback" not in done.stderr
    assert _resume_command(done.stderr)[3:] == args
    with bagstore.open(store) as ds:
        assert ds.indexes()["index_link"][1] == "building"
    finished = subprocess.run(
        [sys.executable, "-m", "bagstore", *args[:5], "--duty", "0"],
        capture_output=True,
        text=True,
        check=False,
        cwd=tmp_path,
    )
    assert finished.returncode == 0, finished.stderr
    with bagstore.open(store) as ds:
        assert ds.indexes()["index_link"][1] == "ready"
        assert ds.check()["missing"] == 0


def test_ctrl_c_during_key_migrate_names_the_same_command(posts: Cli, tmp_path: Path) -> None:
    def migrating() -> bool:
        with bagstore.open(
            posts.store, kind="posts", shard_key="user", shard_map="directory"
        ) as ds:
            try:
                ds.put({"user": "ann", "n": -1})
            except bagstore.KeyMigrating:
                return True
            return False

    args = ["--store", str(posts.store), "key", "migrate", "--kind", "posts"]
    args += ["--shard-key", "user", "--wait", "600", '"ann"', "9"]
    done = _interrupt_when(args, migrating, tmp_path)
    assert done.returncode == 130, done.stderr
    assert _resume_command(done.stderr)[3:] == args


def test_ctrl_c_without_resumable_work_is_one_line(tmp_path: Path) -> None:
    store = tmp_path / "s"
    with bagstore.open(store, shards=2) as ds:
        ds.add_index(bagstore.Index(table="index_link", properties=["link"]))
        ds.put_many([{"link": f"l{i}"} for i in range(20)])
        for backend in ds.router.backends:
            backend.execute("DELETE FROM index_link")

    def repaired() -> bool:  # `clean --follow` has made its first pass: it is looping
        with bagstore.open(store) as ds:
            return int(ds.check()["missing"]) == 0

    args = ["--store", str(store), "clean", "--follow", "--interval", "0.05"]
    done = _interrupt_when(args, repaired, tmp_path)
    assert done.returncode == 130, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: interrupted"], done.stderr
    assert "Traceback" not in done.stderr


# -- round trip ---------------------------------------------------------------------
zones = st.one_of(
    st.none(),
    st.just(UTC),
    st.builds(
        timezone,
        st.timedeltas(
            min_value=-timedelta(hours=23, minutes=59), max_value=timedelta(hours=23, minutes=59)
        ),
    ),
)
leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(2**300), max_value=2**300),
    st.builds(lambda n, sign: sign * (10**n + n), st.integers(600, 5200), st.sampled_from([1, -1])),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([-0.0, math.nan, math.inf, -math.inf]),
    st.text(any_char, max_size=12),
    st.binary(max_size=20),
    st.datetimes(timezones=zones),
)
entity_keys = st.one_of(tag_keys.filter(lambda k: k != "id"), st.text(any_char, max_size=6))
values = st.recursive(
    leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(entity_keys, children, max_size=4),
    ),
    max_leaves=20,
)
entities = st.dictionaries(entity_keys, values, max_size=6)


def same(a: Any, b: Any) -> bool:
    """Equal, with the same types; nan equals nan; -0.0 is not 0.0."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        if math.isnan(a):
            return math.isnan(b)
        return a == b and math.copysign(1, a) == math.copysign(1, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, datetime):
        return a == b and a.utcoffset() == b.utcoffset()
    return bool(a == b)


@FAST
@given(entity=entities, via_stdin=st.booleans())
def test_every_entity_round_trips_through_put_and_get(
    run: Cli, entity: dict[str, Any], via_stdin: bool
) -> None:
    text = dumps_entity(entity)
    strict_json(text)
    result = run("put", input=text) if via_stdin else run("put", "--", text)
    assert result.exit_code == 0, result.output
    entity_id = result.stdout.strip()
    got = run.ok("get", entity_id).stdout
    assert len(got.splitlines()) == 1
    strict_json(got)
    back = loads_json(got)
    assert same(back, {**entity, "id": bytes.fromhex(entity_id)}), (back, entity)
    with bagstore.open(run.store) as ds:
        assert same(ds.get(bytes.fromhex(entity_id)), back)
