"""Disaggregated serving on Ray Serve (``radixserve serve --prefill-replicas N --decode-replicas M``).

Two engine deployments and the usual ingress. The ingress and its router are scale-out's, unchanged
(scale/app.py, scale/remote_engine.py): requests go to the decode replicas, cache-aware. A decode
replica is an ``EngineReplica`` whose engine process runs the decode role; when it reserves pages for
a prompt (``KVReserved``) the replica itself asks a prefill replica, through a DeploymentHandle, to
compute and send them. Pages travel over ZMQ TCP from the prefill replica's engine process straight to
the decode replica's, on the decode replica's node address; Ray carries only the small messages.

Invariants:
- A prefill call that fails (its replica died: a RayError; or it answered with an error) is made again,
  at most ``MAX_ATTEMPTS`` times in all (the prefill dispatcher: disagg/dispatch.py); then the decode
  engine is told to free the reservation and fail the request (a 503). The decode engine's own timeout
  ends any transfer nobody finishes.
- A prefill replica answers each ``PrefillKV`` with the ``PrefillDone`` of its engine process, or with
  an error one if that process died or did not answer within ``PREFILL_TIMEOUT_S``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from radixserve.config import EngineConfig
from radixserve.disagg.dispatch import prefill_job, run_prefill
from radixserve.disagg.metrics import TransferMetrics
from radixserve.disagg.process import role_command
from radixserve.runtime.async_engine import AsyncEngine
from radixserve.runtime.engine_client import describe_exit
from radixserve.runtime.messages import (
    Abort,
    CancelTransfer,
    FromEngine,
    KVReceived,
    KVReserved,
    PrefillDone,
    PrefillKV,
)
from radixserve.scale.app import ScaleOptions, engine_deployment, ingress_deployment
from radixserve.scale.launch import run_scaled
from radixserve.scale.replica import EngineReplica, GenerateCall, StreamItem

logger = logging.getLogger("radixserve.disagg")

PREFILL_NAME = "PrefillReplicas"
PREFILL_TIMEOUT_S = 120.0


class PrefillReplica:
    """One prefill engine process as a Serve replica: ``prefill`` runs one job to its end."""

    async def __init__(self, config: EngineConfig, engine_threads: int | None = None) -> None:  # type: ignore[misc]
        self.engine = AsyncEngine(
            config, engine_threads=engine_threads, process_args=role_command("prefill", "tcp")
        )
        self._waiting: dict[str, asyncio.Future[PrefillDone]] = {}
        self.engine.on_role_message = self._on_message
        self.engine.on_engine_exit = self._on_exit
        self.engine.has_role_work = lambda: bool(self._waiting)  # its jobs: a stuck one is hung
        await self.engine.start()

    async def prefill(self, msg: PrefillKV) -> PrefillDone:
        future: asyncio.Future[PrefillDone] = asyncio.get_running_loop().create_future()
        self._waiting[msg.request_id] = future
        try:
            if not self.engine.send(msg):
                return PrefillDone(
                    request_id=msg.request_id, pages=0, bytes=0, error="no prefill engine process"
                )
            return await asyncio.wait_for(future, PREFILL_TIMEOUT_S)
        except asyncio.TimeoutError:
            self.engine.send(Abort(request_id=msg.request_id))  # the engine drops the job
            return PrefillDone(request_id=msg.request_id, pages=0, bytes=0, error="the prefill timed out")
        except asyncio.CancelledError:  # the caller went away (its request's stream ended)
            self.engine.send(Abort(request_id=msg.request_id))
            raise
        finally:
            self._waiting.pop(msg.request_id, None)

    def check_health(self) -> None:
        if not self.engine.healthy:
            raise RuntimeError("the prefill engine process is not serving")

    def _on_message(self, msg: FromEngine) -> None:
        if isinstance(msg, PrefillDone):
            future = self._waiting.get(msg.request_id)
            if future is not None and not future.done():
                future.set_result(msg)

    def _on_exit(self, code: int) -> None:
        for rid, future in self._waiting.items():
            if not future.done():
                error = f"the prefill engine died mid-transfer ({describe_exit(code)})"
                future.set_result(PrefillDone(request_id=rid, pages=0, bytes=0, error=error))


class DecodeReplica(EngineReplica):
    """An engine replica in the decode role, which has its prompts' pages computed by ``prefill``
    (a handle to the prefill replicas)."""

    async def __init__(  # type: ignore[misc]
        self,
        config: EngineConfig,
        index_name: str,
        engine_threads: int | None,
        chat_template: str | None,
        prefill: Any,
        kv_timeout_s: float = 120.0,
    ) -> None:
        import ray

        host = ray.util.get_node_ip_address()
        args = role_command("decode", "tcp", host, kv_timeout_s)
        self._prefill = RayPrefill(prefill)
        self._calls: dict[str, GenerateCall] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.metrics = TransferMetrics()
        await super().__init__(config, index_name, engine_threads, chat_template, process_args=args)
        self.engine.on_role_message = self._on_role_message

    async def generate(self, call: GenerateCall) -> AsyncIterator[StreamItem]:
        self._calls[call.request_id] = call
        try:
            async for item in super().generate(call):
                yield item
        finally:
            self._calls.pop(call.request_id, None)

    def _on_role_message(self, msg: FromEngine) -> None:
        if isinstance(msg, KVReserved):
            call = self._calls.get(msg.request_id)
            if call is not None:
                task = asyncio.create_task(self._run_prefill(call, msg))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        elif isinstance(msg, KVReceived):
            self.metrics.received(msg.pages, msg.bytes, 0, msg.chunk_seconds)

    async def _run_prefill(self, call: GenerateCall, r: KVReserved) -> None:
        job = prefill_job(r, call.route.token_ids, call.route.cache_salt, call.priority)
        cause = await run_prefill(job, self._prefill, self.metrics, lambda: r.request_id in self._calls)
        if cause is not None:
            self.engine.send(CancelTransfer(request_id=r.request_id, message=cause))


class RayPrefill:
    """The prefill replicas behind a DeploymentHandle, as the dispatcher's pool: Serve's router picks
    the replica, so every attempt is one more call through the handle."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    async def pick(self, tried: set[str]) -> str | None:
        return "any"

    async def prefill(self, engine: str, job: PrefillKV) -> str | None:
        from ray.exceptions import RayError

        try:
            done = await self.handle.prefill.remote(job)
        except RayError as exc:
            return f"the prefill replica failed: {type(exc).__name__}"
        return None if done.error is None else f"the prefill engine failed: {done.error}"


def build_disaggregated_application(
    options: ScaleOptions,
    num_prefill: int,
    num_decode: int,
    index_name: str | None = None,
    kv_timeout_s: float = 120.0,
) -> Any:
    """The bound Serve application: the ingress over ``num_decode`` decode replicas, which call
    ``num_prefill`` prefill replicas."""
    from ray import serve

    if not options.config.prefix_cache:
        raise ValueError("disaggregated serving needs the prefix cache: pages move between radix trees")
    index_name = index_name or options.index_name
    deployment: Any = serve.deployment  # Ray's stubs type neither its overloads nor pydantic's fields
    prefill = deployment(
        PrefillReplica,
        name=PREFILL_NAME,
        num_replicas=num_prefill,
        ray_actor_options={"num_cpus": options.replica_cpus},
        max_ongoing_requests=options.max_ongoing_requests,
        health_check_period_s=2,
    ).bind(options.config, options.threads)
    decode = engine_deployment(options, DecodeReplica, index_name, num_decode).bind(
        options.config, index_name, options.threads, options.chat_template, prefill, kv_timeout_s
    )
    return ingress_deployment().bind(decode, options, index_name)


def run_disaggregated(args: argparse.Namespace, address: str | None) -> None:
    """``--prefill-replicas N --decode-replicas M`` (radixserve/topology.py checked the counts):
    scale-out's launch with this application."""
    num_prefill, num_decode = args.prefill_replicas, args.decode_replicas

    def build(options: ScaleOptions) -> Any:
        return build_disaggregated_application(options, num_prefill, num_decode, kv_timeout_s=args.kv_timeout)

    run_scaled(args, address, build, num_prefill + num_decode)
