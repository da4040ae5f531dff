"""The package's layers, read from its source (ast): nothing below the facade
reaches into ``Datastore``'s private attributes or imports ``bagstore.datastore``
at run time.

Below the facade, modules get what they need from the router
(``ds.router``, :mod:`bagstore.sharding.router`) or from the facade's public
attributes; only the modules above it (the command line, the configuration
loader and the package's ``__init__``) import it when they run.  A type-only
import (under ``if TYPE_CHECKING:``) is allowed.
"""

from __future__ import annotations

import ast
from pathlib import Path

import bagstore

PACKAGE = Path(bagstore.__file__).parent

#: Modules above the facade: they may import it at run time (typed tables are
#: a layer over a datastore: they use its public methods only).
ABOVE = {"__init__.py", "__main__.py", "config.py", "datastore.py", "tables.py"}

#: Names that hold the facade in the package's modules (besides parameters
#: annotated ``Datastore``).
FACADE_NAMES = {"ds", "datastore"}


def _above(relative: str) -> bool:
    return relative in ABOVE or (relative.startswith("cli") and "/" not in relative)


def _facade_names(tree: ast.AST) -> set[str]:
    """Parameter and variable names annotated with ``Datastore``."""
    names = set(FACADE_NAMES)
    for node in ast.walk(tree):
        annotation, name = None, None
        if isinstance(node, ast.arg):
            annotation, name = node.annotation, node.arg
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            annotation, name = node.annotation, node.target.id
        if annotation is not None and name is not None and "Datastore" in ast.unparse(annotation):
            names.add(name)
    return names


def _is_facade(node: ast.expr, names: set[str]) -> bool:
    """``ds``, ``datastore``, a name annotated ``Datastore``, or ``self.ds``."""
    if isinstance(node, ast.Name):
        return node.id in names
    return (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
        and node.attr in FACADE_NAMES
    )


def reach_ins(source: str) -> list[str]:
    """``name._private`` uses of the facade in ``source`` (``line: expression``)."""
    tree = ast.parse(source)
    names = _facade_names(tree)
    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and _is_facade(node.value, names)
        ):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def _type_checking_blocks(tree: ast.AST) -> set[int]:
    """ids of the statements under ``if TYPE_CHECKING:``."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                inside.update(id(n) for n in ast.walk(child))
    return inside


def runtime_facade_imports(source: str) -> list[str]:
    """Imports of ``bagstore.datastore`` in ``source`` that run (not type-only)."""
    tree = ast.parse(source)
    typing_only = _type_checking_blocks(tree)
    found = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            hit = any(a.name == "bagstore.datastore" for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            hit = node.module == "bagstore.datastore" or (
                node.module == "bagstore" and any(a.name == "datastore" for a in node.names)
            )
        else:
            continue
        if hit:
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def _modules() -> list[tuple[str, str]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        out.append((relative, path.read_text(encoding="utf-8")))
    return out


def test_the_checks_find_what_they_look_for() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from bagstore.datastore import Datastore\n"
        "def f(store: Datastore, ds):\n"
        "    from bagstore.datastore import open\n"
        "    return store._backends, ds._route, ds.router, ds.__class__\n"
        "class C:\n"
        "    def g(self):\n"
        "        return self.ds._fenced\n"
    )
    assert reach_ins(source) == ["6: store._backends", "6: ds._route", "9: self.ds._fenced"]
    assert runtime_facade_imports(source) == ["5: from bagstore.datastore import open"]


def test_no_module_reaches_into_the_facade() -> None:
    found = {
        relative: hits
        for relative, source in _modules()
        if relative != "datastore.py" and (hits := reach_ins(source))
    }
    assert found == {}, f"use ds.router or a public attribute instead: {found}"


def test_only_modules_above_the_facade_import_it_at_run_time() -> None:
    found = {
        relative: hits
        for relative, source in _modules()
        if not _above(relative) and (hits := runtime_facade_imports(source))
    }
    assert found == {}, f"import bagstore.datastore only under TYPE_CHECKING: {found}"
    assert any(_above(r) and runtime_facade_imports(s) for r, s in _modules())  # it looks
