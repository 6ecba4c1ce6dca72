"""The benchmarks' shared libraries (no command lines): timing and the result writer, the server
launcher, the load generator, workloads, metrics, plots, the modes, the step runner, accuracy."""
