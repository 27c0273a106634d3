"""``python -m bench``: list the benchmarks; ``python -m bench NAME [ARGS]``: run one.

Running ``python -m bench NAME ARGS`` is the same as ``python -m bench.NAME ARGS``.
"""

import runpy
import sys

from bench.catalog import benchmarks


def main(argv: list[str]) -> int:
    items = {b.name: b for b in benchmarks()}
    if not argv or argv[0] in ("-h", "--help", "list"):
        width = max(map(len, items))
        print("python -m bench NAME [ARGS]   (NAME --help for its flags)\n")
        for b in items.values():
            print(f"  {b.name:<{width}}  {b.summary}")
        return 0
    name, *args = argv
    if name not in items:
        print(f"no benchmark {name!r}; one of: {', '.join(items)}", file=sys.stderr)
        return 2
    sys.argv = [f"bench/{name}.py", *args]
    runpy.run_module(f"bench.{name}", run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
