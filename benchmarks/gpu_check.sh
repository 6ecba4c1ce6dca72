#!/usr/bin/env bash
# The GPU checks, as one run on a machine with a CUDA GPU, in under 8 minutes (GPU_CHECK_BUDGET, 460 s:
# no step starts with less than 10 s of it left, and each runs at most its own limit or what is left):
# - the Triton kernel tests natively (not in the interpreter CI uses), the graph-safe step's tests;
# - the kernel benchmark (benchmarks/kernels/kernels_gpu.py);
# - the engine beside HF generate (benchmarks/step/gpu_engine.py, bf16 with a profile, and float32);
# - issue 56's figures (benchmarks/step/gpu_decode.py, one part a step): CUDA graphs on and off in
#   float32 at both shapes, with the capture's time and memory; decode tok/s at batch 1, 8, 32 and
#   128, bf16, the overlapped loop on and off, as a share of the HBM byte limit against a measured
#   device-to-device copy; a prefix hit from the host tier into HBM against a pinned copy and against
#   recomputing it; `radixserve serve` over HTTP (TTFT and ITL beside the engine's step).
# Into $OUT (default /tmp/gpu-check), three files, whatever the machine sends back (at most 8):
# gpu_check.log (every step's output and its time), gpu_check.md (every result's Markdown, in order)
# and gpu_check-results.tar.gz (the results' JSON and Markdown, the server's log), remade after each
# step so that a cut-off run keeps what it finished. The models are written once into $MODELS.
#
# Needs python3 with torch (CUDA) and triton; as wheels in .whl/ where that python lacks them (the GPU
# image has httpx, tqdm, transformers, prometheus_client): msgspec and llguidance, and for the server
# pyzmq, starlette and uvicorn. SmolLM2's tokenizer files in .gpu/tokenizer (from the default model's
# folder, which `make model` writes). Both prepared here, on a machine with the registry, git-ignored:
#   echo /.whl/ >>.git/info/exclude; echo /.gpu/ >>.git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl msgspec==0.23.0 llguidance==1.9.1 pyzmq==27.3.0 starlette==1.10.0 uvicorn==0.55.0
#   d=$(python3 -m radixserve.cli prepare-model | tail -n 1); mkdir -p .gpu/tokenizer
#   cp "$d"/{tokenizer.json,tokenizer_config.json,chat_template.jinja,generation_config.json} .gpu/tokenizer/
# (the versions: this project's environment's). The C++ CPU kernels are not built there
# (RADIXSERVE_CPU_KERNELS=0).
set -u
out=${OUT:-/tmp/gpu-check}
res=${RESULTS_DIR:-/tmp/gpu-check-results}  # outside $OUT: only the bundle goes back
models=${MODELS:-/tmp/gpu-models}
budget=${GPU_CHECK_BUDGET:-460}
mkdir -p "$out" "$res"
log=$out/gpu_check.log
export PYTHONUNBUFFERED=1 RADIXSERVE_CPU_KERNELS=0 PYTHONPATH=$PWD  # absolute: test_kernel_aot runs python elsewhere
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
bundle() {  # the results so far, into $OUT
  cat "$res"/*.md >"$out/gpu_check.md" 2>/dev/null
  tar czf "$out/gpu_check-results.tar.gz" -C "$res" . 2>>"$log"
}
step() {  # step NAME SECONDS COMMAND...: run one check under a time limit, its output into the log
  local name=$1 limit=$2 start=$SECONDS left=$((budget - SECONDS))
  shift 2
  if ((left < 10)); then
    echo "=== $name: skipped, $left s of the ${budget} s budget left" | tee -a "$log"
    return
  fi
  ((limit > left)) && limit=$left
  echo "=== $name (limit $limit s)" >>"$log"
  timeout "$limit" "$@" >>"$log" 2>&1
  echo "=== $name: rc=$? in $((SECONDS - start)) s" | tee -a "$log"
  bundle
}
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  lscpu | grep -E "Model name|^CPU\(s\)"
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} >>"$log" 2>&1
parallel=()  # pytest-xdist where it is installed: 8 workers compile the kernels' variants at once
python3 -c "import xdist" 2>/dev/null && parallel=(-n 8)
step kernel-tests 75 python3 -m pytest -q -rs -p no:cacheprovider "${parallel[@]}" \
  tests/kernels/test_kernel_gpu.py tests/kernels/test_kernel_decode.py tests/kernels/test_kernel_extend.py \
  tests/kernels/test_kernel_kv_ops.py tests/kernels/test_kernel_triton_int8.py \
  tests/kernels/test_kernel_engine.py tests/kernels/test_kernel_aot.py
# the graph-safe decode step and its CUDA graphs: capture, replay == eager, no sync (its log line has
# the capture's time and memory pool)
step graph-tests 35 python3 -m pytest -q -rs -p no:cacheprovider -o log_cli=true --log-cli-level=INFO \
  tests/model/test_graph_step.py tests/kernels/test_kernel_graph_step.py
step kernels-bench 15 python3 -m benchmarks.kernels.kernels_gpu
cp benchmarks/results/kernels_gpu.json benchmarks/results/kernels_gpu.md "$res/" 2>>"$log"
shared=(--tokenizer-dir .gpu/tokenizer --models-dir "$models" --out-dir "$res")
# the engine beside HF generate (its first run writes both shapes' folders, ~10 s)
step engine-bench 80 python3 -m benchmarks.step.gpu_engine "${shared[@]}" --profile \
  --batches 1 32 --new-tokens 32 --prefill-len 1000
# float32, the exact mode: does the Triton backend pick the reference's greedy tokens at real shapes?
step engine-fp32 40 python3 -m benchmarks.step.gpu_engine "${shared[@]}" \
  --dtype float32 --batches 1 --new-tokens 32 --prefill-len 1000 --name gpu_engine_fp32
# issue 56: graphs on/off (float32), decode and the byte limit (bf16), the host tier, the server
step graphs-fp32 45 python3 -m benchmarks.step.gpu_decode "${shared[@]}" --parts graphs
step decode-bf16 70 python3 -m benchmarks.step.gpu_decode "${shared[@]}" --parts decode
step host-tier 35 python3 -m benchmarks.step.gpu_decode "${shared[@]}" --parts tier
step http-serve 55 python3 -m benchmarks.step.gpu_decode "${shared[@]}" --parts http
echo "=== total: $SECONDS s" | tee -a "$log"
bundle
tail -n 5 "$log"
