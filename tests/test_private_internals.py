"""No module reaches into a dependency's private names, except its one ``*_compat`` module.

Private names of redis, json, opentelemetry and faststream change without notice between their
releases; where no public API exists the access lives in ``faststream/_compat.py`` or
``stores/redis_compat.py``, each reader saying what it stands in for. Here every other module
is read: an attribute, ``getattr``/``hasattr`` string or import of a private name (``_x``, not
a dunder) that consumer_idem does not define itself, and that one of these dependencies
defines, fails.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "consumer_idem"
DEPENDENCIES = ("redis", "json", "opentelemetry", "faststream")
#: public-looking names that are a dependency's internals all the same
UNDOCUMENTED = {"c_make_encoder", "call_wrapped", "is_suitable", "consumer_subgroup"}


def _dependency_private_names() -> set[str]:
    """Every private identifier in the installed sources of :data:`DEPENDENCIES`."""
    names: set[str] = set()
    for dep in DEPENDENCIES:
        spec = importlib.util.find_spec(dep)
        assert spec is not None and spec.submodule_search_locations, dep
        for location in spec.submodule_search_locations:
            for source in Path(location).rglob("*.py"):
                names.update(re.findall(r"\b_[A-Za-z]\w*", source.read_text(errors="ignore")))
    return {name for name in names if _private(name)}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _compat(path: Path) -> bool:
    return path.stem.endswith("_compat")


def _trees() -> dict[Path, ast.Module]:
    return {p: ast.parse(p.read_text(), str(p)) for p in sorted(PACKAGE.rglob("*.py"))}


def _own_names(trees: dict[Path, ast.Module]) -> set[str]:
    """Every name consumer_idem defines: functions, classes, assignments, attributes it sets,
    parameters, keyword arguments it passes."""
    names: set[str] = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.alias):
                names.add((node.asname or node.name).split(".")[0])
            elif isinstance(node, ast.Call) and _attr_call(node) == "setattr":
                names.update(_string_args(node))
    return names


def _attr_call(node: ast.Call) -> str | None:
    return node.func.id if isinstance(node.func, ast.Name) else None


def _string_args(node: ast.Call) -> list[str]:
    return [
        a.value for a in node.args[1:2] if isinstance(a, ast.Constant) and isinstance(a.value, str)
    ]


def _uses(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, name) of each private or undocumented name this module reads."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            found.append((node.lineno, node.attr))
        elif isinstance(node, ast.Call) and _attr_call(node) in ("getattr", "hasattr"):
            found.extend((node.lineno, name) for name in _string_args(node))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in DEPENDENCIES:
            parts = (node.module or "").split(".") + [a.name for a in node.names]
            found.extend((node.lineno, p) for p in parts if _private(p))
    return [(line, name) for line, name in found if _private(name) or name in UNDOCUMENTED]


def test_no_module_outside_the_compat_modules_reads_a_dependency_private_name() -> None:
    trees = _trees()
    own = _own_names(trees) - UNDOCUMENTED
    theirs = _dependency_private_names() | UNDOCUMENTED
    offences = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {name}"
        for path, tree in trees.items()
        if not _compat(path)
        for line, name in _uses(tree)
        if name not in own and name in theirs
    ]
    assert offences == [], "private names of a dependency outside its _compat module"


def test_the_compat_modules_say_which_versions_they_were_checked_with() -> None:
    for path in (PACKAGE / "faststream" / "_compat.py", PACKAGE / "stores" / "redis_compat.py"):
        text = path.read_text()
        assert "0.7.8" in text or "redis-py 8.1" in text, path
