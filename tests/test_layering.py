"""The package's layering (DESIGN.md section 3, STYLE.md principle 6), read off every module's imports.

Each module's imports, top-level and inside functions, are collected from its syntax tree, so a
lazy import that crosses a layer counts as much as one at the top of the file.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest

import mpipe_tune

PACKAGE = Path(mpipe_tune.__file__).parent

FORBIDDEN = {
    # layer (a sub-package or a module): what it must never import; report reads plan files and the search's
    # records, never the search's modules; inputs (the specs loaders too) read no cost module: a hardware profile
    # is the cost model's, loaded by whoever composes inputs and cost (the command line, plan_file's resolve)
    "algebra": ("cost", "search", "report", "runtime", "profiler", "cli", "specs", "plan_file"),
    "inputs": ("algebra", "cost", "search", "report", "runtime", "profiler", "cli", "specs"),
    "specs": ("cost", "search", "report", "runtime", "profiler", "cli", "plan_file"),
    "errors": ("algebra", "inputs", "cost", "search", "report", "runtime", "profiler", "cli"),
    "outputs": ("algebra", "inputs", "cost", "search", "report", "runtime", "profiler", "cli", "plan_file", "specs"),
    "cost": ("search", "report", "runtime", "profiler", "cli", "plan_file"),
    "plan_file": ("search", "report", "runtime", "profiler", "cli"),
    "search": ("report", "runtime", "profiler", "cli"),
    "runtime": ("report", "search", "cli"),
    "report": ("search", "cli"),
}
"""``report`` and ``cli`` may import everything; ``specs`` (the loaders of named models and workloads) reads
the algebra's model, so it sits above the algebra and below cost."""
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


PACKAGES = ("algebra", "cost", "search", "inputs", "plan_file", "report", "runtime", "profiler", "cli", "outputs")
"""The sub-packages, each of which names its public API in its ``__init__``'s ``__all__``."""


def lazy_table(package: str) -> dict[str, str]:
    """Name -> the module that defines it, for the names ``mpipe_tune.<package>`` loads when first asked
    for (its ``_LAZY``, :func:`mpipe_tune.lazy_exports`); empty for a package that imports its API."""
    module = importlib.import_module(f"mpipe_tune.{package}")
    return {name: source for source, names in getattr(module, "_LAZY", {}).items() for name in names}


def imports(path: Path, name: str) -> set[str]:
    """Every module ``path`` imports, as absolute dotted names (relative imports resolved); a name taken
    from a package that loads it lazily counts as an import of the module that defines it."""
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
            parts = base.split(".")
            if len(parts) == 2 and parts[0] == "mpipe_tune" and parts[1] in PACKAGES:
                lazy = lazy_table(parts[1])
                found.update(lazy[alias.name] for alias in node.names if alias.name in lazy)
    return found


LOADERS = ("inputs._specs", "inputs._workload_spec")
"""Modules of ``inputs`` that load named inputs with the algebra (a model is the algebra's, a dataset
workload is sized by its model): the ``specs`` layer."""


def layer_of(name: str) -> str:
    """``algebra`` for ``algebra._derive``; a top-level module is its own layer; :data:`LOADERS` are the
    ``specs`` layer."""
    if any(name == m or name.startswith(m + ".") for m in LOADERS):
        return "specs"
    return name.split(".")[0]


def test_the_walk_sees_the_package_and_resolves_imports():
    names = dict(modules())
    assert {"algebra._derive", "runtime._plan_view", "plan_file._resolve", "cli", "cli._plan"} <= set(names)
    assert "mpipe_tune.algebra._plan" in imports(names["algebra._derive"], "algebra._derive")


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


def package_imports(package: str) -> list[tuple[str, str]]:
    """(module, what it imports) for every import of the package's modules of any other module of ours."""
    return [(name, module) for name, path in modules() if name.split(".")[0] == package
            for module in sorted(imports(path, name)) if module.startswith("mpipe_tune.")]


@pytest.mark.parametrize("package,below", [("inputs", "cost"), ("report", "search")])
def test_a_package_imports_nothing_from_a_package_it_must_not_read(package, below):
    """inputs (its loaders included) read no cost module: profiles are loaded by the cost package, and by
    the command line that composes inputs and cost. report reads plan files and the search's records, never
    the search's modules."""
    crossing = [f"mpipe_tune.{name} imports {module}" for name, module in package_imports(package)
                if module == f"mpipe_tune.{below}" or module.startswith(f"mpipe_tune.{below}.")]
    assert not crossing, crossing


def test_the_plan_file_reads_from_cost_only_its_profile_loader():
    """resolve checks a plan's profile against the file's hash: the one name of cost it imports."""
    from_cost = {module for _, module in package_imports("plan_file")
                 if module == "mpipe_tune.cost" or module.startswith("mpipe_tune.cost.")}
    assert from_cost <= {"mpipe_tune.cost", "mpipe_tune.cost.load_profile"}, sorted(from_cost)


def test_the_runtime_reads_plans_only_through_the_plan_file_package():
    """No runtime module opens plan.json itself (json, the data-file loader) or reaches into the plan
    file's modules: it imports :mod:`mpipe_tune.plan_file`'s public names (``resolve`` and its records)."""
    for name, path in modules():
        if layer_of(name) != "runtime":
            continue
        found = imports(path, name)
        inner = sorted(m for m in found if m.startswith("mpipe_tune.plan_file."))
        allowed = {f"mpipe_tune.plan_file.{n}" for n in dir(__import__("mpipe_tune.plan_file").plan_file)}
        assert set(inner) <= allowed, f"mpipe_tune.{name} reaches into {sorted(set(inner) - allowed)}"
        assert "mpipe_tune.inputs.load_data_file" not in found, f"mpipe_tune.{name} reads a plan file by hand"


def test_no_plan_file_record_has_a_dict_field():
    """Every record of the plan file's schema, walked from :class:`PlanFile` through its fields'
    types, is a frozen dataclass whose fields hold no ``dict`` (a file is read into types, never kept
    as a mapping)."""
    import dataclasses
    import typing
    from collections.abc import Mapping

    from mpipe_tune.plan_file import PlanFile

    seen, todo, found = set(), [PlanFile], []
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        assert cls.__dataclass_params__.frozen, f"{cls.__name__} is not frozen"
        for f in dataclasses.fields(cls):
            stack = [typing.get_type_hints(cls)[f.name]]
            while stack:
                kind = stack.pop()
                origin = typing.get_origin(kind)
                if kind in (dict, Mapping) or origin in (dict, Mapping):
                    found.append(f"{cls.__name__}.{f.name}")
                stack.extend(a for a in typing.get_args(kind) if a is not Ellipsis)
                if dataclasses.is_dataclass(kind):
                    todo.append(kind)
                assert kind is not typing.Any, f"{cls.__name__}.{f.name} is untyped"
    assert not found, f"plan-file records with dict fields: {found}"
    assert len(seen) >= 15  # the walk reached the nested records (sections, predictions, the search summary)


def test_the_cli_package_is_the_only_face():
    """Nothing in the package imports the command line; the command line is one package (no ``cli_*``
    modules beside it), with ``python -m mpipe_tune.cli`` and the console script as its entries."""
    for name, path in modules():
        if layer_of(name) != "cli" and name:
            assert not any(m == "mpipe_tune.cli" or m.startswith("mpipe_tune.cli.") for m in imports(path, name)), name
    assert not [n for n, _ in modules() if n.startswith("cli_") or n == "command"]
    assert (PACKAGE / "cli" / "__main__.py").exists()
    assert 'mpipe-tune = "mpipe_tune.cli:main"' in (PACKAGE.parent / "pyproject.toml").read_text()


def import_graph() -> dict[str, set[str]]:
    """Per module of the package, the modules of the package it imports (top-level or inside a
    function): ``from mpipe_tune.algebra import encoder_backward`` is an import of the module
    ``algebra._encoder_backward``; a package's ``__init__`` counts as a module, but a module's import of a
    package it lies in does not (Python runs that package first, whatever the module imports)."""
    names = dict(modules())
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        targets = set()
        for imported in imports(path, name):
            parts = imported.split(".")
            if parts[0] != "mpipe_tune":
                continue
            parts = parts[1:]
            while parts and ".".join(parts) not in names:  # a name imported from a module: that module
                parts.pop()
            target = ".".join(parts)
            if target and target != name and not name.startswith(target + "."):
                targets.add(target)
        graph[name] = targets
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_import_cycles_are_found():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []
    graph = import_graph()
    assert "algebra._plan" in graph["algebra._derive"] and "algebra" not in graph["algebra._derive"]


def test_no_import_cycles():
    """No two modules import each other, directly or through others, lazily or not: every module can
    be read, and imported, after the modules it needs (a reader or writer picked inside a function
    that imports its caller's types back is a cycle too: the shared types go below both)."""
    assert import_cycles(import_graph()) == []


LOOSE_MODULES = {"errors", "interrupt", "jit"}
"""The modules at the package's top level beside its sub-packages: each is below every layer (the user
errors, Ctrl-C, compiling the kernels). Anything else belongs to the sub-package of its layer."""


def test_no_loose_top_level_modules_but_the_named_ones():
    loose = {name for name, path in modules() if name and "." not in name and path.name != "__init__.py"}
    assert loose == LOOSE_MODULES, f"top-level modules outside a sub-package: {sorted(loose - LOOSE_MODULES)}"


def test_nothing_imports_upward():
    """The layers in order, lowest first: a module imports only from its own layer and those below
    (``report`` and ``cli`` sit on top and may import everything; ``profiler`` and ``runtime`` beside
    each other above ``search``'s inputs)."""
    order = ["errors", "interrupt", "jit", "outputs", "inputs", "algebra", "specs", "cost",
             "plan_file", "search", "runtime", "profiler", "report", "cli"]
    rank = {layer: i for i, layer in enumerate(order)}
    upward = []
    for name, targets in import_graph().items():
        if not name:
            continue
        here = layer_of(name)
        for target in targets:
            there = layer_of(target)
            if here in rank and there in rank and rank[there] > rank[here]:
                upward.append(f"{name} ({here}) -> {target} ({there})")
    assert not upward, upward


def test_a_regular_install_ships_every_package_of_the_tree():
    """`pip install .` (the quick start's, not editable) copies only the packages pyproject.toml lists: each
    folder of the package with an __init__.py must be listed, or the installed command fails to import it."""
    tomllib = pytest.importorskip("tomllib")
    listed = set(tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {".".join(("mpipe_tune", *p.parent.relative_to(PACKAGE).parts)) for p in PACKAGE.rglob("__init__.py")}
    assert on_disk <= listed, sorted(on_disk - listed)


def test_the_planner_imports_and_plans_with_torch_blocked(tmp_path):
    """torch is needed only by runtime and profiler: with it blocked, every planner module imports and
    ``predict`` runs (a fresh interpreter, so no module imported here counts)."""
    import subprocess
    import sys

    code = (
        "import sys, pkgutil, importlib, mpipe_tune\n"
        "sys.modules['torch'] = None\n"
        "for m in pkgutil.walk_packages(mpipe_tune.__path__, 'mpipe_tune.'):\n"
        "    if m.name.split('.')[1] in ('algebra', 'cost', 'search', 'inputs', 'plan_file'):\n"
        "        importlib.import_module(m.name)\n"
        "from mpipe_tune.cli import main\n"
        "sys.exit(main(['predict', '--schedule', 'transpose,1f1b']))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert done.returncode == 0 and "torch" not in done.stderr, done.stderr


def defines(module: str, name: str) -> bool:
    """Whether ``module``'s source binds ``name`` at its top level (a def, a class, an assignment or an
    import), read without importing it (a runtime module would import torch)."""
    path = Path(importlib.util.find_spec(module).origin)
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        targets = (node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign)
                   else [])
        for target in targets:
            if name in {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}:
                return True
        if isinstance(node, (ast.Import, ast.ImportFrom)) and name in {a.asname or a.name for a in node.names}:
            return True
    return False


@pytest.mark.parametrize("package", PACKAGES)
def test_every_name_a_package_exports_exists(package):
    """Each name of a package's ``__all__`` is there: bound by its ``__init__``, or defined by the module
    its lazy table names (read, not imported); a lazy name is no module's name in the package (the module,
    once imported, would shadow it)."""
    module = importlib.import_module(f"mpipe_tune.{package}")
    exported = list(module.__all__)
    assert len(exported) == len(set(exported)), sorted(n for n in exported if exported.count(n) > 1)
    lazy = lazy_table(package)
    missing = [n for n in exported if (not defines(lazy[n], n) if n in lazy else not hasattr(module, n))]
    assert not missing, f"mpipe_tune.{package}.__all__ names what is not there: {missing}"
    folder = PACKAGE / package
    shadowed = [n for n in lazy if (folder / f"{n}.py").exists() or (folder / n / "__init__.py").exists()]
    assert not shadowed, f"mpipe_tune.{package} loads lazily names its modules have: {shadowed}"


def test_no_module_imports_a_name_a_package_does_not_export():
    """A module of one package imports from another package (from its ``__init__`` or from one of its
    modules) only the names that package's ``__all__`` lists: the API other packages use is the API the
    package names. (Tests and benchmarks may reach into a package's modules.)"""
    public = {package: set(importlib.import_module(f"mpipe_tune.{package}").__all__) for package in PACKAGES}
    unlisted = []
    for name, path in modules():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom) or node.level or not (node.module or "").startswith("mpipe_tune."):
                continue
            package = node.module.split(".")[1]
            if package in public and name.split(".")[0] != package:
                unlisted += [f"mpipe_tune.{name} imports {node.module}.{a.name}" for a in node.names
                             if a.name not in public[package]]
    assert not unlisted, unlisted
