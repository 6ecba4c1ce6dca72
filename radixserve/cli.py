"""The ``radixserve`` command: serve, generate, prepare-model (benchmarks: ``python -m benchmarks.serve_bench``)."""

from __future__ import annotations

import argparse
import sys

from radixserve.sampling.params import SamplingParams


def _prepare_model(args: argparse.Namespace) -> None:
    from radixserve.model.default_model import prepare_default_model

    print(prepare_default_model(progress=True))


def _generate(args: argparse.Namespace) -> None:
    from radixserve import Engine

    engine = Engine(model=args.model, kv_cache_gb=args.kv_cache_gb)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
    )
    prompt = (
        engine.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    )
    for delta in engine.stream(prompt, params):
        sys.stdout.write(delta.text)
        sys.stdout.flush()
    sys.stdout.write("\n")


def _serve(args: argparse.Namespace) -> None:
    from radixserve.server.launch import run_from_args

    run_from_args(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixserve", description="A prefix-caching LLM inference server.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "prepare-model", help="convert and cache the embedded default model (SmolLM2-135M-Instruct)"
    )
    p.set_defaults(func=_prepare_model)

    p = sub.add_parser("generate", help="stream one completion to the terminal")
    p.add_argument("prompt")
    p.add_argument(
        "--model", default=None, help="local HF folder (default: the embedded SmolLM2-135M-Instruct)"
    )
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--kv-cache-gb", type=float, default=0.5)
    p.add_argument(
        "--no-chat", dest="chat", action="store_false", help="send the prompt raw, without the chat template"
    )
    p.set_defaults(func=_generate)

    p = sub.add_parser("serve", help="serve the OpenAI-compatible and native HTTP API")
    from radixserve.server.launch import add_serve_arguments

    add_serve_arguments(p)
    p.set_defaults(func=_serve)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        sys.exit(f"radixserve: error: {exc}")


if __name__ == "__main__":
    main()
