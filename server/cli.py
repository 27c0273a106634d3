"""The ``specserve`` command line: ``serve``, ``generate``, ``fetch-model``, ``train-eagle``.

``serve`` has one flag per ``ServerSettings`` field (``--max-model-len`` for
``max_model_len``); a flag given on the command line wins over the
``SPECSERVE_*`` environment variable, which wins over the default.
"""

import argparse
import json
import logging
import sys
import typing

from pydantic import ValidationError

from server import openmp


def _fetch_model(args) -> int:
    from engine.worker.model_store import fetch_default_gguf

    print(fetch_default_gguf())
    return 0


def _generate(args) -> int:
    from engine import LLM, SamplingParams

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    llm = LLM(args.model, max_model_len=args.max_model_len)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    out = llm.chat([{"role": "user", "content": args.prompt}], params)
    print(out.text)
    return 0


def _train_eagle(args) -> int:
    from training.eagle_train import TrainConfig, train

    keys = TrainConfig.__dataclass_fields__
    print(train(TrainConfig(**{k: v for k, v in vars(args).items() if k in keys and v is not None})))
    return 0


def _serve(args) -> int:
    from server.run import run_server
    from server.settings import ServerSettings

    flags = {k: v for k, v in vars(args).items() if k in ServerSettings.model_fields}
    try:
        settings = ServerSettings(**flags)
    except ValidationError as e:
        for line in _settings_errors(e):
            print(f"specserve serve: error: {line}", file=sys.stderr)
        return 2
    return run_server(settings)


def _settings_errors(error: ValidationError) -> list[str]:
    """One line per invalid setting, named by its flag: ``--port: Input should be less than 65536``."""
    lines = []
    for err in error.errors():
        msg = err["msg"].removeprefix("Value error, ")
        flag = "--" + str(err["loc"][0]).replace("_", "-") if err["loc"] else ""
        lines.append(f"{flag}: {msg}" if flag else msg)
    return lines


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def add_settings_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per settings field; unset flags stay out of the namespace (env / default apply)."""
    from server.settings import ServerSettings

    for name, field in ServerSettings.model_fields.items():
        kwargs: dict = {"dest": name, "default": argparse.SUPPRESS}
        ann = field.annotation
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        if ann is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(ann) is typing.Literal:
            kwargs["choices"] = list(typing.get_args(ann))
        elif any(typing.get_origin(a) is list for a in args):
            kwargs["nargs"] = "+"
        elif dict in args:
            kwargs["type"] = _json_object
        default = field.default if name != "api_key" else None
        shown = f" [default: {default}]" if default is not None else ""
        kwargs["help"] = f"{field.description}{shown} (env SPECSERVE_{name.upper()})"
        parser.add_argument("--" + name.replace("_", "-"), **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description="OpenAI-compatible LLM server")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("fetch-model", help="download the default model's GGUF file (once)").set_defaults(func=_fetch_model)
    gen = sub.add_parser("generate", help="one offline chat completion")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=None)
    gen.add_argument("--max-model-len", type=int, default=2048)
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.set_defaults(func=_generate)
    train = sub.add_parser("train-eagle", help="train an EAGLE-3 head for the model on the CPU (resumes)")
    train.add_argument("--out", required=True, help="directory of the head (and of its training state)")
    train.add_argument("--model", default=None)
    for flag in ("minutes", "max-steps", "batch-size", "seq-len", "draft-vocab", "ttt-steps", "lr", "save-every",
                 "prompts", "answer-tokens"):
        train.add_argument(f"--{flag}", type=float if flag in ("minutes", "lr") else int, default=None)
    train.add_argument("--no-bf16", dest="bf16", action="store_false", default=None,
                       help="float32 matmuls even where the CPU has native bfloat16")
    train.set_defaults(func=_train_eagle)
    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    add_settings_flags(serve)
    serve.set_defaults(func=_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point. Run as a command (before torch is imported), it first re-runs
    itself with Intel's OpenMP preloaded (``server.openmp``)."""
    openmp.ensure("server.cli", sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
