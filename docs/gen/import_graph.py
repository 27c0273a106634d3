"""The diagram of which package imports which, written into docs/architecture.md from the code.

    python docs/gen/import_graph.py            # rewrite the diagram in place
    python docs/gen/import_graph.py --check    # exit 1 when the page's diagram is stale

Nodes are the repository's top-level packages (every folder with an ``__init__.py``
except ``tests``), with ``engine`` split into its subpackages. An arrow A --> B says
that some module of A imports B when it is imported; a dotted arrow A -.-> B says A
imports B only inside functions (a lazy import). Imports under ``if TYPE_CHECKING:``
are left out. Only the standard library is used (ast), so the check is fast.
"""

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "architecture.md"
START, END = "<!-- import-graph:start -->", "<!-- import-graph:end -->"
SPLIT = ("engine",)  # packages drawn one node per subpackage
SKIP = ("tests",)


def packages() -> list[str]:
    return sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file() and p.name not in SKIP)


def node_of(module: str, tops: list[str]) -> str | None:
    """The diagram node of a dotted module name, or None outside the repository's packages."""
    parts = module.split(".")
    if parts[0] not in tops:
        return None
    if parts[0] in SPLIT and len(parts) > 1 and (ROOT / parts[0] / parts[1] / "__init__.py").is_file():
        return f"{parts[0]}.{parts[1]}"
    return parts[0]


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, package: str):
    """(imported module, lazy) for every import of a module whose package is ``package``."""

    def walk(node: ast.AST, lazy: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                continue
            inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                yield from ((a.name, lazy) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # relative: resolved against the importing module's package
                    anchor = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                # ``from engine import spec_decode`` imports the subpackage itself
                yield from ((f"{base}.{a.name}", lazy) for a in child.names)
            yield from walk(child, inner)

    yield from walk(tree, False)


def edges() -> dict[tuple[str, str], bool]:
    """(importer, imported) -> lazy (True when every such import sits inside a function)."""
    tops = packages()
    out: dict[tuple[str, str], bool] = {}
    for top in tops:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
            package = module if rel.name == "__init__" else module.rpartition(".")[0]
            src = node_of(module, tops)
            for name, lazy in _imports(ast.parse(path.read_text(), str(path)), package):
                dst = node_of(name, tops)
                if dst is None or dst == src:
                    continue
                out[(src, dst)] = out.get((src, dst), True) and lazy
    return out


def nodes() -> list[str]:
    out = []
    for top in packages():
        out.append(top)
        if top in SPLIT:
            out += [f"{top}.{d.name}" for d in sorted((ROOT / top).iterdir()) if (d / "__init__.py").is_file()]
    return out


def mermaid() -> str:
    ident = lambda node: node.replace(".", "_")  # noqa: E731
    lines = ["```mermaid", "graph LR"]
    lines += [f'  {ident(n)}["{n}"]' for n in nodes()]
    for (src, dst), lazy in sorted(edges().items()):
        lines.append(f"  {ident(src)} {'-.->' if lazy else '-->'} {ident(dst)}")
    return "\n".join(lines + ["```"])


def render(page: str) -> str:
    head, _, rest = page.partition(START)
    _, _, tail = rest.partition(END)
    return f"{head}{START}\n{mermaid()}\n{END}{tail}"


def main(argv: list[str]) -> int:
    page = PAGE.read_text()
    new = render(page)
    if "--check" in argv:
        if new != page:
            print(f"{PAGE} is stale: run python docs/gen/import_graph.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
