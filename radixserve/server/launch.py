"""``radixserve serve``: its flags, and how they become an EngineConfig, an AsyncEngine and a server (the
layout, one engine or many, is radixserve/topology.py's choice)."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Sequence
from pathlib import Path

from prometheus_client.registry import Collector

from radixserve.config import EngineConfig
from radixserve.knobs import add_arguments, values
from radixserve.model.default_model import DEFAULT_MODEL_NAME
from radixserve.runtime.async_engine import AsyncEngine
from radixserve.runtime.backend import ServingBackend
from radixserve.runtime.engine_process import parse_cpus
from radixserve.server.app import DEFAULT_MAX_BODY_BYTES, serve
from radixserve.server.chat.reasoning import REASONING_PARSERS
from radixserve.server.chat.tools import TOOL_CALL_PARSERS


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``radixserve serve``: the server's own, then one per EngineConfig knob (generated
    from its declarations: config.py), then the engine process's and the API's."""
    a = parser.add_argument
    a("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    a("--port", type=int, default=8000)
    a(
        "--served-model-name",
        default=None,
        help=(
            "the model name clients send (default: the model folder's name; SmolLM2-135M-Instruct for the "
            "embedded one)"
        ),
    )
    engine = parser.add_argument_group("engine", "the EngineConfig knobs")
    add_arguments(engine, EngineConfig)
    a(
        "--engine-threads",
        type=int,
        default=None,
        help="torch threads of the engine process (default: one per core it may run on)",
    )
    a(
        "--engine-cpus",
        type=parse_cpus,
        default=None,
        help="pin the engine process to these CPUs, e.g. 0-3,8 (default: no pinning)",
    )
    a(
        "--api-key",
        default=os.environ.get("RADIXSERVE_API_KEY"),
        help=(
            "bearer key(s), comma-separated, required on every route but /health (default: "
            "$RADIXSERVE_API_KEY)"
        ),
    )
    a("--salt-per-key", action="store_true", help="give each API key its own prefix-cache namespace")
    a("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, help="larger request bodies get 413")
    a("--drain-timeout", type=float, default=30.0, help="seconds to let running requests finish on shutdown")
    a("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    a(
        "--chat-template",
        default=None,
        help="a Jinja chat template file that replaces the model's (e.g. one that renders tools)",
    )
    a(
        "--tool-call-parser",
        default="auto",
        choices=TOOL_CALL_PARSERS,
        help=(
            "how the model writes tool calls (default auto: from the chat template; hermes where it says "
            "nothing)"
        ),
    )
    a(
        "--reasoning-parser",
        default=None,
        choices=REASONING_PARSERS,
        help="split <think>...</think> off the reply as reasoning_content (default: off)",
    )
    a(
        "--no-dashboard",
        dest="dashboard",
        action="store_false",
        help="turn off the browser pages (/ and /dashboard) and /v1/cache/tree, /v1/server/timeseries",
    )
    a(
        "--allowed-origins",
        default=None,
        help="turn on CORS for these browser origins, comma-separated, or * (default: off)",
    )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**values(EngineConfig, args))


def api_keys_from_args(args: argparse.Namespace) -> list[str] | None:
    """``--api-key``'s keys (None: no auth); SystemExit for ``--salt-per-key`` without one."""
    keys = [k.strip() for k in args.api_key.split(",") if k.strip()] if args.api_key else None
    if args.salt_per_key and not keys:
        raise SystemExit("--salt-per-key needs --api-key")
    return keys


def chat_template_from_args(args: argparse.Namespace) -> str | None:
    """``--chat-template``'s file, read (None: the model's own template)."""
    if args.chat_template is None:
        return None
    try:
        return Path(args.chat_template).read_text()
    except OSError as exc:
        raise SystemExit(f"--chat-template: cannot read {args.chat_template}: {exc.strerror}") from None


def engine_from_args(args: argparse.Namespace) -> AsyncEngine:
    """``radixserve serve``'s one engine process."""
    return AsyncEngine(
        engine_config_from_args(args),
        engine_threads=args.engine_threads,
        engine_cpus=args.engine_cpus,
        log_level=args.log_level,
        chat_template=chat_template_from_args(args),
    )


def run_from_args(
    args: argparse.Namespace, engine: ServingBackend, collectors: Sequence[Collector] = ()
) -> None:
    """Serve ``engine`` (the layout radixserve/topology.py picked from the flags) until interrupted."""
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    keys = api_keys_from_args(args)
    origins = (
        [o.strip() for o in args.allowed_origins.split(",") if o.strip()] if args.allowed_origins else None
    )
    name = args.served_model_name or (DEFAULT_MODEL_NAME if args.model is None else None)
    serve(
        engine,
        args.host,
        args.port,
        name,
        keys,
        args.salt_per_key,
        args.max_body_bytes,
        args.drain_timeout,
        args.log_level,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        allowed_origins=origins,
        dashboard=args.dashboard,
        collectors=collectors,
    )
