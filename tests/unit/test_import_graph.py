"""No import circles among our modules, read from the source (an AST pass, nothing imported).

Every import counts: module-level, function-local and `if TYPE_CHECKING:` ones alike, because a
circle hidden inside a function or behind a type-checking guard is still two modules that cannot
be understood, tested or moved one without the other.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("echo_node", "protocol", "bootstrap", "benchmarks")


def module_files(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Module name -> source file, for every .py file under the given top-level packages."""
    found: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _imported(tree: ast.AST, module: str, is_package: bool) -> Iterator[str]:
    """Every module name an import statement anywhere in `tree` names (absolute or relative)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            yield prefix
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                yield f"{prefix}.{alias.name}"


def import_graph(files: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of `files` it imports. An import of `a.b.c` where only `a.b` is ours
    is an edge to `a.b`; a module never depends on itself or its own parent packages this way."""
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        edges: set[str] = set()
        for name in _imported(tree, module, path.name == "__init__.py"):
            while name and name not in files:
                name = name.rpartition(".")[0]
            if name and name != module and not module.startswith(name + "."):
                edges.add(name)
        graph[module] = edges
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component: list[str] = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        circles.append(sorted(component))
    return circles


def test_no_import_circles() -> None:
    graph = import_graph(module_files())
    assert len(graph) > 50, "the scan found too few modules to mean anything"
    assert import_circles(graph) == []


def test_the_scan_sees_circles_of_every_kind(tmp_path: Path) -> None:
    """The checker itself: a circle through a function-local import, a relative import, a
    `from pkg import submodule` and a TYPE_CHECKING guard is found; a chain without one is not."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("from . import c\n")
    (pkg / "sub" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..a import f\n"
    )
    (pkg / "d.py").write_text("import pkg.a\nimport os\n")
    graph = import_graph(module_files(tmp_path, ("pkg",)))
    assert graph["pkg.d"] == {"pkg.a"}
    assert import_circles(graph) == [["pkg.a", "pkg.sub.b", "pkg.sub.c"]]
    (pkg / "sub" / "c.py").write_text("import json\n")
    assert import_circles(import_graph(module_files(tmp_path, ("pkg",)))) == []


WINGS = ("echo_node.learner", "echo_node.peer")
# Start a role, so they may import its wing: the CLI, and tests and benchmarks (not scanned here).
ROLE_STARTERS = ("echo_node.cli",)


def _wing(module: str) -> str | None:
    return next((w for w in WINGS if module == w or module.startswith(w + ".")), None)


def wing_crossings(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Imports of a role's wing from outside it: from the other wing or from a module both roles
    use. What both roles use must not depend on either role, and neither role on the other."""
    return sorted(
        (module, imported)
        for module, edges in graph.items()
        if module.startswith("echo_node") and module not in ROLE_STARTERS
        for imported in edges
        if _wing(imported) is not None and _wing(imported) != _wing(module)
    )


def test_the_wings_are_imported_only_by_the_cli() -> None:
    graph = import_graph(module_files())
    assert all(any(m.startswith(w + ".") for m in graph) for w in WINGS), "a wing is missing"
    assert wing_crossings(graph) == []


def test_the_wing_check_sees_a_crossing() -> None:
    graph = {
        "echo_node.learner.intake": {"echo_node.metrics"},
        "echo_node.peer.rollout_peer": {"echo_node.learner.journal", "echo_node.metrics"},
        "echo_node.metrics": {"echo_node.peer"},
        "echo_node.cli": {"echo_node.learner", "echo_node.peer.rollout_peer"},
    }
    assert wing_crossings(graph) == [
        ("echo_node.metrics", "echo_node.peer"),
        ("echo_node.peer.rollout_peer", "echo_node.learner.journal"),
    ]
