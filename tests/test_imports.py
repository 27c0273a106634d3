"""No import cycles between the modules of the shipped packages.

The graph is read from the source with ``ast``: an edge A -> B for every ``import`` of B
in A, at module level or inside a function (a lazy import still ties the two modules
together), leaving out imports under ``if TYPE_CHECKING:``, which never run. ``from P
import name`` points at the module ``P.name`` when there is one, else at ``P``. The
packages' own ``__init__`` modules, run by any import below them, are not edges: a cycle
here is one a reader meets following imports by hand.

The same graph is checked once more with each of ``engine``'s subpackages taken as one
node (the modules at the ``engine`` root stay apart, they are the layers beneath and
above the subpackages): ``engine.attention`` importing ``engine.spec_decode`` while
``engine.spec_decode`` imports ``engine.attention`` is a loop even where no two modules
import each other.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("api", "server", "engine", "kvcache", "drafters", "training", "bench")


def module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def imported_names(tree: ast.AST, package: str):
    """Per import, the dotted names it may mean, most specific first (``from P import x``: P.x, P)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            yield from imported_names(ast.Module(body=node.orelse, type_ignores=[]), package)
            continue
        if isinstance(node, ast.Import):
            yield from ((a.name,) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against the importing module's package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            yield from ((f"{base}.{a.name}", base) for a in node.names)
        yield from imported_names(node, package)


def import_graph(root: Path = ROOT, packages=PACKAGES) -> dict[str, set[str]]:
    """module -> the modules of ``packages`` it imports."""
    files = {module_name(p, root): p for top in packages for p in sorted((root / top).rglob("*.py"))}
    graph = {}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        edges = set()
        for candidates in imported_names(ast.parse(path.read_text(), str(path)), package):
            target = next((c for c in candidates if c in files), None)
            if target is not None and target != module:
                edges.add(target)
        graph[module] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

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
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def package_graph(graph: dict[str, set[str]], root: Path = ROOT) -> dict[str, set[str]]:
    """``graph`` with each subpackage of ``engine`` and every other top-level package one node."""

    def node(module: str) -> str:
        parts = module.split(".")
        if parts[0] != "engine":
            return parts[0]
        return ".".join(parts[:2]) if len(parts) > 1 and (root / "engine" / parts[1]).is_dir() else module

    out: dict[str, set[str]] = {}
    for module, edges in graph.items():
        out.setdefault(node(module), set()).update(node(e) for e in edges if node(e) != node(module))
    return out


def _say(found: list[list[str]]) -> str:
    return "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_no_import_cycles_between_modules():
    found = cycles(import_graph())
    assert not found, _say(found)


def test_no_import_cycles_between_engine_subpackages():
    found = cycles(package_graph(import_graph()))
    assert not found, _say(found)


def test_a_lazy_import_closes_a_cycle(tmp_path):
    """A function-level import counts, relative imports resolve, TYPE_CHECKING ones do not count."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from . import c\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.b\nimport pkg.a\n")
    (pkg / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n")
    graph = import_graph(tmp_path, ("pkg",))
    assert graph["pkg.d"] == set() and graph["pkg.c"] == {"pkg.a"}
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]
