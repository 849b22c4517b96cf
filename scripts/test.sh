#!/usr/bin/env bash
# Run the whole test suite: the main environment (common/, PyTorch, JAX, the benchmark runner),
# then the MXNet environment (tests/mxnet; where no Python could build it, one line says so),
# then, where a GPU is visible, the GPU tests.
# Creates the environments first if missing.
# Extra arguments go to both pytest calls (e.g. -x, -k NAME).
#   --fast  the edit loop's tier: only the tests that start no process (tests/conftest.py skips
#           the others as they try), in both environments; no type check, no GPU pass
set -uo pipefail
fast=0
if [[ "${1:-}" == "--fast" ]]; then
  fast=1
  shift
  export DPBENCH_TEST_FAST=1
fi
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
# The main suite in parallel workers, a test file per worker at a time (pytest-xdist): most
# tests wait on processes they start, so 2 workers on 2 cores take about 0.6 of one's time.
# DPBENCH_TEST_WORKERS=1 runs it in one process (as before); the default is the core count, at
# most 6 (each worker's tests start processes of their own: 2-device trainers, gloo worlds).
# tests/conftest.py pins each worker, and the processes its tests start, to its own share of
# the cores: the trainers size their threads to the cores they may use, one each here.
workers="${DPBENCH_TEST_WORKERS:-$(( $(nproc) < 6 ? $(nproc) : 6 ))}"
if ! [[ "$workers" =~ ^[1-9][0-9]*$ ]]; then
  echo "[test] DPBENCH_TEST_WORKERS must be a whole number from 1, not '$workers' (1: one process)" >&2
  exit 2
fi
bash scripts/setup.sh all || exit 1
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(nproc)}"
# Tests run several framework processes at once on few cores: idle OpenMP threads must sleep,
# not spin (spinning made an oversubscribed 1-process torch run 10x slower here).
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
status=0
parallel=()
# Whole files, heaviest first (tests/conftest.py orders them by tests/weights.json; xdist's own
# reordering, by number of tests, would start slow files of few tests last).
((workers > 1)) && parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder)
echo "[test] main environment: .venv/bin/python -m pytest tests --ignore=tests/mxnet ${parallel[*]}"
.venv/bin/python -m pytest tests --ignore=tests/mxnet ${parallel[@]+"${parallel[@]}"} "$@" || status=1
# The type checker (pyproject.toml's [tool.mypy]): a bool passed where a platform belongs, say.
# About 90 s of one core on a cold cache: it runs beside the MXNet suite, one process that
# leaves a core of two idle most of the time (beside the main suite it took a core from its
# workers, which use them all), and reports after it.
if ((fast)); then
  echo "[test] --fast: mxnet environment: .venv-mxnet/bin/python -m pytest tests/mxnet"
  .venv-mxnet/bin/python -m pytest tests/mxnet "$@" || status=1
  exit $status
fi
echo "[test] type check: .venv/bin/python -m mypy (common/, frameworks/, benchmarks/, tutorials/), beside the mxnet suite"
typecheck_log=$(mktemp)
.venv/bin/python -m mypy >"$typecheck_log" 2>&1 &
typecheck=$!
if [[ -f .venv-mxnet/not-built.txt ]]; then  # setup.sh found no Python that builds it
  echo "[test] mxnet environment: tests/mxnet did not run: $(<.venv-mxnet/not-built.txt)"
else
  echo "[test] mxnet environment: .venv-mxnet/bin/python -m pytest tests/mxnet"
  .venv-mxnet/bin/python -m pytest tests/mxnet "$@" || status=1
fi
echo "[test] type check: .venv/bin/python -m mypy"
wait "$typecheck" || status=1
cat "$typecheck_log" && rm -f "$typecheck_log"
# The runs above pin every test to the CPU (tests/conftest.py): a GPU machine runs them as CI
# does. Where nvidia-smi lists a GPU, the GPU pass follows: only the tests marked `gpu`.
if nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
  echo "[test] GPU pass: DPBENCH_TEST_GPU=1 .venv/bin/python -m pytest tests -m gpu"
  DPBENCH_TEST_GPU=1 .venv/bin/python -m pytest tests -m gpu --ignore=tests/mxnet "$@"
  rc=$?
  ((rc == 0 || rc == 5)) || status=1  # 5: no GPU test selected (e.g. by -k), not a failure
fi
exit $status
