"""The minimum versions pyproject.toml names are the ones CI installs to test
them (.ci/minimums.txt), and the README's set-up commands are the ones CI runs."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _named_minimums() -> dict[str, str]:
    """Every ``name>=version`` of pyproject's dependencies and extras, except
    the project's own extras and optional drivers that CI does not install."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = list(project["dependencies"])
    for extra in ("test",):
        wanted += project["optional-dependencies"][extra]
    found: dict[str, str] = {}
    for requirement in wanted:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?>=([0-9][0-9a-z.]*)", requirement)
        assert match, f"pyproject requirement without a plain minimum: {requirement!r}"
        name, version = _canonical(match[1]), match[2]
        assert found.get(name, version) == version, f"two minimums for {name}"
        found[name] = version
    return found


def _pinned() -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in (ROOT / ".ci" / "minimums.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[_canonical(name)] = version
    return pins


def _same_version(a: str, b: str) -> bool:
    def parts(v: str) -> list[int]:
        numbers = [int(p) for p in v.split(".")]
        while numbers and numbers[-1] == 0:
            numbers.pop()
        return numbers

    return parts(a) == parts(b)


def test_the_minimums_file_pins_exactly_what_pyproject_names() -> None:
    named, pinned = _named_minimums(), _pinned()
    assert set(named) == set(pinned)
    wrong = {n: (named[n], pinned[n]) for n in named if not _same_version(named[n], pinned[n])}
    assert not wrong, f"pyproject minimum vs .ci/minimums.txt: {wrong}"


def test_ci_runs_the_readme_test_command_in_fresh_venvs() -> None:
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"```sh\n(python3 -m venv .*?)\n```", readme)
    assert len(commands) == 2, commands
    assert commands[1].endswith("python -m pip install -e '.[test]' && python -m pytest")
    ci = (ROOT / ".ci" / "run").read_text()
    assert "fresh_venv .ci-venv\n" in ci and "fresh_venv .ci-venv-min\n" in ci
    assert '"$py" -m pytest' in ci
    assert "-c .ci/minimums.txt" in ci
