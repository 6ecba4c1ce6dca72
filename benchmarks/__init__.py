"""Benchmarks for radixserve, grouped by job: ``step`` (one engine step, the engine in-process),
``serving`` (served requests), ``scale`` (several engines), ``soak`` (the chaos soak), ``kernels``
(single kernels), each script run as ``python -m benchmarks.<job>.<script>``, over the shared
libraries of ``lib`` (the server launcher ``servers``, the result writer in ``common``, the load
generator ``loadgen``, ``workloads``, ``metrics``, ``plots``, ...). Scripts import libraries (and their
own folder's parts), never each other. See benchmarks/README.md and docs/benchmarks.md."""
