"""The layering rules of ARCHITECTURE.md, checked on the import graph read from the source
(cocosync.testing.imports)."""

from __future__ import annotations

import pytest

from cocosync.testing.imports import STACK, cycles, layer_of, read_imports

MODULES, IMPORTS = read_imports()
RUNTIME_EDGES = [i for i in IMPORTS if not i.type_checking]


def _top(module: str) -> str:
    return layer_of(module).split(".")[0]


def test_the_reader_sees_the_package():
    assert "cocosync.runtime.comm.collectives" in MODULES and "cocosync.dsl.registry" in MODULES
    assert any(i.importer == "cocosync.runtime.reference.stage" and i.target == "cocosync.dsl.registry"
               for i in IMPORTS)


def test_the_compiler_stack_points_one_way():
    """dsl -> schedule -> lower -> runtime: a layer imports only the layers before it (lazy imports included)."""
    rank = {layer: k for k, layer in enumerate(STACK)}
    bad = [f"{i.importer}:{i.line} imports {i.target}" for i in RUNTIME_EDGES
           if _top(i.importer) in rank and _top(i.target) in rank and rank[_top(i.target)] > rank[_top(i.importer)]]
    assert not bad, "\n".join(bad)


def test_no_cycle_between_the_stack_packages():
    edges = {(_top(i.importer), _top(i.target)) for i in RUNTIME_EDGES}
    edges = {(a, b) for a, b in edges if a != b and a in STACK and b in STACK}
    assert not cycles(edges)


def test_no_cycle_among_runtime_and_lower_modules():
    edges = {(i.importer, i.target) for i in RUNTIME_EDGES if i.importer != i.target}
    inside = [c for c in cycles(edges) if any(m.startswith(("cocosync.runtime", "cocosync.lower")) for m in c)]
    assert not inside, inside


def test_no_module_cycle_anywhere_in_src():
    """Every module of src, lazy imports counted (a lazy import hides a cycle, it does not remove it)."""
    edges = {(i.importer, i.target) for i in RUNTIME_EDGES if i.importer != i.target}
    found = [sorted(c) for c in cycles(edges)]
    assert found == [], found


def test_the_embedding_storage_imports_nothing_of_the_job():
    """shadowsync.model.shard (row hash, shards, the row update) is what every store is built on."""
    mine = {i.target for i in RUNTIME_EDGES if i.importer == "cocosync.shadowsync.model.shard"}
    assert mine and {t for t in mine if t.startswith("cocosync.shadowsync")} == {"cocosync.shadowsync.config"}, mine


def test_no_cycle_between_runtime_layers():
    """runtime.comm <- runtime.reference <- runtime.steps <- runtime (executor): the layers point one way."""
    edges = {(layer_of(i.importer), layer_of(i.target)) for i in RUNTIME_EDGES}
    edges = {(a, b) for a, b in edges if a != b and a.startswith("runtime") and b.startswith("runtime")}
    assert ("runtime.steps", "runtime.reference") in edges  # the reader sees the layers
    assert not cycles(edges), cycles(edges)


def test_the_transport_layer_knows_nothing_of_the_dsl():
    """runtime.comm imports only itself and the shared ReduceOp leaf module."""
    allowed = ("cocosync.runtime.comm", "cocosync.reduce_op")
    bad = [f"{i.importer}:{i.line} imports {i.target}" for i in RUNTIME_EDGES
           if i.importer.startswith("cocosync.runtime.comm") and not i.target.startswith(allowed)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("layer", ["cocosync.runtime", "cocosync.lower"])
def test_no_function_level_imports_of_our_modules(layer):
    lazy = [f"{i.importer}:{i.line} imports {i.target}" for i in IMPORTS
            if i.function_level and i.importer.startswith(layer)]
    assert not lazy, "\n".join(lazy)


def test_no_private_names_imported_across_modules():
    bad = [f"{i.importer}:{i.line} takes {n} from {i.target}" for i in IMPORTS for n in i.names
           if n.startswith("_") and not n.startswith("__")]
    assert not bad, "\n".join(bad)


def test_the_checks_can_fail():
    """The graph helpers catch what they are for: a cycle, and a lazy import in a synthetic module."""
    assert cycles({("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")}) == [["a", "b", "c"]]
    assert not cycles({("a", "b"), ("b", "c")})
    assert layer_of("cocosync.runtime.comm.shm") == "runtime.comm" and layer_of("cocosync.dsl.ops") == "dsl"


def test_the_reader_flags_lazy_and_private_imports(tmp_path):
    pkg = tmp_path / "cocosync"
    (pkg / "runtime").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "runtime" / "__init__.py").write_text("")
    (pkg / "runtime" / "a.py").write_text("from cocosync.runtime.b import _hidden\n")
    (pkg / "runtime" / "b.py").write_text("def f():\n    from cocosync.runtime import a\n    return a\n_hidden = 1\n")
    modules, found = read_imports(pkg)
    assert {"cocosync.runtime.a", "cocosync.runtime.b"} <= modules
    lazy = [i for i in found if i.function_level]
    assert [(i.importer, i.target) for i in lazy] == [("cocosync.runtime.b", "cocosync.runtime.a")]
    assert [i.names for i in found if i.importer == "cocosync.runtime.a"] == [("_hidden",)]
    assert cycles({(i.importer, i.target) for i in found}) == [["cocosync.runtime.a", "cocosync.runtime.b"]]
