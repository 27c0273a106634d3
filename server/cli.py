"""The ``specserve`` command line."""

import argparse
import logging
import sys


def _fetch_model(args) -> int:
    from engine.model_store import fetch_default_model

    print(fetch_default_model())
    return 0


def _generate(args) -> int:
    from engine import LLM, SamplingParams

    llm = LLM(args.model, max_model_len=args.max_model_len)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    out = llm.chat([{"role": "user", "content": args.prompt}], params)
    print(out.text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description="OpenAI-compatible LLM server")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("fetch-model", help="download and convert the default model (once)").set_defaults(func=_fetch_model)
    gen = sub.add_parser("generate", help="one offline chat completion")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=None)
    gen.add_argument("--max-model-len", type=int, default=2048)
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.set_defaults(func=_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
