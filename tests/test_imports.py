"""The project's modules import one another without a circle.

Read from the source with ``ast``, importing nothing, so it runs in milliseconds. Every import
counts: at the top of a module, inside a function, and under ``if TYPE_CHECKING:``, because a
circle that only shows up when a function runs, or only to the type checker, still ties two
modules together for whoever reads them. A package's own ``__init__`` counts only for what it
imports itself; ``elastic/__init__.py`` names its public modules in strings, loaded on first
use, and a string is not an import.
"""

import ast
from pathlib import Path

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
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
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
    # tests/test_core.py checks what the core loads when it runs; this, what it names at all
    graph = import_graph()
    outside = {module: sorted(target for target in targets if not target.startswith("elastic.core"))
               for module, targets in graph.items() if module.startswith("elastic.core")}
    assert {module: targets for module, targets in outside.items() if targets} == {}
