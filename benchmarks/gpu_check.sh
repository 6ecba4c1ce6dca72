#!/usr/bin/env bash
# The GPU checks, as one run on a machine with a CUDA GPU: the Triton kernel tests natively (not in the
# interpreter CI uses), the kernel benchmark (benchmarks/kernels/kernels_gpu.py) and the engine beside HF
# generate (benchmarks/step/gpu_engine.py, bf16 with a profile, and float32). Everything lands in $OUT
# (default /tmp/gpu-check): one log, and the benchmarks' JSON and Markdown.
#
# Needs python3 with torch (CUDA) and triton; msgspec and llguidance as wheels in .whl/ where that
# python lacks them; SmolLM2's tokenizer files in .gpu/tokenizer (from the default model's folder, which
# `make model` writes). The C++ CPU kernels are not built there (RADIXSERVE_CPU_KERNELS=0).
set -u
out=${OUT:-/tmp/gpu-check}
mkdir -p "$out"
log=$out/gpu_check.log
export PYTHONUNBUFFERED=1 RADIXSERVE_CPU_KERNELS=0 PYTHONPATH=$PWD  # absolute: test_kernel_aot runs python elsewhere
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
step() {  # step NAME SECONDS COMMAND...: run one check under a time limit, its output into the log
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  echo "=== $name" >>"$log"
  timeout "$limit" "$@" >>"$log" 2>&1
  echo "=== $name: rc=$? in $((SECONDS - start)) s" | tee -a "$log"
}
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  lscpu | grep -E "Model name|^CPU\(s\)"
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} >>"$log" 2>&1
parallel=()  # pytest-xdist where it is installed: 8 workers compile the kernels' variants at once
python3 -c "import xdist" 2>/dev/null && parallel=(-n 8)
step kernel-tests 120 python3 -m pytest -q -rs -p no:cacheprovider "${parallel[@]}" \
  tests/kernels/test_kernel_gpu.py tests/kernels/test_kernel_decode.py tests/kernels/test_kernel_extend.py \
  tests/kernels/test_kernel_kv_ops.py tests/kernels/test_kernel_triton_int8.py \
  tests/kernels/test_kernel_engine.py tests/kernels/test_kernel_aot.py
# the graph-safe decode step and its CUDA graphs: capture, replay == eager, no sync (its log line has
# the capture's time and memory pool)
step graph-tests 120 python3 -m pytest -q -rs -p no:cacheprovider -o log_cli=true --log-cli-level=INFO \
  tests/model/test_graph_step.py tests/kernels/test_kernel_graph_step.py
step kernels-bench 60 python3 -m benchmarks.kernels.kernels_gpu
cp benchmarks/results/kernels_gpu.json benchmarks/results/kernels_gpu.md "$out/" 2>>"$log"
step engine-bench 200 python3 -m benchmarks.step.gpu_engine --tokenizer-dir .gpu/tokenizer --out-dir "$out" --profile
# float32, the exact mode: does the Triton backend pick the reference's greedy tokens at real shapes?
step engine-fp32 160 python3 -m benchmarks.step.gpu_engine --tokenizer-dir .gpu/tokenizer --out-dir "$out" \
  --dtype float32 --batches 1 32 --new-tokens 64 --name gpu_engine_fp32
tail -n 5 "$log"
