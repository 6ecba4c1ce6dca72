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

from radixserve.scale.autoscale import AutoscaleSettings
from radixserve.server import api_keys_from_args, chat_template_from_args, engine_config_from_args

ROUTER_CHOICES = ("cache_aware", "round_robin", "power_of_two")
AUTO = "auto"
AUTOSCALE_FLAGS = {  # flag -> AutoscaleSettings field; only with --replicas auto
    "--min-replicas": "min_replicas",
    "--max-replicas": "max_replicas",
    "--upscale-delay-s": "upscale_delay_s",
    "--downscale-delay-s": "downscale_delay_s",
    "--target-queue-wait-s": "target_queue_wait_s",
    "--target-queue-depth": "target_queue_depth",
}


def replicas_arg(text: str) -> int | str:
    """``--replicas``: a count, or ``auto``."""
    if text == AUTO:
        return AUTO
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--replicas takes a count or 'auto', got {text!r}") from None


def add_scale_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a(
        "--replicas",
        type=replicas_arg,
        default=1,
        help="engine replicas on Ray Serve (1: one engine, no Ray; auto: --min-replicas..--max-replicas)",
    )
    auto = parser.add_argument_group("autoscaling", "with --replicas auto (docs/scaling.md)")
    defaults = AutoscaleSettings()
    auto.add_argument("--min-replicas", type=int, default=None, help=f"default {defaults.min_replicas}")
    auto.add_argument("--max-replicas", type=int, default=None, help=f"default {defaults.max_replicas}")
    auto.add_argument(
        "--upscale-delay-s",
        type=float,
        default=None,
        help=f"a queue over target must last this long to add one (default {defaults.upscale_delay_s:g})",
    )
    auto.add_argument(
        "--downscale-delay-s",
        type=float,
        default=None,
        help=f"low load must last this long to remove one (default {defaults.downscale_delay_s:g})",
    )
    auto.add_argument(
        "--target-queue-wait-s",
        type=float,
        default=None,
        help=f"p95 queue wait that scales up (default {defaults.target_queue_wait_s:g})",
    )
    auto.add_argument(
        "--target-queue-depth",
        type=float,
        default=None,
        help=f"waiting requests per replica that scale up (default {defaults.target_queue_depth:g})",
    )
    a(
        "--warm-prefixes",
        type=int,
        default=16,
        help="hot prefixes a new replica restores before it takes traffic (0: none)",
    )
    a(
        "--warmup-timeout-s",
        type=float,
        default=120.0,
        help="a new replica takes traffic after this long, warm or not",
    )
    a("--router", default="cache_aware", choices=ROUTER_CHOICES, help="how requests pick a replica")
    a(
        "--router-settings",
        default="{}",
        help="cache_aware router settings as JSON, e.g. '{\"balance_abs_threshold\": 8}' (docs/scaling.md)",
    )
    a("--replica-cpus", type=float, default=1.0, help="Ray CPUs reserved by each replica")


def autoscale_settings(args: argparse.Namespace) -> AutoscaleSettings | None:
    """The autoscaling flags as settings (None for a fixed count); ValueError naming a bad flag."""
    given = {flag: getattr(args, field) for flag, field in AUTOSCALE_FLAGS.items()}
    given = {flag: value for flag, value in given.items() if value is not None}
    if args.replicas != AUTO:
        if given:
            raise ValueError(f"{', '.join(given)} need --replicas auto")
        if args.replicas < 1:
            raise ValueError(f"--replicas must be >= 1 or auto, got {args.replicas}")
        return None
    return AutoscaleSettings(**{AUTOSCALE_FLAGS[flag]: value for flag, value in given.items()})


def require_ray_serve() -> None:
    """``--replicas auto`` and counts above 1 run on Ray Serve: say so plainly if it is missing."""
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError:
        raise ValueError(
            "--replicas auto (or more than 1) needs Ray Serve: pip install 'ray[serve]==2.60.0'"
        ) from None


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
    autoscale = autoscale_settings(args)  # bad flags are refused before anything starts
    require_ray_serve()
    import ray

    from radixserve.model.default_model import DEFAULT_MODEL_NAME
    from radixserve.scale.app import ScaleOptions, run
    from radixserve.scale.policy import RouterSettings

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    settings = json.loads(args.router_settings)
    RouterSettings(**settings)  # refuse a bad setting here, not in the router's process
    keys = api_keys_from_args(args)
    template = chat_template_from_args(args)
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
        autoscale=autoscale,
        warm_prefixes=args.warm_prefixes,
        warmup_timeout_s=args.warmup_timeout_s,
    )
    if address is None:
        most = autoscale.max_replicas if autoscale is not None else int(num_replicas or args.replicas)
        ray.init(num_cpus=max(1, int(most * args.replica_cpus + 0.999)), include_dashboard=False)
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
