"""No function of the package is dead: every function and method it defines is named somewhere in the
package, its tests or its benchmarks (a call, a reference, a re-export). Read off the syntax trees, so a
function removed from its last caller shows up here, with where it is defined."""

from __future__ import annotations

import ast
from pathlib import Path

import mpipe_tune

PACKAGE = Path(mpipe_tune.__file__).parent
USERS = (PACKAGE, PACKAGE.parent / "tests", PACKAGE.parent / "benchmarks")
"""Where a function's name may be used."""


def names_used(tree: ast.AST) -> set[str]:
    """Every name a module reads: variables, attributes, imported names, and names given as strings
    (``getattr(module, "name")``, ``__all__``)."""
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            used.add(node.id)
        elif isinstance(node, ast.Attribute):
            used.add(node.attr)
        elif isinstance(node, ast.ImportFrom):
            used.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
            used.add(node.value)
    return used


def test_every_function_of_the_package_is_used():
    defined: dict[str, list[str]] = {}
    used: set[str] = set()
    for root in USERS:
        for path in sorted(root.rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            used |= names_used(tree)
            if root == PACKAGE:
                for node in ast.walk(tree):
                    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("__"):
                        defined.setdefault(node.name, []).append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert len(defined) > 500  # the walk saw the package
    dead = sorted(f"{name} ({', '.join(where)})" for name, where in defined.items() if name not in used)
    assert not dead, f"functions nothing names: {dead}"
