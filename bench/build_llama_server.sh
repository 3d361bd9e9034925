#!/usr/bin/env bash
# Builds llama.cpp's own `llama-server` (the CPU peer of bench/peers.py) from the llama.cpp vendored in the
# llama-cpp-python source distribution, and writes an f32 GGUF of an HF folder with llama.cpp's own converter.
# Everything is cached under $LLAMA_CACHE; a second run with the binary and the GGUF present does nothing.
#
#   bench/build_llama_server.sh [HF_FOLDER]      # HF_FOLDER defaults to the SmolLM2 folder of `make smollm2`
#
# Environment: LLAMA_CACHE (default ~/.cache/trainserve/llama.cpp), PYTHON (the venv with torch and gguf),
# JOBS (make -j, default 2), NICE (default 19: the build yields the CPU to everything else on a shared machine).
set -euo pipefail

CACHE="${LLAMA_CACHE:-$HOME/.cache/trainserve/llama.cpp}"
PYTHON="${PYTHON:-python3}"
JOBS="${JOBS:-2}"
NICE="${NICE:-19}"
HF_FOLDER="${1:-$HOME/.cache/trainserve/smollm2-135m-instruct}"
SERVER="$CACHE/bin/llama-server"
mkdir -p "$CACHE"

if [ ! -x "$SERVER" ]; then
    if ! ls "$CACHE"/llama_cpp_python-*/vendor/llama.cpp/CMakeLists.txt >/dev/null 2>&1; then
        # The source distribution only (--no-binary): its vendor/llama.cpp is the tree llama-cpp-python builds.
        "$PYTHON" -m pip download llama-cpp-python --no-binary :all: --no-deps -q -d "$CACHE/dl"
        tar -xzf "$(ls "$CACHE"/dl/llama_cpp_python-*.tar.gz | tail -n 1)" -C "$CACHE"
    fi
    SRC="$(dirname "$(ls "$CACHE"/llama_cpp_python-*/vendor/llama.cpp/CMakeLists.txt | tail -n 1)")"
    # No curl (the benchmark loads a local file), no GPU backends, native CPU code: what a CPU user builds.
    nice -n "$NICE" cmake -S "$SRC" -B "$CACHE/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
        -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
    nice -n "$NICE" cmake --build "$CACHE/build" --target llama-server -j "$JOBS"
    mkdir -p "$CACHE/bin"
    cp "$CACHE/build/bin/llama-server" "$SERVER"
    ln -sfn "$SRC" "$CACHE/src"
fi
echo "llama-server: $SERVER"

if [ -d "$HF_FOLDER" ]; then
    GGUF="$CACHE/$(basename "$HF_FOLDER")-f32.gguf"
    if [ ! -s "$GGUF" ]; then
        # llama.cpp's own converter, from the same tree; it needs the gguf-py shipped beside it.
        PYTHONPATH="$CACHE/src/gguf-py${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" "$CACHE/src/convert_hf_to_gguf.py" \
            "$HF_FOLDER" --outtype f32 --outfile "$GGUF.tmp"
        mv "$GGUF.tmp" "$GGUF"
    fi
    echo "gguf: $GGUF"
else
    echo "no HF folder at $HF_FOLDER: run 'make smollm2' first for the GGUF" >&2
fi
