"""The ``radixserve`` command: serve (the layout: radixserve/topology.py), ray-deploy, generate,
prepare-model (benchmarks: ``python -m benchmarks.serving.serve_bench``)."""

from __future__ import annotations

import argparse
import sys

from radixserve.config import EngineConfig
from radixserve.knobs import add_arguments, values
from radixserve.sampling.params import SamplingParams

GENERATE_ENGINE_FLAGS = ("model", "kv_cache_gb", "quantization")
GENERATE_SAMPLING_FLAGS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed")


def _prepare_model(args: argparse.Namespace) -> None:
    from radixserve.model.default_model import prepare_default_model

    print(prepare_default_model(progress=True))


def _generate(args: argparse.Namespace) -> None:
    from radixserve import Engine

    engine = Engine(**values(EngineConfig, args))
    params = SamplingParams(**values(SamplingParams, args))
    prompt = (
        engine.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    )
    for delta in engine.stream(prompt, params):
        sys.stdout.write(delta.text)
        sys.stdout.flush()
    sys.stdout.write("\n")


def _serve(args: argparse.Namespace) -> None:
    from radixserve.topology import serve_from_args

    serve_from_args(args)


def _ray_deploy(args: argparse.Namespace) -> None:
    from radixserve.topology import serve_from_args

    serve_from_args(args, args.address)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixserve", description="A prefix-caching LLM inference server.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "prepare-model", help="convert and cache the embedded default model (SmolLM2-135M-Instruct)"
    )
    p.set_defaults(func=_prepare_model)

    p = sub.add_parser("generate", help="stream one completion to the terminal")
    p.add_argument("prompt")
    # The knobs' own declarations (config.py, sampling/params.py), with defaults for a terminal.
    add_arguments(p, EngineConfig, only=GENERATE_ENGINE_FLAGS, defaults={"kv_cache_gb": 0.5})
    add_arguments(
        p, SamplingParams, only=GENERATE_SAMPLING_FLAGS, defaults={"max_tokens": 128, "temperature": 0.0}
    )
    p.add_argument(
        "--no-chat", dest="chat", action="store_false", help="send the prompt raw, without the chat template"
    )
    p.set_defaults(func=_generate)

    p = sub.add_parser("serve", help="serve the OpenAI-compatible and native HTTP API")

    from radixserve.scale.launch import add_scale_arguments
    from radixserve.server import add_serve_arguments
    from radixserve.topology import add_disaggregation_arguments

    for add in (add_serve_arguments, add_disaggregation_arguments, add_scale_arguments):
        add(p)
    p.set_defaults(func=_serve)

    p = sub.add_parser("ray-deploy", help="run the replicas and the cache-aware router on a Ray cluster")
    p.add_argument("--address", required=True, help="the Ray cluster, e.g. ray://head:10001 or auto")
    for add in (add_serve_arguments, add_disaggregation_arguments, add_scale_arguments):
        add(p)
    p.set_defaults(func=_ray_deploy, replicas=2)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        sys.exit(f"radixserve: error: {exc}")


if __name__ == "__main__":
    main()
