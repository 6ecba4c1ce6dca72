"""Attention, KV-page and linear kernels (imported as ``radixserve.kernels``).

- Attention and KV pages: ``reference`` holds pure-torch versions, the ground truth of the tests;
  ``cpu`` C++ versions for CPU tensors; Triton versions for CUDA live beside them. All have the same
  signatures, and ``radixserve.model.attention`` picks one.
- Linear products (C++, CPU): the few-row fp32/bf16 and int8 products (``csrc/gemv.cpp``,
  ``csrc/dense_rows.h``), the row-count choice of a dense Linear (``csrc/linear.cpp``), GGUF block
  products (``csrc/gguf_linear.cpp``, ``csrc/block_rows.h``, ``csrc/block_decode.h``), and the native
  decode step that runs every decoder layer of a decode step in one call (``csrc/native_step.cpp``);
  the model's weight objects (``radixserve.model.layers``, ``quant``, ``gguf``) call them.

Every C++ source in ``csrc/`` is built on first use by ``cpu_build``, into one library.
"""
