"""Benchmarks of one engine step and of the engine in-process: steps against the machine's limits,
modes, the native step, two commits' builds, the engine's throughput, the preset's measurements."""
