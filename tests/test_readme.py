"""The Python examples of the README and docs/ run as written (those that need
no server: the MariaDB ones need servers the suite starts elsewhere)."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest

import bagstore
from tests import servers

README = Path(__file__).resolve().parent.parent / "README.md"


def _blocks() -> list[str]:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    # the FriendFeed example and the MariaDB one need servers the suite starts elsewhere
    return [b for b in blocks if not any(_needs_server(line) for line in b.splitlines())]


def _needs_server(line: str) -> bool:
    code = line.split("#", 1)[0]
    return "mysql" in code or "DataStore(" in code


def test_the_readme_examples_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = _blocks()
    assert len(blocks) >= 4  # the general form, queries, online indexes, errors
    monkeypatch.chdir(tmp_path)  # bagstore.open("data/") writes here
    namespace: dict[str, object] = {}
    exec(compile("\n".join(blocks), str(README), "exec"), namespace)
    assert (tmp_path / "data").is_dir()


@pytest.mark.parametrize("name", ["consistency.md", "ids.md", "cleaner.md"])
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
