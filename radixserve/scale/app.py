"""The Ray Serve application: an ingress (our OpenAI-compatible app) over N engine replicas.

``build_application`` makes it, ``app_builder`` makes it from a Serve config's args (docs/scaling.md
has a KubeRay RayService that imports ``radixserve.scale.app:app_builder``), and ``run`` runs it on
the connected Ray cluster (scale/launch.py: ``radixserve serve --replicas N`` and ``ray-deploy``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.types import ASGIApp

from radixserve.config import EngineConfig
from radixserve.scale.autoscale import AutoscaleSettings
from radixserve.scale.cache_index import index_actor
from radixserve.scale.replica import EngineReplica
from radixserve.scale.router import ROUTERS

logger = logging.getLogger("radixserve.scale")

APP_NAME = "radixserve"
INGRESS_NAME = "RadixServeIngress"
REPLICAS_NAME = "EngineReplicas"


@dataclass(frozen=True)
class ScaleOptions:
    """How the application is laid out; the engine knobs are in ``config``."""

    config: EngineConfig
    replicas: int = 2
    router: str = "cache_aware"  # a key of router.ROUTERS
    router_settings: dict[str, Any] = field(default_factory=dict)  # policy.RouterSettings' fields
    replica_cpus: float = 1.0
    engine_threads: int | None = None
    model_name: str = "SmolLM2-135M-Instruct"
    api_key: list[str] | None = None
    salt_per_key: bool = False
    chat_template: str | None = None
    stats_period_s: float = 0.5  # how often Serve asks each replica for its KV use
    max_ongoing_requests: int = 64
    autoscale: AutoscaleSettings | None = None  # None: ``replicas`` fixed; else min..max on queue wait
    warm_prefixes: int = 16  # hot prefixes a new replica restores before it takes traffic (0: none)
    warmup_timeout_s: float = 120.0  # it takes traffic after this long, warm or not
    drain_timeout_s: float = 300.0  # a replica removed finishes its requests for this long at most

    def __post_init__(self) -> None:
        if self.warm_prefixes < 0:
            raise ValueError(f"--warm-prefixes must be >= 0, got {self.warm_prefixes}")
        limits = (("--warmup-timeout-s", self.warmup_timeout_s), ("drain_timeout_s", self.drain_timeout_s))
        for flag, value in limits:
            if not value >= 0:
                raise ValueError(f"{flag} must be >= 0 seconds, got {value}")

    @property
    def threads(self) -> int:
        """Each replica's engine process's torch threads: ``engine_threads``, else the CPUs Ray reserves
        for its replica (at least one). One per core, as a lone engine takes, two replicas on 2 cores
        ran 4 threads that preempted each other at every barrier of a step."""
        return self.engine_threads or max(1, int(self.replica_cpus))

    @property
    def index_name(self) -> str:
        return f"radixserve-cache-index-{self.router}-{id(self) & 0xFFFF:x}-{int(time.time() * 1000)}"


class Ingress:
    """The ingress deployment: the same Starlette app as ``radixserve serve``, over the replicas."""

    def __init__(self, replicas: Any, options: ScaleOptions, index_name: str) -> None:
        from radixserve.scale.remote_engine import ReplicaCount, ReplicaSetEngine
        from radixserve.scale.router_metrics import router_metrics
        from radixserve.server import build_app

        self.engine = ReplicaSetEngine(
            replicas, index_actor(index_name), options.config.model, options.chat_template
        )
        app = build_app(
            self.engine,
            options.model_name,
            options.api_key,
            options.salt_per_key,
            collectors=[router_metrics(), ReplicaCount(self.engine)],
        )
        self._asgi = app

    def __serve_build_asgi_app__(self) -> ASGIApp:
        return self._asgi


def build_application(options: ScaleOptions, index_name: str | None = None) -> Any:
    """The bound Serve application (``serve.run`` it)."""
    index_name = index_name or options.index_name
    count = None if options.autoscale is not None else options.replicas
    replicas = engine_deployment(options, EngineReplica, index_name, count).bind(
        options.config,
        index_name,
        options.threads,
        options.chat_template,
        # by keyword: EngineReplica's next positional parameter is process_args (disaggregation's)
        warm_prefixes=options.warm_prefixes,
        warmup_timeout_s=options.warmup_timeout_s,
    )
    return ingress_deployment().bind(replicas, options, index_name)


def engine_deployment(options: ScaleOptions, cls: type, index_name: str, num_replicas: int | None) -> Any:
    """The engine replicas' deployment (``cls``: EngineReplica, or disaggregation's decode replica),
    routed by ``options.router``; ``num_replicas`` None: autoscaled by ``options.autoscale``. ``.bind``
    it to the class's arguments."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    router_config: Any = RequestRouterConfig
    router_kwargs: dict[str, Any] = {}
    if options.router == "cache_aware":
        router_kwargs = {"index_name": index_name, **options.router_settings}
    scaling: dict[str, Any] = {"num_replicas": num_replicas}
    if num_replicas is None and options.autoscale is not None:  # our policy (scale/autoscale.py)
        scaling = {"autoscaling_config": options.autoscale.ray_config()}
    deployment: Any = serve.deployment
    return deployment(
        cls,
        name=REPLICAS_NAME,
        **scaling,
        ray_actor_options={"num_cpus": options.replica_cpus},
        max_ongoing_requests=options.max_ongoing_requests,
        health_check_period_s=2,
        # A replica removed gets no new requests and finishes its own (streams included), checked
        # every second, for up to drain_timeout_s; then its __del__ stops the engine (replica.py).
        graceful_shutdown_wait_loop_s=1.0,
        graceful_shutdown_timeout_s=options.drain_timeout_s,
        request_router_config=router_config(
            request_router_class=ROUTERS[options.router],
            request_router_kwargs=router_kwargs,
            request_routing_stats_period_s=options.stats_period_s,
        ),
    )


def ingress_deployment() -> Any:
    """The ingress's deployment; ``.bind(replicas, options, index_name)``."""
    from ray import serve

    deployment: Any = serve.deployment  # Ray's stubs type neither its overloads nor pydantic's fields
    return deployment(
        serve.ingress()(Ingress),
        name=INGRESS_NAME,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=1024,
    )


def run(
    options: ScaleOptions,
    host: str,
    port: int,
    blocking: bool = True,
    build: Callable[[ScaleOptions], Any] = build_application,
) -> None:
    """Start the application (``build(options)``: by default ``build_application``'s) on the
    connected Ray cluster with an HTTP proxy on ``host:port``."""
    from ray import serve

    serve.start(http_options={"host": host, "port": port})
    serve.run(build(options), name=APP_NAME, route_prefix="/", blocking=blocking)


def app_builder(args: dict[str, Any]) -> Any:
    """The application from a Serve config's ``args`` (KubeRay's RayService, ``serve run``):
    ``ScaleOptions`` fields, with ``config`` holding ``EngineConfig`` fields (docs/scaling.md)."""
    args = dict(args)
    config = EngineConfig(**args.pop("config", {}))
    if args.get("autoscale") is not None:  # a mapping of AutoscaleSettings fields
        args["autoscale"] = AutoscaleSettings.from_dict(args["autoscale"])
    known = set(ScaleOptions.__dataclass_fields__) - {"config"}
    unknown = set(args) - known
    if unknown:
        raise ValueError(f"unknown radixserve args {sorted(unknown)}; known: {sorted(known)}")
    return build_application(ScaleOptions(config, **args))
