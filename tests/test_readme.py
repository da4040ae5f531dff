"""The Python examples of the README and docs/ run as written (those that need
no server: the MariaDB ones need servers the suite starts elsewhere)."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Any

import pytest

import bagstore
from tests import servers

README = Path(__file__).resolve().parent.parent / "README.md"


def _blocks(language: str = "python") -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), re.S)


def _needs_server(block: str) -> bool:
    code = "\n".join(line.split("#", 1)[0] for line in block.splitlines())
    return "mysql" in code or "DataStore(" in code


def test_the_readme_examples_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The blocks that need no server, in order, twice: their stores are made
    with ``tempfile.mkdtemp()`` (here under ``tmp_path``), so a second run of
    the same code starts afresh and passes too."""
    blocks = [b for b in _blocks() if not _needs_server(b)]
    assert len(blocks) >= 4  # the general form, queries, online indexes, errors
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.chdir(tmp_path)  # nothing may land in the working directory either
    for _ in range(2):
        exec(compile("\n".join(blocks), str(README), "exec"), {})
    made = sorted(p.name for p in tmp_path.iterdir())
    stores = sum(b.count("tempfile.mkdtemp()") for b in blocks)  # per run
    assert len(made) == 2 * stores and all(p.startswith("tmp") for p in made), made


def test_the_readme_mariadb_examples_run(
    mysql_main: servers.MySQLAddress,
    mysql_second: servers.MariaDBServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """FriendFeed's example on two servers (the README's 3306 and 3307 are the
    suite's MariaDB and a second mariadbd; the database a name of its own, from
    BAGSTORE_MYSQL_DATABASE), then the several-databases-on-one-server block with
    its ``app_0``/``app_1`` renamed."""
    friendfeed, one_server = [b for b in _blocks() if _needs_server(b)]
    m, second = mysql_main, mysql_second
    database = servers.unique_name("readme_ff")
    names = [servers.unique_name("readme_app") for _ in range(2)]
    monkeypatch.setenv("BAGSTORE_MYSQL_DATABASE", database)
    monkeypatch.setenv("BAGSTORE_MYSQL_USER", m.user)
    monkeypatch.setenv("BAGSTORE_MYSQL_PASSWORD", m.password)
    assert '"127.0.0.1:3306", "127.0.0.1:3307"' in friendfeed
    friendfeed = friendfeed.replace("127.0.0.1:3306", f"{m.host}:{m.port}")
    friendfeed = friendfeed.replace("127.0.0.1:3307", f"{second.host}:{second.port}")
    assert one_server.count("root@127.0.0.1:3306/") == 2
    one_server = one_server.replace(
        "root@127.0.0.1:3306/", f"{m.user}:{m.password}@{m.host}:{m.port}/"
    )
    for n, name in enumerate(names):
        one_server = one_server.replace(f"/app_{n}", f"/{name}")
    namespace: dict[str, Any] = {}
    try:
        exec(compile(friendfeed, str(README), "exec"), namespace)
        assert namespace["entity"]["title"] == namespace["new_entity"]["title"]
        assert [e["id"] for e in namespace["entities"]] == [namespace["new_entity"]["id"]]
        namespace["datastore"].close()
        exec(compile(one_server, str(README), "exec"), namespace)
        ds = namespace["ds"]
        assert [s.rsplit("/", 1)[1] for s in ds.shards] == names
        assert ds.put({"n": 1}) and ds.count() == 1
        ds.close()
    finally:
        servers.drop_databases(m.host, m.port, [database, *names], m.user, m.password)
        servers.drop_databases(second.host, second.port, [database], "root", "")


def test_the_readme_toml_is_the_configuration_it_describes(tmp_path: Path) -> None:
    """The README's bagstore.toml reads as written: two shards, 1024 buckets,
    the FriendFeed index (no server is contacted to read a configuration)."""
    from bagstore.config import indexes_from_config, read_config

    (toml,) = _blocks("toml")
    path = tmp_path / "bagstore.toml"
    path.write_text(toml)
    section = read_config(path)
    assert section["shards"] == ["mysql://app@db1:3306/app_0", "mysql://app@db2:3306/app_1"]
    assert section["buckets"] == 1024
    assert [(i.table, i.properties, i.shard_on) for i in indexes_from_config(section)] == [
        ("index_user_id", ("user_id",), "user_id")
    ]


@pytest.mark.parametrize("name", ["consistency.md", "ids.md", "cleaner.md", "tables.md"])
def test_the_examples_in_docs_run(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every Python block of the page, in order, in one namespace; the
    examples' ``tempfile.mkdtemp()`` stores land under ``tmp_path``."""
    page = README.parent / "docs" / name
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
    assert blocks
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    exec(compile("\n".join(blocks), str(page), "exec"), {})
    assert any(tmp_path.iterdir())  # the examples' stores were made here


def test_the_examples_in_docs_configuration_md_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mysql_main: servers.MySQLAddress
) -> None:
    """The page's Python blocks as written, on the suite's MariaDB server and
    databases of their own (the page's ``app_0``/``app_1`` renamed), with its
    first TOML block as ``./bagstore.toml``."""
    page = README.parent / "docs" / "configuration.md"
    text = page.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    toml = re.findall(r"```toml\n(.*?)```", text, re.S)
    assert len(blocks) == 2 and toml
    names = [servers.unique_name("docs_config") for _ in range(2)]
    m = mysql_main
    code = "\n".join(blocks)
    for n, name in enumerate(names):
        code = code.replace(f"/app_{n}", f"/{name}")
    for written in ("root@127.0.0.1:3306/", "root@127.0.0.1/"):
        assert written in code
        code = code.replace(written, f"{m.user}:{m.password}@{m.host}:{m.port}/")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bagstore.toml").write_text(toml[0])
    namespace: dict[str, object] = {}
    try:
        exec(compile(code, str(page), "exec"), namespace)
        ds = namespace["ds"]
        assert isinstance(ds, bagstore.Datastore)
        assert len(ds.shards) == 2 and all(s.startswith("mysql://") for s in ds.shards)
        ds.put({"n": 1})
        assert ds.count() == 1
        ds.close()
        assert (tmp_path / "data" / "shard_0.db").exists()  # bagstore.open("data/", shards=4)
    finally:
        servers.drop_databases(m.host, m.port, names, m.user, m.password)


def test_the_readme_command_line_example_runs(tmp_path: Path) -> None:
    """The README's first shell block, then "More of the command line" on the same
    store, as written, in bash (``set -e``): the store and the demo's land in
    ``mktemp -d`` directories, here under ``tmp_path``."""
    import json
    import os
    import subprocess
    import sys

    first = next(b for b in _blocks("sh") if b.startswith("export BAGSTORE_STORE="))
    more = next(b for b in _blocks("sh") if b.startswith("bagstore index add index_title"))
    block = first + more
    env = {
        **os.environ,
        "TMPDIR": str(tmp_path),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    env.pop("BAGSTORE_STORE", None)
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    found = [json.loads(line) for line in lines if line.startswith('{"user_id"')]
    assert len(found) == 3 and {e["title"] for e in found} == {"hi"}  # get, query, query --all
    assert '{"cursor": null}' in lines
    assert "consistent: 0 missing, 0 stale index rows" in lines
    assert "wrote 3 rows, removed 0, read 3 entities" in done.stdout  # the backfill
    assert [line for line in lines if line.isdigit()] == ["1", "2", "3", "4", "5"]  # seq next
    assert len(list(tmp_path.iterdir())) == 2  # the store and the demo's directory
