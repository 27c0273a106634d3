"""Dependencies point one way: no import cycle between the top-level packages, and
the engine reaches concrete drafters only through the registry's mapping."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("api", "server", "engine", "kvcache", "drafters", "training")


def imported_packages(path: Path) -> set[str]:
    """Top-level packages of this project that ``path`` imports anywhere (functions included)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        out |= {n.split(".")[0] for n in names} & set(PACKAGES)
    return out


def package_graph() -> dict[str, set[str]]:
    graph = {p: set() for p in PACKAGES}
    for p in PACKAGES:
        for path in (ROOT / p).rglob("*.py"):
            graph[p] |= imported_packages(path) - {p}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of the directed graph as a path, or None (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path + [node, nxt]
            if nxt not in state and (cycle := visit(nxt, path + [node])):
                return cycle
        state[node] = 2
        return None

    return next((c for n in sorted(graph) if n not in state and (c := visit(n, [])) is not None), None)


def test_no_cycle_between_top_level_packages():
    graph = package_graph()
    assert "engine" in graph["drafters"]  # drafters import the speculation interfaces
    assert "drafters" not in graph["engine"], "the engine names drafters only as strings in its registry"
    assert find_cycle(graph) is None, find_cycle(graph)


def test_the_cycle_check_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_registry_is_the_only_way_from_the_engine_to_a_drafter():
    """In a fresh interpreter, importing the whole engine loads no drafter; building one
    by its registry name does."""
    code = (
        "import sys, engine, engine.llm_engine, engine.async_engine, engine.spec_decode.registry as r\n"
        "assert not [m for m in sys.modules if m.split('.')[0] == 'drafters'], 'drafters loaded'\n"
        "from engine.config import SpeculativeConfig\n"
        "d = r.build_drafter(SpeculativeConfig(method='ngram'))\n"
        "assert type(d).__module__ == 'drafters.ngram'\n"
        "for name, target in r.DRAFTERS.items():\n"
        "    module, factory = target.split(':')\n"
        "    assert callable(getattr(__import__(module, fromlist=[factory]), factory)), name\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


def test_the_scheduler_and_the_block_allocator_import_without_torch():
    """DESIGN: the scheduler and the block allocator deal in ids and counts. In a fresh
    interpreter where importing torch fails, they, the request types, the configuration and
    the speculation policies import, and the engine's own names load on first use."""
    code = (
        "import sys\n"
        "sys.modules['torch'] = None  # any 'import torch' now raises ImportError\n"
        "import kvcache, engine.core.scheduler, engine.core.request, engine.sampling_params, engine.config\n"
        "import engine.spec_decode.policy, engine.spec_decode.fixed_policy\n"
        "from engine import SamplingParams, SchedulerConfig\n"
        "from kvcache import KVCacheManager\n"
        "sched = engine.core.scheduler.Scheduler(SchedulerConfig(), KVCacheManager(8, 4), 64)\n"
        "sched.add(engine.core.request.Request('r', [1, 2, 3], SamplingParams(max_tokens=2), frozenset()))\n"
        "assert sched.schedule().scheduled[0].token_ids == (1, 2, 3)\n"
        "try:\n"
        "    engine.LLM\n"
        "except ImportError:\n"
        "    pass\n"
        "else:\n"
        "    raise AssertionError('the offline engine loaded without torch')\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


def test_the_server_never_loads_training():
    """Training is its own package: no serving package imports it, and the server's CLI
    loads it only for ``specserve train-eagle``."""
    graph = package_graph()
    assert all("training" not in graph[p] for p in ("api", "engine", "kvcache", "drafters"))
    code = (
        "import sys, server.app, server.cli\n"
        "args = server.cli.build_parser().parse_args(['serve', '--model', '/models/x'])\n"
        "assert not [m for m in sys.modules if m.split('.')[0] == 'training'], 'training loaded'\n"
        "import training.eagle_train\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)
