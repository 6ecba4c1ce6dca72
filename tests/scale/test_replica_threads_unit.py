"""A replica's engine takes the CPUs Ray reserved for it as its torch threads, not one per core of the
machine: two replicas on 2 cores each took 2, and their threads preempted each other at every
barrier of a step (docs/scaling.md)."""

from __future__ import annotations

from radixserve.config import EngineConfig
from radixserve.scale.app import ScaleOptions


def test_a_replicas_engine_threads_are_its_reserved_cpus_unless_given() -> None:
    config = EngineConfig("unused")
    assert ScaleOptions(config).threads == 1  # --replica-cpus defaults to 1
    assert ScaleOptions(config, replica_cpus=2.5).threads == 2
    assert ScaleOptions(config, replica_cpus=0.5).threads == 1  # at least one
    assert ScaleOptions(config, replica_cpus=1.0, engine_threads=3).threads == 3  # --engine-threads wins
