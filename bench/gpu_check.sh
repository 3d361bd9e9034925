#!/usr/bin/env bash
# GPU check, one prepared run that fits 8 minutes on one lent GPU (a total budget, GPU_CHECK_BUDGET, 420 s of parts;
# each part also has its own limit; parts run most important first and those the budget does not reach are
# listed as skipped):
#   1. the fine-tuning engine vs HF Trainer (group_by_length, fused AdamW, the same precision) on a BERT-base
#      shaped model (BertConfig defaults, random weights) at sequence length 128, bf16 and fp16, with model
#      FLOPs utilisation against the GPU's dense peak: 313 timed steps per run after an untimed warm-up, both
#      sides timed over the same window (inside training steps), the order rotating each round;
#   2. generation tokens/s at 1, 32 and 128 concurrent requests: the engine vs sequential and batched
#      `model.generate` (GPT-2 small shape, bf16), with the engine's time to first token;
#   3. `trainserve worker --device cuda:N` sees exactly that GPU (and --device cpu none);
#   4. decode steps as CUDA graphs (TRAINSERVE_CUDA_GRAPHS, worker/engines/serving/runners/cuda_graphs.py): the engine's tokens/s at
#      1 and 32 concurrent requests with graphs on and off, greedy outputs compared, graphs captured (GPT-2 small
#      shape, bf16; the smoke run takes the same padded step uncaptured on the CPU).
# Prints one table; writes it and the details (JSON, the full log) under $OUT when set (part 4's JSON stays in
# the work folder: $OUT already holds 8 files, the device tool's limit; the table and the log carry its figures).
# Every part runs under a time limit (GPU_CHECK_PART_TIMEOUT, 150 s) and the table (summary.txt) is rewritten
# after each part, the fine-tune JSON after each run, so a run cut short still reports what it measured.
#
#   bash bench/gpu_check.sh           # on the GPU; carry .whl made by bench/gpu_wheels.sh (see docs/benchmarks/index.md)
#   bash bench/gpu_check.sh --smoke   # or GPU_CHECK_SMOKE=1: everything shrunk, on the CPU, in the device's package
#                                     # set (a Python 3.12 with torch, the image's packages and the carried wheels)
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 1
SMOKE=${GPU_CHECK_SMOKE:-0}
[[ "${1:-}" == "--smoke" ]] && SMOKE=1
DEST=${OUT:-$(mktemp -d /tmp/gpu-check.XXXXXX)}
WORK=$(mktemp -d /tmp/gpu-check-work.XXXXXX)
mkdir -p "$DEST"
LOG="$DEST/log.txt"
# On the device: python3, the image's (it holds CUDA torch). The smoke run imports exactly what the device will: a
# Python 3.12 of its own (cached under ~/.cache/trainserve/gpu-image) with torch 2.13.0 and only the image's
# packages the check needs (bench/gpu_packages.py), the wheels of bench/gpu_wheels.sh installed over it
# as below; PYTHON overrides either.
PY=${PYTHON:-python3}
if [[ $SMOKE == 1 && -z "${PYTHON:-}" ]]; then
  bash bench/gpu_wheels.sh > /dev/null || { echo "FAILED: bench/gpu_wheels.sh"; exit 1; }
  IMAGE_ENV=${GPU_CHECK_IMAGE_ENV:-$HOME/.cache/trainserve/gpu-image}
  NEEDS=$(.venv/bin/python bench/gpu_packages.py image-requirements .whl | tr '\n' ' ')
  if [[ ! -x "$IMAGE_ENV/bin/python" || "$(cat "$IMAGE_ENV/.needs" 2>/dev/null)" != "$NEEDS" ]]; then
    PY312=$(for p in python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do
      "$p" --version > /dev/null 2>&1 && { echo "$p"; break; }; done)
    [[ -n "$PY312" ]] || { echo "FAILED: the smoke run needs a Python 3.12 (the device's)"; exit 1; }
    rm -rf "$IMAGE_ENV" && "$PY312" -m venv "$IMAGE_ENV" || exit 1
    "$IMAGE_ENV/bin/python" -m pip install -q torch==2.13.0 $NEEDS || exit 1
    echo "$NEEDS" > "$IMAGE_ENV/.needs"
  fi
  PY=$IMAGE_ENV/bin/python
fi

# The device image has torch but not this project's pins (transformers 5, huggingface-hub 1.x) nor datasets,
# pydantic, llguidance and peft: bench/gpu_wheels.sh downloads them here as .whl/, installed without the network.
if compgen -G ".whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" \
    .whl/*.whl || exit 1
  export PYTHONPATH="$WORK/site"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
VOCAB=()
[[ -f .whl/vocab.txt ]] && VOCAB=(--vocab .whl/vocab.txt)

if [[ $SMOKE == 1 ]]; then
  DEVICE=cpu PRECISIONS="bf16" CONCURRENCY="1 2 4" SEQUENTIAL=2 GRAPHS_CONCURRENCY="2"
  FINETUNE=(--model-config bert-mini --rows 64 --max-steps 2 --warmup-steps 1 --repeats 1 --max-length 32
            --batch-size 8 --concat-rows 4 --dev "$WORK/dev.tsv")
  PART_TIMEOUT=300
  GENERATE=(--layers 1 --max-new-tokens 4 --precision fp32)
  head -n 65 examples/data/sst2_dev.tsv > "$WORK/dev.tsv"
else
  DEVICE=cuda PRECISIONS="bf16 fp16" CONCURRENCY="1 32 128" SEQUENTIAL=8 GRAPHS_CONCURRENCY="1 32"
  # 4,000 joined rows (row i: sentences i..i+9, about 128 tokens) are 63 steps of 64 per epoch: 5 epochs time 313
  # steps per run, after 20 untimed warm-up steps per side (CUDA context, kernels, cuBLAS heuristics).
  FINETUNE=(--model-config bert-base --rows 4000 --epochs 5 --warmup-steps 20 --repeats 3 --max-length 128
            --batch-size 64 --concat-rows 10)
  PART_TIMEOUT=${GPU_CHECK_PART_TIMEOUT:-120}  # seconds per part: one slow part cannot take the others' time
  GENERATE=(--layers 12 --max-new-tokens 64 --precision bf16)
fi

{
  echo "gpu check $(date -u +%Y-%m-%dT%H:%MZ)$([[ $SMOKE == 1 ]] && echo ' (smoke: CPU, shrunk)')"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  "$PY" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__)"
} > "$WORK/env.txt" 2>&1
cat "$WORK/env.txt" | tee "$LOG"
# Preflight: every script the parts run imports in this environment (a module missing from the image and from
# .whl/ fails here in seconds, named, instead of failing each part after its model is built).
if ! "$PY" -c "import bench.finetune, bench.generate_engine, bench.device_pin_check" >> "$LOG" 2>&1; then
  tail -n 3 "$LOG"
  echo "FAILED: preflight (a module above is missing: add its distribution to bench/gpu_wheels.sh's PACKAGES)"
  exit 1
fi
GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n1)
# Dense (no sparsity) bf16/fp16 tensor-core peaks from NVIDIA's datasheets (half the sparse figure); 0 leaves MFU
# out. The PCIe and NVL boards run lower clocks than the SXM ones ("NVIDIA H100 80GB HBM3", "NVIDIA H200").
case "$GPU_NAME" in
  *H100*PCIe*) PEAK=756.0 ;;
  *H100*NVL*|*H200*NVL*) PEAK=835.5 ;;
  *H100*|*H200*) PEAK=989.4 ;;
  *A100*) PEAK=312 ;;
  *L40S*) PEAK=362 ;;
  *) PEAK=0 ;;
esac
FAILED=()
SKIPPED=()
BUDGET=${GPU_CHECK_BUDGET:-420}  # seconds for all parts together (the device's 15 minutes include its start)
STARTED=$SECONDS
step() {  # step NAME COMMAND...: run it under the part's and the budget's limit, log it, remember a failure
  local name=$1; shift
  local left=$((BUDGET - (SECONDS - STARTED)))
  if (( left < 30 )); then
    SKIPPED+=("$name"); echo "== $name: skipped (the ${BUDGET}s budget is spent)" | tee -a "$LOG"; return
  fi
  local limit=$(( left < PART_TIMEOUT ? left : PART_TIMEOUT ))
  echo "== $name (limit ${limit}s): $*" | tee -a "$LOG"
  timeout -k 10 "$limit" "$@" 2>&1 | grep --line-buffered -v -e "it/s\]" -e "examples/s\]" | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  [[ $rc == 124 || $rc == 137 ]] && echo "== $name: stopped at its ${limit}s limit (its runs so far are kept)" \
    | tee -a "$LOG"
  [[ $rc == 0 ]] || FAILED+=("$name")
  # The table so far, after every part: a run that the session's limit cuts short still leaves its figures.
  "$PY" bench/gpu_report.py "$DEST" --env "$WORK/env.txt" --more "$WORK" > /dev/null 2>&1
}

generate() {  # generate C [graphs]: the engine at C concurrent requests, against batched generate (or graphs off)
  local c=$1 mode=${2:-batched}
  local name="generate-c$c" json="$DEST/generate-c$c.json" extra=(--sequential -1 --batched)
  [[ $c == 1 ]] && extra=(--sequential "$SEQUENTIAL" --batched)  # one prompt at a time does not depend on c
  if [[ $mode == graphs ]]; then
    name="graphs-c$c" json="$WORK/graphs-c$c.json" extra=(--sequential -1 --graphs)
  fi
  step "$name" "$PY" bench/generate_engine.py "${GENERATE[@]}" --device "$DEVICE" --concurrency "$c" \
    --requests $((c > 4 ? 2 * c : 8)) --max-batch-size $((c > 32 ? c : 32)) "${extra[@]}" \
    --text examples/data/tinyshakespeare.txt --json "$json"
}
# Most important first: the targets never measured on a GPU (fine-tune MFU in bf16, generation at 128 concurrent,
# CUDA graphs), then the rest.
first_precision=${PRECISIONS%% *}
finetune() {
  step "finetune-$1" "$PY" bench/finetune.py "${FINETUNE[@]}" "${VOCAB[@]}" --device "$DEVICE" \
    --precision "$1" --baseline-precision match --sides engine,hf-trainer-grouped --peak-tflops "$PEAK" \
    --json "$DEST/finetune-$1.json"
}
finetune "$first_precision"
top=${CONCURRENCY##* }
generate "$top"
for c in $GRAPHS_CONCURRENCY; do generate "$c" graphs; done
step device-pin "$PY" bench/device_pin_check.py --json "$DEST/device_pin.json"
for c in $CONCURRENCY; do [[ $c == "$top" ]] || generate "$c"; done
for precision in $PRECISIONS; do [[ $precision == "$first_precision" ]] || finetune "$precision"; done

echo | tee -a "$LOG"
"$PY" bench/gpu_report.py "$DEST" --env "$WORK/env.txt" --more "$WORK"
rm -rf "$WORK"
(( ${#SKIPPED[@]} )) && echo "SKIPPED (budget): ${SKIPPED[*]}"
if (( ${#FAILED[@]} )); then
  echo "FAILED: ${FAILED[*]} (see $LOG)"
  exit 1
fi
echo "details in $DEST"
