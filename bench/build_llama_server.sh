#!/usr/bin/env bash
# Builds llama.cpp's own `llama-server` (the CPU peer of bench/peers.py) and `llama-quantize` from the llama.cpp
# vendored in the llama-cpp-python source distribution, and writes GGUFs of an HF folder at the precisions a user
# picks: f32, f16 and Q8_0 with llama.cpp's own converter, Q4_K_M with llama-quantize from the f32 file (tensors
# whose rows are not a multiple of 256, as SmolLM2's 576, take llama-quantize's own fallback type: what a user
# gets). Everything is cached under $LLAMA_CACHE; a second run with the binaries and the GGUFs present does nothing.
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
QUANTIZE="$CACHE/bin/llama-quantize"
mkdir -p "$CACHE"

if [ ! -x "$SERVER" ] || [ ! -x "$QUANTIZE" ]; then
    if ! ls "$CACHE"/llama_cpp_python-*/vendor/llama.cpp/CMakeLists.txt >/dev/null 2>&1; then
        # The source distribution only (--no-binary): its vendor/llama.cpp is the tree llama-cpp-python builds.
        "$PYTHON" -m pip download llama-cpp-python --no-binary :all: --no-deps -q -d "$CACHE/dl"
        tar -xzf "$(ls "$CACHE"/dl/llama_cpp_python-*.tar.gz | tail -n 1)" -C "$CACHE"
    fi
    SRC="$(dirname "$(ls "$CACHE"/llama_cpp_python-*/vendor/llama.cpp/CMakeLists.txt | tail -n 1)")"
    # No curl (the benchmark loads a local file), no GPU backends, native CPU code: what a CPU user builds.
    nice -n "$NICE" cmake -S "$SRC" -B "$CACHE/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
        -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
    nice -n "$NICE" cmake --build "$CACHE/build" --target llama-server llama-quantize -j "$JOBS"
    mkdir -p "$CACHE/bin"
    cp "$CACHE/build/bin/llama-server" "$SERVER"
    cp "$CACHE/build/bin/llama-quantize" "$QUANTIZE"
    ln -sfn "$SRC" "$CACHE/src"
fi
echo "llama-server: $SERVER"

if [ -d "$HF_FOLDER" ]; then
    BASE="$CACHE/$(basename "$HF_FOLDER")"
    for TYPE in f32 f16 q8_0; do
        if [ ! -s "$BASE-$TYPE.gguf" ]; then
            # llama.cpp's own converter, from the same tree; it needs the gguf-py shipped beside it.
            PYTHONPATH="$CACHE/src/gguf-py${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" "$CACHE/src/convert_hf_to_gguf.py" \
                "$HF_FOLDER" --outtype "$TYPE" --outfile "$BASE-$TYPE.gguf.tmp"
            mv "$BASE-$TYPE.gguf.tmp" "$BASE-$TYPE.gguf"
        fi
    done
    if [ ! -s "$BASE-q4_k_m.gguf" ]; then
        "$QUANTIZE" "$BASE-f32.gguf" "$BASE-q4_k_m.gguf.tmp" Q4_K_M
        mv "$BASE-q4_k_m.gguf.tmp" "$BASE-q4_k_m.gguf"
    fi
    echo "ggufs: $BASE-{f32,f16,q8_0,q4_k_m}.gguf"
else
    echo "no HF folder at $HF_FOLDER: run 'make smollm2' first for the GGUFs" >&2
fi
