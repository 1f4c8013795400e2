"""The package's import graph: no cycle between its modules or between its packages, and no
import from a lower layer to a higher one, with the layers as docs/architecture.md lists them.

Every import statement counts, inside functions too. `from pkg import name` loads the module
`pkg.name` when there is one, else `pkg` itself (its `__init__.py`).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted((ROOT / "astrai").rglob("*.py"))}


def imported(name: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    """The package's modules that one import statement of module `name` loads."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names} & MODULES.keys()
    source = node.module or ""
    if node.level:  # relative: from the module's own package, `level - 1` packages up
        package = name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        source = ".".join(part for part in (package, source) if part)
    loaded = {
        f"{source}.{a.name}" if f"{source}.{a.name}" in MODULES else source for a in node.names
    }
    return loaded & MODULES.keys()


def import_graph() -> dict[str, set[str]]:
    """Each module of the package -> the package's modules it imports."""
    graph = {}
    for name, path in MODULES.items():
        statements = ast.walk(ast.parse(path.read_text(), str(path)))
        found = set()
        for node in statements:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found |= imported(name, node)
        graph[name] = found - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of nodes that reach each other (strongly connected components of more than
    one node), each sorted; Tarjan's algorithm."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while not group or group[-1] != node:
                group.append(stack.pop())
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def package_of(module: str) -> str:
    """astrai.train.step -> "train"; astrai.config -> "config"; the root __init__ -> "astrai"."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def documented_layers() -> dict[str, int]:
    """Package -> its layer (1 the lowest), from docs/architecture.md's numbered list."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Package layers", 1)[1].split("\n## ", 1)[0]
    layers = {}
    for number, names in re.findall(r"^(\d+)\. ((?:`\w+`(?:, )?)+)", section, re.M):
        for package in re.findall(r"`(\w+)`", names):
            assert package not in layers, f"docs/architecture.md lists {package!r} twice"
            layers[package] = int(number)
    return layers


def test_the_cycle_finder_finds_cycles_through_other_nodes():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"d"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({**graph, "c": {"d"}}) == []


def test_no_module_imports_itself_through_others():
    found = cycles(import_graph())
    assert not found, "modules that import each other: " + "; ".join(map(", ".join, found))


def test_no_package_imports_itself_through_others():
    graph: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        graph.setdefault(package_of(module), set()).update(map(package_of, targets))
    found = cycles({p: targets - {p} for p, targets in graph.items()})
    assert not found, "packages that import each other: " + "; ".join(map(", ".join, found))


def test_every_import_goes_to_the_same_layer_or_below():
    layers = documented_layers()
    packages = {package_of(m) for m in MODULES}
    assert packages <= layers.keys(), (
        f"docs/architecture.md does not place {sorted(packages - layers.keys())} in a layer"
    )
    upward = [
        f"{MODULES[module].relative_to(ROOT)} (layer {layers[package_of(module)]}) imports "
        f"{target} (layer {layers[package_of(target)]})"
        for module, targets in import_graph().items()
        for target in sorted(targets)
        if layers[package_of(target)] > layers[package_of(module)]
    ]
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_no_module_of_the_package_imports_a_program():
    programs = {
        p.stem
        for p in (ROOT / "programs").iterdir()
        if p.suffix == ".py" or (p.is_dir() and not p.name.startswith("_"))
    }
    found = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                tops = {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level:
                tops = {(node.module or "").split(".")[0]}
            else:
                continue
            found += [f"{name} imports {top}" for top in sorted(tops & programs)]
    assert not found, "the package imports programs: " + "; ".join(found)
