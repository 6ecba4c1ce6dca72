"""Benchmarks of more than one engine: tensor parallelism, disaggregated prefill/decode, routers on
Ray Serve, autoscaling."""
