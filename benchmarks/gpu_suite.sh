#!/usr/bin/env bash
# GPU results (issues 14, 27) on a machine with NVIDIA GPUs: throughput, compare, the tutorial
# loops, and the GPU tests as the last step. Ends within BUDGET_SEC (default
# 560 s: a budget guards every step; a step that no longer fits is listed as skipped). Steps 1-6
# take about 15 minutes on one H100; where one command may run 10 minutes, run them in three
# calls:
#
#   bash benchmarks/gpu_suite.sh [--python PATH] [OUT_DIR [BUDGET_SEC]]
#   STEPS=1,2,3,4 bash benchmarks/gpu_suite.sh OUT_DIR       # about 8 minutes on one H100
#   STEPS=5,6 bash benchmarks/gpu_suite.sh OUT_DIR-2         # about 6 minutes
#   STEPS=8 bash benchmarks/gpu_suite.sh OUT_DIR-3           # the GPU tests (3-6 min, estimated)
#   STEPS=8,1 bash benchmarks/gpu_suite.sh OUT_DIR           # steps run in the order given
#   (scripts/gpu_check.sh's default: STEPS=1,7,8, the headline table first on a quiet host)
#   DRY_RUN=1 bash benchmarks/gpu_suite.sh OUT_DIR           # the plan: every command, none run
#
# The interpreter: the project's own .venv when it holds the CUDA builds (what `bash
# scripts/setup.sh` installs on a machine with an NVIDIA driver), else python3 (e.g. a lent
# machine's own python with CUDA torch and JAX); --python PATH names another. MXNet is not run
# here (its CUDA wheels have no Hopper code; the compare runner skips it with the reason).
# OUT_DIR defaults to docs/results/gpu-<UTC date>/ (committed result sets live in docs/results/:
# a README, tables and plots each, the rest in one raw.tar.xz, see docs/results/README.md; the
# H100 runs of 2026-11-23 are docs/results/h100-20261123/). Writes, under OUT_DIR:
# machine.txt, commands.txt (every command and its seconds), throughput-bf16/ (the headline:
# torch eager, torch with CUDA graphs and JAX in one table), throughput-bf16-host-pipeline/,
# throughput-bf16-compile/, throughput-fp32/ (each
# throughput.json, throughput.md, runs/, logs/), compare-digits/ (the compare runner's tables
# and records), tutorial-loops/ (ours against the seed tutorials' loops)
# and gpu-tests.xml (the GPU tests' results; their output goes to the suite's own).
# Throughput: ResNet-18, 32x32 synthetic data, global batch 512 on 1 GPU; the real loop runs
# 4 epochs of 16 steps (all 8192 synthetic images per epoch), the last 3 timed.
# TensorBoard curves (compare) need tensorboardX; where it is missing the suite passes
# --no-tensorboard. To bring it to a machine without registry access, carry its wheel:
#   pip download --no-deps --only-binary=:all: -d .whl tensorboardX==2.6.5   (here), then
#   pip install --no-index --no-deps --target /tmp/site .whl/*.whl; PYTHONPATH=/tmp/site (there)
# Step 8 wants pytest, carried the same way where the python lacks it.
set -u -o pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=""
if [[ "${1:-}" == "--python" ]]; then
  PY=${2:?--python needs the path of an interpreter}
  shift 2
fi
# STEPS (default: all, in order) picks steps by number and runs them in the order given, e.g.
# STEPS=8,1 bash benchmarks/gpu_suite.sh ... runs the GPU tests first, then the headline table.
STEPS=${STEPS:-1,7,2,3,4,5,6,8}
[[ "$STEPS" =~ ^[1-9](,[1-9])*$ ]] || { echo "gpu_suite.sh: STEPS takes step numbers 1-9 such as 1,8, not '$STEPS'" >&2; exit 2; }
OUT=${1:-$ROOT/docs/results/gpu-$(date -u +%Y%m%d)}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$ROOT"
cuda_builds() {  # does this interpreter's torch and JAX both see a GPU?
  XLA_PYTHON_CLIENT_PREALLOCATE=false "$1" -c 'import torch, jax
assert torch.cuda.is_available() and jax.default_backend() == "gpu"' >/dev/null 2>&1
}
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]] && cuda_builds .venv/bin/python; then
    PY=$ROOT/.venv/bin/python  # not resolved: a venv's python is a link that must stay one
  else
    PY=$(command -v python3)
  fi
fi
: >"$OUT/commands.txt"

{
  date -u +"%Y-%m-%d %H:%M:%S UTC"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  echo "interpreter $PY"
  "$PY" -c 'import sys, torch, jax; print("python", sys.version.split()[0]); print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version()); print("jax", jax.__version__, jax.devices())'
  "$PY" -m benchmarks.devices --frameworks torch-ddp,torch-dp,jax-pmap,jax-shard,jax-shardmap,torch-fsdp,jax-fsdp
  # The commit, "-dirty" when the working tree differs from it (a copied tree may carry an
  # older .git: then the tree, not the commit, is what ran).
  echo "git $(git describe --always --dirty --abbrev=40 2>/dev/null)"
} >"$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

status=0
# Every step runs under what is left of BUDGET seconds (default 560: a call ends within 10
# minutes whatever happens); the steps come in order of importance, a step that no longer fits
# is listed as skipped with its command, and a step cut short keeps what it had measured
# (throughput.json is rewritten after every measurement; compare keeps every finished run).
BUDGET=${2:-560}
run() {
  local left=$((BUDGET - SECONDS))
  if ((left < 40)); then
    echo "- skipped (time budget): $*" | tee -a "$OUT/commands.txt"
    status=1
    return
  fi
  echo "+ $*" | tee -a "$OUT/commands.txt"
  [[ -n "${DRY_RUN:-}" ]] && return  # DRY_RUN=1: the plan, nothing run
  local t0=$SECONDS
  # SIGINT, as Ctrl-C: the runners keep every finished measurement and pytest writes its
  # summary and XML; what ignores it is killed 5 s later
  timeout -s INT --kill-after=5 "$left" "$@" || status=1
  echo "  ($((SECONDS - t0)) s)" | tee -a "$OUT/commands.txt"
}

COMMON=(--python "$PY" --gpus 1 --model resnet18 --image-size 32 --batch-size 512
        --steps 16 --epochs 4 --timeout 240)

# Each torch module eager and in a variant (NAME+VARIANT, benchmarks/harness.py VARIANTS):
# reduce-overhead = torch.compile with CUDA graphs (the compiled forward and backward replayed
# in one launch each, instead of ~440 launches per step).
# The like-for-like rows first (the throughput runner measures in this order: a step cut short
# keeps what it measured): torch with CUDA graphs, jax-pmap, eager torch, then the rest, the
# sharded strategies last. torch-dp with CUDA graphs is left out: at one GPU it is torch-ddp's
# compiled step (79,757 and 79,753 img/s on the first H200 run).
HEADLINE=torch-ddp+reduce-overhead,jax-pmap,torch-ddp,torch-dp,jax-shard,jax-shardmap,torch-fsdp,jax-fsdp
# A CIFAR-10 epoch at global batch 512: 98 steps. Shorter epochs weigh the per-epoch costs
# (evaluation, the epoch's sync) several times more than a real run does (16-step epochs on the
# 2026-11-28 H200 check gave jax-pmap 0.79 of its compute-only step).
CIFAR_EPOCH=98
# 1. THE HEADLINE TABLE. Mixed precision, every torch and JAX trainer (torch-ddp eager and with
#    CUDA graphs, a row each, the mode column says which): torch autocast bf16 + channels_last +
#    cudnn.benchmark; JAX bf16 activations. --pipeline auto: on a GPU the training set is
#    resident there and each step's crops are gathered there. --profile 8: each run's first
#    (untimed) epoch traces 8 steps with its framework's profiler; the cells get the step's
#    breakdown, the timed epochs stay unprofiled. 3 epochs of 98 steps, the first untimed.
step1() { run "$PY" -m benchmarks.throughput --frameworks "$HEADLINE" \
    "${COMMON[@]}" --steps "$CIFAR_EPOCH" --epochs 3 --precision bf16 --channels-last --profile 8 \
    --out "$OUT/throughput-bf16"; }
# 2. The same with the host pipeline (numpy crops on a prefetch thread, copied every step): what
#    the device pipeline is worth.
step2() { run "$PY" -m benchmarks.throughput --frameworks torch-ddp,torch-dp,jax-pmap,jax-shard \
    "${COMMON[@]}" --precision bf16 --channels-last --pipeline host \
    --out "$OUT/throughput-bf16-host-pipeline"; }
# 3. torch.compile in its default mode (no CUDA graphs: every kernel still launched from the
#    host, by Inductor's code), the mode between 1's eager and CUDA-graph rows.
step3() { run "$PY" -m benchmarks.throughput --frameworks torch-ddp+compile "${COMMON[@]}" \
    --precision bf16 --channels-last --out "$OUT/throughput-bf16-compile"; }
# 4. fp32 (full fp32: TF32 off in every framework, as the trainers default), NCHW.
step4() { run "$PY" -m benchmarks.throughput --frameworks torch-ddp,torch-dp,jax-pmap,jax-shard \
    "${COMMON[@]}" --precision fp32 --no-channels-last --out "$OUT/throughput-fp32"; }
# TensorBoard curves only where the writer (tensorboardX) is installed: a GPU image may lack it.
TB=()
"$PY" -c 'import tensorboardX' 2>/dev/null || TB=(--no-tensorboard)
# 5. The compare runner on real data (the digits preset: ResNet-18 at width 0.25) at 1 GPU,
#    torch-ddp eager and with CUDA graphs beside JAX, as in 1; MXNet is absent. --profile 8: the
#    report's breakdown table and stacked bars at 1 GPU (traces under runs/*.profile/).
step5() { run env DPBENCH_PYTHON_TORCH_DP="$PY" DPBENCH_PYTHON_TORCH_DDP="$PY" \
    DPBENCH_PYTHON_JAX_PMAP="$PY" DPBENCH_PYTHON_JAX_SHARD="$PY" DPBENCH_PYTHON_JAX_SHARDMAP="$PY" \
    "$PY" -m benchmarks.compare --gpus 1 \
    --frameworks torch-ddp,torch-ddp+reduce-overhead,torch-dp,jax-pmap,jax-shard,jax-shardmap \
    --preset digits --profile 8 --timeout 180 ${TB[@]+"${TB[@]}"} --out "$OUT/compare-digits"; }
# 6. Our loops against the seed tutorials' loops (d2l's PyTorch and JAX loops, the NVIDIA course,
#    the Flax example) on the same work: full-width ResNet-18 on 8192 CIFAR-shaped synthetic
#    images, batch 256, 1 GPU.
step6() { run "$PY" -m benchmarks.tutorial_loops --python "$PY" \
    --tutorials d2l-torch,nvidia-course,flax-imagenet,d2l-jax --gpus 1 --repeat 2 \
    --preset throughput --width 1 --train-limit 8192 --epochs 3 --timeout 120 \
    --out "$OUT/tutorial-loops"; }
# 7. The JAX rows of 1 with XLA's command buffers off (XLA_FLAGS, passed to the trainers and
#    recorded in their records): the 2026-11-28 H200 profile of jax-pmap showed the host thread
#    in XLA's command-buffer updates for about 5 of each 8.6 ms step while the GPU waited 2.8 ms.
#    Set beside step 1's JAX rows, this says whether the command buffers cause the host gap.
step7() { run env XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_gpu_enable_command_buffer=" \
    "$PY" -m benchmarks.throughput --frameworks jax-pmap,jax-shard,jax-fsdp "${COMMON[@]}" \
    --steps "$CIFAR_EPOCH" --epochs 3 --precision bf16 --channels-last \
    --out "$OUT/throughput-bf16-no-command-buffers"; }

# 8. The GPU tests (tests marked `gpu`: every trainer on cuda, NCCL, DataParallel's device ids,
#    pmap and shardings, parity, CUDA graphs, --devices cpu on a GPU machine),
#    the GPU pass of scripts/test.sh. The rest of the suite runs with the CPU pinned, as in CI:
#    `.venv/bin/python -m pytest tests --ignore=tests/mxnet` on this machine too. 4 workers
#    where pytest-xdist is installed: the tests share the GPU (XLA does not preallocate), each
#    runs a small model, and they are correctness tests, not timings (225 s one at a time on
#    the first H200 run, the longest 24 s).
step8() {
  local workers=()
  "$PY" -c 'import xdist' 2>/dev/null && workers=(-n 4 --dist load)
  if "$PY" -c 'import pytest' 2>/dev/null; then
    run env DPBENCH_TEST_GPU=1 XLA_PYTHON_CLIENT_PREALLOCATE=false DPBENCH_TEST_PYTHON="$PY" \
        DPBENCH_PYTHON_TORCH_DP="$PY" DPBENCH_PYTHON_TORCH_DDP="$PY" \
        DPBENCH_PYTHON_JAX_PMAP="$PY" DPBENCH_PYTHON_JAX_SHARD="$PY" DPBENCH_PYTHON_JAX_SHARDMAP="$PY" \
        DPBENCH_PYTHON_TORCH_FSDP="$PY" DPBENCH_PYTHON_JAX_FSDP="$PY" \
        "$PY" -m pytest -q -rs -p no:cacheprovider tests -m gpu --ignore=tests/mxnet \
        ${workers[@]+"${workers[@]}"} --junitxml="$OUT/gpu-tests.xml"
  else
    echo "- skipped (no pytest; carry its wheels as tensorboardX's above): the GPU tests" \
      | tee -a "$OUT/commands.txt"
  fi
}

# 9. MFU (optional, issue 39): how much of the GPU's bf16 peak the best loops reach, by batch.
#    jax-pmap and torch-ddp with CUDA graphs at global batch 256, 512, 1024 and 2048 on one GPU,
#    the loop and its compute-only step, 8192 images per epoch, 3 epochs; benchmarks/analysis/mfu.py
#    turns the four tables into one with MFU = images/s x 3.33 GFLOP per image (ResNet-18 at
#    32x32, forward and backward, measured with torch's FlopCounterMode on the H200) / the
#    peak (--peak-tflops, default 989: H100/H200 SXM dense bf16). About 4 minutes, estimated.
step9() {
  local b tables=()
  for b in 256 512 1024 2048; do
    run "$PY" -m benchmarks.throughput --frameworks jax-pmap,torch-ddp+reduce-overhead \
      "${COMMON[@]}" --batch-size "$b" --steps "$((8192 / b))" --epochs 3 --precision bf16 \
      --channels-last --out "$OUT/mfu/b$b"
    tables+=("$OUT/mfu/b$b/throughput.json")
  done
  run "$PY" -m benchmarks.analysis.mfu --out "$OUT/mfu" "${tables[@]}"
}

IFS=, read -r -a order <<<"$STEPS"
for n in "${order[@]}"; do
  "step$n"
done
echo "results in $OUT after $SECONDS s (exit $status)"
exit $status
