"""The import rules, in one place: the project's modules import one another without a circle,
the pure core names nothing outside itself, what the core, the controller and the layers
below the config load when they run leaves out Ray, torch and the layers above, and every
name imported from the project is there.

The graph is read from the source with ``ast``, importing nothing, so it runs in milliseconds.
Every import counts: at the top of a module, inside a function, and under ``if
TYPE_CHECKING:``, because a circle that only shows up when a function runs, or only to the type
checker, still ties two modules together for whoever reads them. A package's own ``__init__`` counts only for what it
imports itself; ``elastic/__init__.py`` names its public modules in strings, loaded on first
use, and a string is not an import.
"""

import ast
import json
import subprocess
import sys
from pathlib import Path

from tests.python_source import parse

ROOT = Path(__file__).parents[1]
PACKAGES = ("elastic", "workers", "checkpointing")


def project_modules() -> dict[str, Path]:
    """Every module of the project, by its dotted name (a package by its own name)."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def imported_names(module: str, path: Path) -> set[str]:
    """The dotted names ``module`` imports anywhere in its source, relative imports resolved;
    for ``from x import y`` both ``x`` and ``x.y`` (which is kept only if ``y`` is a module)."""
    is_package = path.name == "__init__.py"
    package = module if is_package else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            names.add(source)
            names.update(f"{source}.{alias.name}" for alias in node.names)
    return names


def import_graph() -> dict[str, set[str]]:
    """Module to the project modules it imports. ``import a.b.c`` also runs the inits of ``a``
    and ``a.b``; the edge goes to the module named, and what an init imports itself is the
    init's own edges."""
    modules = project_modules()
    graph = {}
    for module, path in modules.items():
        targets = {name for name in imported_names(module, path) if name in modules}
        targets.discard(module)
        graph[module] = targets
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as the list of modules around it (first repeated last), or None."""
    on_path: list[str] = []
    state: dict[str, str] = {}  # "open" while on the current path, "done" once fully explored

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        on_path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                return on_path[on_path.index(target):] + [target]
            if target not in state:
                cycle = visit(target)
                if cycle:
                    return cycle
        on_path.pop()
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state:
            cycle = visit(module)
            if cycle:
                return cycle
    return None


def test_the_graph_sees_the_imports_of_every_kind():
    graph = import_graph()
    assert "elastic.setup.config" in graph["elastic.setup.preflight"]  # at the top of a module
    assert "elastic.trainer" in graph["elastic.cli"]  # inside a function
    assert "elastic.setup.config" in graph["elastic.setup.dataset"]  # under TYPE_CHECKING
    assert "workers.rng" in graph["workers.worker"]  # a module imported from its package
    assert "elastic.setup.config" not in graph["elastic"]  # lazy names in strings are not imports


def test_no_module_imports_itself_back_through_others():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_pure_core_imports_only_the_core_even_for_types():
    # what it names at all; test_every_core_module_imports_neither_ray_nor_torch_nor_the_layers_above,
    # what it loads when it runs
    graph = import_graph()
    outside = {module: sorted(target for target in targets if not target.startswith("elastic.core"))
               for module, targets in graph.items() if module.startswith("elastic.core")}
    assert {module: targets for module, targets in outside.items() if targets} == {}


CORE = sorted(path.stem for path in (Path(__file__).parents[1] / "elastic" / "core").glob("*.py")
              if path.stem != "__init__")
HEAVY = ("ray", "torch", "fsspec", "pydantic", "prometheus_client")


def imported_after(modules: list[str], watched: tuple[str, ...]) -> list[str]:
    """Which of ``watched`` a fresh interpreter has loaded after importing ``modules``."""
    imports = "; ".join(f"import {module}" for module in modules)
    code = f"import json, sys; {imports}; print(json.dumps(sorted(m for m in {watched!r} if m in sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            cwd=Path(__file__).parents[1])
    return json.loads(result.stdout)


def test_every_core_module_imports_neither_ray_nor_torch_nor_the_layers_above():
    assert {"protocol", "data_plan", "faults", "topology"} <= set(CORE)
    assert imported_after([f"elastic.core.{module}" for module in CORE], HEAVY + ("workers", "checkpointing")) == []


def test_the_controller_and_the_fake_fleet_import_neither_ray_nor_torch():
    assert imported_after(["elastic.driver.controller", "tests.fake_fleet"], ("ray", "torch")) == []


def test_the_layers_below_the_config_do_not_import_it():
    # config imports presets and errors; dataset reads a config but names it only as a type
    data = [f"elastic.data.{path.stem}" for path in (ROOT / "elastic" / "data").glob("[!_]*.py")]
    below = ["elastic.setup.dataset", "elastic.setup.presets", "elastic.setup.errors", *data]
    assert imported_after(below, ("elastic.setup.config",)) == []


def test_the_ranks_run_only_the_core_and_the_data_of_the_driver_package():
    graph = import_graph()
    ranks_side = [module for module in graph if module.split(".")[0] in ("workers", "checkpointing")]
    reached = {target for module in ranks_side for target in graph[module]
               if target.startswith("elastic.") and not target.startswith(("elastic.core", "elastic.data"))}
    assert reached == set(), f"the ranks' side imports {sorted(reached)}"


def test_every_name_imported_from_the_project_is_there():
    """Each ``from <project module> import <name>`` anywhere in the tree, those inside functions
    too (a benchmark's, a test's), names something its module has: a moved function breaks
    here, not in the first run that reaches the import."""
    import importlib.util

    missing = []
    for root in (*PACKAGES, "tests", "bench", "examples"):
        for path in sorted((ROOT / root).rglob("*.py")):
            for node in ast.walk(parse(path.read_text(), str(path))):
                if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                        and node.module.split(".")[0] in (*PACKAGES, "tests")):
                    continue
                module = importlib.import_module(node.module)
                missing += [f"{path.relative_to(ROOT)}: {node.module}.{alias.name}" for alias in node.names
                            if not hasattr(module, alias.name)
                            and importlib.util.find_spec(f"{node.module}.{alias.name}") is None]
    assert missing == []
