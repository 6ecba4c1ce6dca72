"""Benchmarks for radixserve: a load generator for OpenAI-compatible servers (``serve_bench``),
reproducible workloads from real prose (``workloads``), metric arithmetic (``metrics``), plots
(``plots``) and the side-by-side comparison with peer engines (``compare``). See docs/benchmarks.md."""
