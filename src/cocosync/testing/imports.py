"""The import graph of the cocosync package, read from the source (nothing is imported).

`python -m cocosync.testing.imports` prints the package graph (which layer imports which, with counts), the cycles
among modules, function-level imports of our own modules and private names imported across modules;
tests/test_architecture.py asserts the layering rules on the same data.
"""

from __future__ import annotations

import ast
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Import", "package_root", "read_imports", "layer_of", "cycles", "main"]

ROOT = "cocosync"


@dataclass(frozen=True, slots=True)
class Import:
    """One `import` / `from ... import` of a cocosync module by another."""

    importer: str  # dotted module name, e.g. cocosync.runtime.reference.stage
    target: str  # the module imported (for `from pkg import name`, pkg.name when that is a module)
    names: tuple[str, ...]  # the names taken (empty for `import x`)
    function_level: bool  # inside a function or method (a lazy import)
    type_checking: bool  # under `if TYPE_CHECKING:` (no run-time edge)
    line: int


def package_root() -> Path:
    return Path(__file__).resolve().parent.parent


def _module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(importer: str, is_pkg: bool, module: str | None, level: int) -> str:
    if level == 0:
        return module or ""
    base = importer.split(".") if is_pkg else importer.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, module] if module else base)


class _Visitor(ast.NodeVisitor):
    def __init__(self, importer: str, is_pkg: bool, modules: set[str]):
        self.importer, self.is_pkg, self.modules = importer, is_pkg, modules
        self.depth, self.tc = 0, 0
        self.found: list[Import] = []

    def _add(self, target: str, names: tuple[str, ...], line: int) -> None:
        if target == ROOT or target.startswith(ROOT + "."):
            self.found.append(Import(self.importer, target, names, self.depth > 0, self.tc > 0, line))

    def visit_FunctionDef(self, node):  # noqa: N802 - ast API
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef  # noqa: N815

    def visit_If(self, node):  # noqa: N802
        tc = isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
        self.tc += tc
        for child in node.body:
            self.visit(child)
        self.tc -= tc
        for child in node.orelse:
            self.visit(child)

    def visit_Import(self, node):  # noqa: N802
        for a in node.names:
            self._add(a.name, (), node.lineno)

    def visit_ImportFrom(self, node):  # noqa: N802
        base = _resolve(self.importer, self.is_pkg, node.module, node.level)
        plain = tuple(a.name for a in node.names if f"{base}.{a.name}" not in self.modules)
        for a in node.names:  # `from pkg import module` is an edge to that module
            if f"{base}.{a.name}" in self.modules:
                self._add(f"{base}.{a.name}", (), node.lineno)
        if plain or not node.names:
            self._add(base, plain, node.lineno)


def read_imports(root: Path | None = None) -> tuple[set[str], list[Import]]:
    """(every module of the package, every import of one of ours by one of ours)."""
    root = root or package_root()
    files = sorted(root.rglob("*.py"))
    modules = {_module_name(f, root) for f in files}
    found: list[Import] = []
    for f in files:
        name = _module_name(f, root)
        v = _Visitor(name, f.name == "__init__.py", modules)
        v.visit(ast.parse(f.read_text(), filename=str(f)))
        found += v.found
    return modules, found


#: the layers of the compiler stack in dependency order: a layer may import the ones before it, never after
STACK = ("dsl", "schedule", "lower", "runtime")


def layer_of(module: str) -> str:
    """cocosync.runtime.comm.shm -> runtime.comm; cocosync.dsl.ops -> dsl; cocosync.interp -> interp."""
    parts = module.split(".")[1:]
    if parts[:1] == ["runtime"] and len(parts) > 2:
        return ".".join(parts[:2])
    return parts[0] if parts else ROOT


def cycles(edges: set[tuple[str, str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def main() -> None:
    modules, found = read_imports()
    runtime_edges = [i for i in found if not i.type_checking]
    layers = Counter((layer_of(i.importer), layer_of(i.target)) for i in runtime_edges
                     if layer_of(i.importer) != layer_of(i.target))
    print(f"{len(modules)} modules, {len(found)} imports of our own modules\n\nlayer -> layer (imports):")
    for (a, b), n in sorted(layers.items()):
        print(f"  {a:<18} -> {b:<18} {n}")
    mod_cycles = cycles({(i.importer, i.target) for i in runtime_edges if i.importer != i.target})
    print(f"\nmodule cycles: {len(mod_cycles)}")
    for c in mod_cycles:
        print("  " + " <-> ".join(c))
    lazy = [i for i in found if i.function_level]
    print(f"\nfunction-level imports of our modules: {len(lazy)}")
    for layer, n in sorted(Counter(layer_of(i.importer) for i in lazy).items()):
        print(f"  {layer:<18} {n}")
    private = [i for i in found if any(n.startswith("_") and not n.startswith("__") for n in i.names)]
    print(f"\nprivate names imported across modules: {len(private)}")
    for i in private:
        print(f"  {i.importer}:{i.line} takes {', '.join(i.names)} from {i.target}")


if __name__ == "__main__":
    main()
