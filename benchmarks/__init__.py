"""Benchmarks for radixserve, by job: scripts (one measurement each, run as ``python -m
benchmarks.<script>``) over shared library modules (the server launcher ``servers``, the result
writer in ``common``, the load generator ``loadgen``, ``workloads``, ``metrics``, ``plots``, ...).
Scripts import libraries, never each other. See benchmarks/README.md and docs/benchmarks.md."""
