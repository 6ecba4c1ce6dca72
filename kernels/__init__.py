"""Attention and KV-page kernels (imported as ``radixserve.kernels``).

``reference`` holds pure-torch versions, which are also the CPU path. Triton versions with the same
signatures live beside them and are chosen by ``radixserve.model.attention`` on CUDA tensors.
"""
