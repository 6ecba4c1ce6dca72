"""Attention and KV-page kernels (imported as ``radixserve.kernels``).

``reference`` holds pure-torch versions, the ground truth of the tests. ``cpu`` holds C++ versions
for CPU tensors (sources in ``csrc/``, built on first use by ``cpu_build``), Triton versions for
CUDA live beside them; all have the same signatures, and ``radixserve.model.attention`` picks one.
"""
