"""``radixserve serve --replicas N`` (a local Ray instance) and ``radixserve ray-deploy --address``
(an existing cluster): the serve flags, plus the scale-out ones, become a ScaleOptions."""

from __future__ import annotations

import argparse
import json
import logging
import signal
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from radixserve.server.launch import engine_config_from_args

ROUTER_CHOICES = ("cache_aware", "round_robin", "power_of_two")


def add_scale_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--replicas", type=int, default=1, help="engine replicas on Ray Serve (1: a single engine, no Ray)")
    a("--router", default="cache_aware", choices=ROUTER_CHOICES, help="how requests pick a replica")
    a(
        "--router-settings",
        default="{}",
        help="cache_aware router settings as JSON, e.g. '{\"balance_abs_threshold\": 8}' (docs/scaling.md)",
    )
    a("--replica-cpus", type=float, default=1.0, help="Ray CPUs reserved by each replica")


def run_scaled(
    args: argparse.Namespace,
    address: str | None,
    build: Callable[[Any], Any] | None = None,
    num_replicas: int | None = None,
) -> None:
    """Run the Serve application until interrupted: on a new local Ray instance (``address`` None)
    or on the cluster at ``address``, whose Serve proxy then listens on ``--host``/``--port``.
    ``build`` makes another application from the ScaleOptions (disaggregated serving's), of
    ``num_replicas`` replicas in all (for the local instance's CPUs)."""
    import ray

    from radixserve.model.default_model import DEFAULT_MODEL_NAME
    from radixserve.scale.app import ScaleOptions, run
    from radixserve.scale.policy import RouterSettings

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.replicas < 1:
        raise SystemExit("--replicas must be >= 1")
    settings = json.loads(args.router_settings)
    RouterSettings(**settings)  # refuse a bad setting here, not in the router's process
    keys = [k.strip() for k in args.api_key.split(",") if k.strip()] if args.api_key else None
    if args.salt_per_key and not keys:
        raise SystemExit("--salt-per-key needs --api-key")
    template = None
    if args.chat_template is not None:
        with open(args.chat_template) as f:
            template = f.read()
    options = ScaleOptions(
        engine_config_from_args(args),
        replicas=args.replicas,
        router=args.router,
        router_settings=settings,
        replica_cpus=args.replica_cpus,
        engine_threads=args.engine_threads,
        model_name=args.served_model_name
        or (DEFAULT_MODEL_NAME if args.model is None else Path(args.model).name),
        api_key=keys,
        salt_per_key=args.salt_per_key,
        chat_template=template,
    )
    if address is None:
        replicas = num_replicas or args.replicas
        ray.init(num_cpus=max(1, int(replicas * args.replica_cpus + 0.999)), include_dashboard=False)
    else:
        ray.init(address=address)
    # Ray's core worker installs a native SIGTERM handler that prints a stack trace and aborts the
    # driver, leaving the replicas (and their engine processes) to be killed mid-request. Installed
    # after ray.init, ours replaces it: SIGTERM is an interrupt, like Ctrl-C, and ends in a drain.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        if build is None:
            run(options, args.host, args.port, blocking=True)
        else:
            run(options, args.host, args.port, blocking=True, build=build)
    except KeyboardInterrupt:
        logging.getLogger("radixserve.scale").info("shutting down")
    finally:
        _shut_down(address is None)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _shut_down(local: bool) -> None:
    """On our own Ray instance: stop Serve first, which lets each replica finish its requests, then
    Ray. On a cluster the application stays deployed (it is the cluster's); we only disconnect."""
    import ray
    from ray import serve

    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the drain short
    if local:
        serve.shutdown()
    ray.shutdown()
