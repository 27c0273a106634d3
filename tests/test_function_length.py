"""No function in the shipped packages runs over 60 lines (docs/architecture.md): a longer one
is read in pieces and hides its steps. Python is measured by ``ast``; C from a definition's
first line at column 0 to the brace that closes its body."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("api", "bench", "deploy", "drafters", "engine", "kvcache", "server", "training")
LIMIT = 60
C_DEFINITION = re.compile(r"^[A-Za-z_][^;]*\(")  # a line at column 0 that opens a definition or a prototype


def python_lengths(path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text(), str(path))
    return [(f"{path.relative_to(ROOT)}:{node.name}", node.end_lineno - node.lineno + 1)
            for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


def c_lengths(path: Path) -> list[tuple[str, int]]:
    found, name, start, depth = [], None, 0, 0
    for number, line in enumerate(path.read_text().splitlines(), 1):
        names = [word for word in re.findall(r"(\w+)\(", line) if not word.startswith("__")]  # not attributes
        if name is None and names and C_DEFINITION.match(line):
            name, start, depth = names[0], number, 0
        if name is None:
            continue
        opened = depth > 0 or "{" in line
        depth += line.count("{") - line.count("}")
        if not opened and line.rstrip().endswith(";"):
            name = None  # a prototype, its arguments over one or more lines
        elif opened and depth == 0:
            found.append((f"{path.relative_to(ROOT)}:{name}", number - start + 1))
            name = None
    return found


def test_no_python_function_over_60_lines():
    lengths = [item for pkg in PACKAGES for path in sorted((ROOT / pkg).rglob("*.py")) for item in python_lengths(path)]
    assert len(lengths) > 500  # the scan found the packages' functions
    assert [item for item in lengths if item[1] > LIMIT] == []


def test_no_c_function_over_60_lines():
    sources = sorted((ROOT / "engine/layers/csrc").glob("*.[ch]"))
    lengths = [item for path in sources for item in c_lengths(path)]
    assert len(lengths) > 40 and max(n for _, n in lengths) > 20  # the scan found real bodies
    assert [item for item in lengths if item[1] > LIMIT] == []
