"""The serving layout the flags ask for, picked in one place for ``radixserve serve`` and ``ray-deploy``.

Four layouts (docs/scaling.md):
- ``single``: one engine process behind the server (server/launch.py);
- ``disaggregated``: ``--disaggregate P:D``, prefill and decode engine processes on this host, no Ray
  (disagg/coordinator.py);
- ``replicas``: ``--replicas N|auto`` on a local Ray instance, or ``ray-deploy`` on a cluster
  (scale/launch.py);
- ``disaggregated_replicas``: ``--prefill-replicas N --decode-replicas M`` on Ray Serve
  (disagg/ray_app.py), locally or on a cluster.

Flags of two layouts that exclude each other are refused (ValueError, naming them) before anything starts.
"""

from __future__ import annotations

import argparse
from typing import Literal

from prometheus_client.registry import Collector

from radixserve.disagg.coordinator import DisaggregatedEngine, parse_split
from radixserve.disagg.transport import TRANSPORTS
from radixserve.runtime.backend import ServingBackend
from radixserve.scale.launch import AUTO, autoscale_settings, run_scaled
from radixserve.server import (
    chat_template_from_args,
    engine_config_from_args,
    engine_from_args,
    run_from_args,
)

Layout = Literal["single", "disaggregated", "replicas", "disaggregated_replicas"]


def add_disaggregation_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of both disaggregated layouts."""
    d = parser.add_argument_group(
        "disaggregation", "prefill and decode in separate engines (docs/scaling.md)"
    )
    d.add_argument(
        "--disaggregate",
        type=parse_split,
        default=None,
        metavar="P:D",
        help="run P prefill and D decode engine processes behind this server, e.g. 1:1 (default: off)",
    )
    d.add_argument(
        "--kv-transport",
        choices=TRANSPORTS,
        default="shm",
        help="how KV pages move between them: shm (shared memory, one host) or tcp (ZMQ)",
    )
    d.add_argument(
        "--prefill-replicas",
        type=int,
        default=0,
        help="with --decode-replicas: prefill engines as Ray Serve replicas (pages over ZMQ TCP)",
    )
    d.add_argument("--decode-replicas", type=int, default=0, help="decode engines as Ray Serve replicas")
    d.add_argument(
        "--kv-timeout",
        type=float,
        default=120.0,
        help="seconds a decode engine waits for the next chunk of a prompt's KV pages (then a 503)",
    )


def pick_layout(args: argparse.Namespace, on_cluster: bool = False) -> Layout:
    """The layout of ``args`` (``on_cluster``: ``ray-deploy``, to an existing Ray cluster)."""
    autoscale_settings(args)  # autoscaling flags need --replicas auto; a count is >= 1
    if args.prefill_replicas or args.decode_replicas:
        if args.disaggregate is not None:
            raise ValueError(
                "--disaggregate (one host, no Ray) and --prefill/--decode-replicas exclude each other"
            )
        if args.prefill_replicas < 1 or args.decode_replicas < 1:
            raise ValueError("--prefill-replicas and --decode-replicas must both be >= 1")
        return "disaggregated_replicas"
    if on_cluster or args.replicas == AUTO or args.replicas > 1:
        if args.disaggregate is not None:
            raise ValueError(
                "--disaggregate runs on one host without Ray; on Ray Serve use --prefill-replicas and "
                "--decode-replicas"
            )
        return "replicas"
    if args.disaggregate is not None:
        if args.engine_cpus is not None:
            raise ValueError(
                "--engine-cpus pins one engine process; with --disaggregate each engine process is "
                "pinned to cores of its own (or give --engine-threads to let them share every core)"
            )
        return "disaggregated"
    return "single"


def serve_from_args(args: argparse.Namespace, address: str | None = None) -> None:
    """Run the layout the flags pick until interrupted (``address``: the Ray cluster of ``ray-deploy``)."""
    layout = pick_layout(args, on_cluster=address is not None)
    if layout == "disaggregated_replicas":
        # Here, not at the top: its Serve application imports Ray, which the other layouts never load.
        from radixserve.disagg.ray_app import run_disaggregated

        run_disaggregated(args, address)
    elif layout == "replicas":
        run_scaled(args, address)
    elif layout == "disaggregated":
        engine, collectors = disaggregated_from_args(args)
        run_from_args(args, engine, collectors)
    else:
        run_from_args(args, engine_from_args(args))


def disaggregated_from_args(args: argparse.Namespace) -> tuple[ServingBackend, list[Collector]]:
    """``--disaggregate P:D``'s engine, and its transfer metrics for /metrics."""
    num_prefill, num_decode = args.disaggregate
    engine = DisaggregatedEngine(
        engine_config_from_args(args),
        num_prefill,
        num_decode,
        engine_threads=args.engine_threads,
        log_level=args.log_level,
        chat_template=chat_template_from_args(args),
        transport=args.kv_transport,
        kv_timeout_s=args.kv_timeout,
    )
    return engine, [engine.metrics]
