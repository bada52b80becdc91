"""The package's layering (DESIGN.md section 3, STYLE.md principle 6), read off every module's imports.

Each module's imports, top-level and inside functions, are collected from its syntax tree, so a
lazy import that crosses a layer counts as much as one at the top of the file.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import mpipe_tune

PACKAGE = Path(mpipe_tune.__file__).parent

FORBIDDEN = {
    # layer (a sub-package or a module): what it must never import
    "algebra": ("cost", "search", "report", "runtime", "profiler", "cli", "specs", "plan_file", "plan_check"),
    "inputs": ("algebra", "cost", "search", "report", "runtime", "profiler", "cli", "specs"),
    "errors": ("algebra", "inputs", "cost", "search", "report", "runtime", "profiler", "cli"),
    "files": ("algebra", "inputs", "cost", "search", "report", "runtime", "profiler", "cli"),
    "cost": ("search", "report", "runtime", "profiler", "cli", "plan_file", "plan_check"),
    "plan_file": ("cost", "search", "report", "runtime", "profiler", "cli"),
    "plan_check": ("cost", "search", "report", "runtime", "profiler", "cli"),
    "search": ("report", "runtime", "profiler", "cli"),
    "runtime": ("report", "search", "cli"),
}
"""``report`` and ``cli`` may import everything; ``specs`` (the loaders of named inputs) reads cost's
profiles, so the plan file's model loader reaches cost only through it, never the other way."""
THIRD_PARTY = {"torch": ("runtime", "profiler"), "torch_npu": ("runtime", "profiler"), "optuna": ("search",)}
"""Heavy dependencies and the only layers that may import them."""


def modules() -> list[tuple[str, Path]]:
    """(dotted name inside the package, path) of every module of the package."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out.append((".".join(parts), path))
    return out


def imports(path: Path, name: str) -> set[str]:
    """Every module ``path`` imports, as absolute dotted names (relative imports resolved)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = ["mpipe_tune", *name.split(".")] if path.name == "__init__.py" else ["mpipe_tune", *name.split(".")[:-1]]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def layer_of(name: str) -> str:
    """``algebra`` for ``algebra.derive``; a top-level module is its own layer (``cli_plan`` is ``cli``)."""
    top = name.split(".")[0]
    return "cli" if top.startswith("cli") else top


def test_the_walk_sees_the_package_and_resolves_imports():
    names = dict(modules())
    assert {"algebra.derive", "runtime.plan_view", "plan_file", "cli"} <= set(names)
    assert "mpipe_tune.algebra.plan" in imports(names["algebra.derive"], "algebra.derive")


@pytest.mark.parametrize("name,path", modules(), ids=[n or "mpipe_tune" for n, _ in modules()])
def test_no_module_imports_across_its_layer(name, path):
    if not name:
        return
    layer = layer_of(name)
    found = imports(path, name)
    crossing = sorted(
        module for module in found
        if module.startswith("mpipe_tune.") and layer_of(module.split(".", 1)[1]) in FORBIDDEN.get(layer, ())
    )
    heavy = sorted(module for module in found if module.split(".")[0] in THIRD_PARTY
                   and layer not in THIRD_PARTY[module.split(".")[0]])
    assert not crossing, f"mpipe_tune.{name} ({layer}) imports {crossing}"
    assert not heavy, f"mpipe_tune.{name} ({layer}) imports {heavy}"
