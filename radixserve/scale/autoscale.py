"""Autoscaling the engine replicas on queue wait and queue depth (Ray Serve's custom-policy API).

Ray Serve 2.60 lets a deployment name its own autoscaling policy (``AutoscalingPolicy(policy_function=
...)``) and feeds it each replica's ``record_autoscaling_stats`` (averaged over ``look_back_period_s``).
We use that rather than ``target_ongoing_requests``: ongoing requests are a poor proxy for a server that
batches 64 requests at once and whose cost per request varies with its cached prefix (a replica with 40
ongoing cache hits is fine, one with 4 long cold prefills may be queueing). The signal the production
guide scales on is the queue itself: how long requests wait before their first step, and how many wait.

The decision (``desired_replicas``, a pure function; ``QueueWaitPolicy`` is Ray's callable around it):
- **up** when the p95 queue wait of any replica passes ``target_queue_wait_s`` or the requests waiting
  (in the engines' queues and in Serve's, per replica) pass ``target_queue_depth``: to enough replicas for
  the waiting requests at ``target_queue_depth`` each, at least one more;
- **down by one** when nothing waits, the p95 wait is under a quarter of the target and the running
  requests would fill at most half of the replicas left (so the step down does not queue at once);
- else **hold**.
Ray applies ``upscale_delay_s`` / ``downscale_delay_s`` (a decision must hold that long before it is
carried out) and the ``min_replicas``/``max_replicas`` bounds around it.

Invariants: ``min_replicas <= max_replicas``, delays >= 0, thresholds > 0 (``AutoscaleSettings``
refuses anything else, naming the flag); the policy never returns fewer than 1 replica.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

# The names of the figures each replica reports (EngineReplica.record_autoscaling_stats).
QUEUE_WAIT_P95 = "queue_wait_p95_s"
QUEUE_DEPTH = "queue_depth"
RUNNING = "running"
CAPACITY = "capacity"


@dataclass(frozen=True)
class AutoscaleSettings:
    """``--replicas auto``'s settings; the reasons for each default are in docs/scaling.md."""

    min_replicas: int = 1
    max_replicas: int = 4
    upscale_delay_s: float = 30.0  # a burst must last this long before a replica is added
    downscale_delay_s: float = 600.0  # low load must last this long before one is removed
    target_queue_wait_s: float = 2.0  # p95 queue wait above this scales up
    target_queue_depth: float = 8.0  # waiting requests per replica above this scales up
    look_back_period_s: float = 30.0  # Ray averages each replica's figures over this window

    def __post_init__(self) -> None:
        if self.min_replicas < 1:
            raise ValueError(f"--min-replicas must be >= 1, got {self.min_replicas}")
        if self.max_replicas < self.min_replicas:
            raise ValueError(
                f"--min-replicas ({self.min_replicas}) must not exceed --max-replicas ({self.max_replicas})"
            )
        for flag, value in (
            ("--upscale-delay-s", self.upscale_delay_s),
            ("--downscale-delay-s", self.downscale_delay_s),
        ):
            if not value >= 0:  # also refuses NaN
                raise ValueError(f"{flag} must be >= 0 seconds, got {value}")
        for flag, value in (
            ("--target-queue-wait-s", self.target_queue_wait_s),
            ("--target-queue-depth", self.target_queue_depth),
            ("look_back_period_s", self.look_back_period_s),
        ):
            if not value > 0:
                raise ValueError(f"{flag} must be > 0, got {value}")

    def ray_config(self) -> dict[str, Any]:
        """The deployment's ``autoscaling_config``: our policy, Ray's delays and bounds."""
        return {
            "min_replicas": self.min_replicas,
            "max_replicas": self.max_replicas,
            "initial_replicas": self.min_replicas,
            "upscale_delay_s": self.upscale_delay_s,
            "downscale_delay_s": self.downscale_delay_s,
            "look_back_period_s": self.look_back_period_s,
            "policy": {
                "policy_function": f"{__name__}:QueueWaitPolicy",
                "policy_kwargs": {
                    "target_queue_wait_s": self.target_queue_wait_s,
                    "target_queue_depth": self.target_queue_depth,
                },
            },
        }

    @staticmethod
    def from_dict(values: Mapping[str, Any]) -> AutoscaleSettings:
        known = set(AutoscaleSettings.__dataclass_fields__)
        unknown = set(values) - known
        if unknown:
            raise ValueError(f"unknown autoscale settings {sorted(unknown)}; known: {sorted(known)}")
        return AutoscaleSettings(**values)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ReplicaLoad:
    """One replica's figures, as Ray averaged them over the look-back window."""

    queue_wait_p95_s: float = 0.0
    queue_depth: float = 0.0  # requests waiting in its engine
    running: float = 0.0  # requests its engine is running
    capacity: float = 1.0  # requests its engine runs at once (max_running_requests)


def desired_replicas(
    current: int,
    loads: list[ReplicaLoad],
    serve_queued: float,
    target_queue_wait_s: float,
    target_queue_depth: float,
) -> int:
    """The replica count the queue asks for (before Ray's delays and bounds). ``serve_queued`` is the
    requests held in Serve's handles, waiting for any replica to take them."""
    current = max(current, 1)
    if not loads:  # no replica has reported yet (starting): hold
        return current
    worst_wait = max(r.queue_wait_p95_s for r in loads)
    waiting = sum(r.queue_depth for r in loads) + serve_queued
    if worst_wait > target_queue_wait_s or waiting > target_queue_depth * current:
        return max(current + 1, math.ceil(waiting / target_queue_depth))
    running = sum(r.running for r in loads)
    capacity = sum(r.capacity for r in loads) / len(loads)
    quiet = waiting < 1 and worst_wait < target_queue_wait_s / 4
    if current > 1 and quiet and running <= 0.5 * capacity * (current - 1):
        return current - 1
    return current


class QueueWaitPolicy:
    """Ray Serve's custom autoscaling policy (``policy_function``): called by the controller every
    control-loop tick with an ``AutoscalingContext``; returns (replicas, policy state)."""

    def __init__(self, target_queue_wait_s: float = 2.0, target_queue_depth: float = 8.0) -> None:
        self.target_queue_wait_s = target_queue_wait_s
        self.target_queue_depth = target_queue_depth

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        metrics: dict[str, dict[Any, float]] = ctx.aggregated_metrics or {}
        loads = [
            ReplicaLoad(
                float(metrics.get(QUEUE_WAIT_P95, {}).get(r, 0.0)),
                float(metrics.get(QUEUE_DEPTH, {}).get(r, 0.0)),
                float(metrics.get(RUNNING, {}).get(r, 0.0)),
                float(metrics.get(CAPACITY, {}).get(r, 1.0)),
            )
            for r in ctx.running_replicas
            if r in metrics.get(QUEUE_DEPTH, {})
        ]
        queued = float(ctx.total_queued_requests or 0.0)
        n = desired_replicas(
            ctx.current_num_replicas, loads, queued, self.target_queue_wait_s, self.target_queue_depth
        )
        return n, dict(ctx.policy_state)


class QueueWaits:
    """A replica's recent queue waits (arrival to first scheduled), for its p95 over a window.

    ``p95`` also counts the requests still waiting at their current age: a queue that schedules
    nothing must still read as a long wait."""

    def __init__(self, window_s: float = 30.0, max_samples: int = 4096) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)  # (finished at, wait)

    def add(self, now: float, wait_s: float) -> None:
        self._samples.append((now, wait_s))

    def p95(self, now: float, waiting_ages: list[float] | None = None) -> float:
        while self._samples and now - self._samples[0][0] > self.window_s:
            self._samples.popleft()
        waits = sorted([w for _, w in self._samples] + list(waiting_ages or []))
        if not waits:
            return 0.0
        return waits[min(len(waits) - 1, math.ceil(0.95 * len(waits)) - 1)]
