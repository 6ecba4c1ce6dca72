"""Benchmarks of served requests: a server under load over HTTP, the comparison with peers, accuracy
through the API, and the prefix cache, KV tiers, pinning, speculation, DSL and scoring."""
