"""Benchmarks of single kernels: CPU attention, many-row and few-row products, products over GGUF
blocks, the Triton kernels on a GPU."""
