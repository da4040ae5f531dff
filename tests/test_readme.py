"""The Python examples of the README and docs/ run as written (those that need
no server: the MariaDB ones need servers the suite starts elsewhere)."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest

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
