#!/usr/bin/env bash
# The whole GPU check in one call, for a machine whose own python already holds CUDA builds of
# torch and JAX (a lent or an offline machine, where scripts/setup.sh cannot install them):
#   1. the main test suite as CI runs it (every test pinned to the CPU; parallel workers),
#   2. then benchmarks/gpu_suite.sh, one step after another in the order given (default 1, then
#      8: the headline table, then the GPU tests), each in the time left,
# and, with --archive, everything packed into ONE file (the logs, the exact commands, the
# tables and the records), the loose folder removed.
#
#   bash scripts/gpu_check.sh [--python PATH] [--steps LIST] [--no-tests] [--archive FILE] \
#       OUT_DIR [SECONDS]
#
# --python  the interpreter with CUDA torch, JAX, Flax, Optax, pytest and pytest-xdist (default:
#           python3). Unless .venv is already an environment (it has a pyvenv.cfg),
#           .venv/bin/python becomes a two-line script that execs it: a link to a virtual
#           environment's python would lose its packages, and scripts/setup.sh uses such a
#           script as it is and never rebuilds it.
# --steps   gpu_suite.sh's steps, run in this order (default 1,8); "" for none.
# SECONDS   the budget of the whole call (default 540): the tests get at most TESTS_SEC of it
#           (default 240), the suite's steps what is left, 20 s are kept for packing.
# Writes under OUT_DIR: commands.txt (every command, its exit status and seconds), tests.log
# and tests.xml (the suite), step<N>/ (gpu_suite.sh's own output for step N) and, with
# --archive, nothing else: FILE (.tar.xz) holds OUT_DIR.
set -u -o pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=python3 STEPS_LIST=1,8 TESTS=1 ARCHIVE=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --python) PY=${2:?--python needs the path of an interpreter}; shift 2 ;;
    --steps) STEPS_LIST=${2?--steps needs a list such as 1,8}; shift 2 ;;
    --no-tests) TESTS=0; shift ;;
    --archive) ARCHIVE=${2:?--archive needs a file name}; shift 2 ;;
    -*) echo "gpu_check.sh: unknown option $1 (see the comment at the top of $0)" >&2; exit 2 ;;
    *) break ;;
  esac
done
OUT=${1:?usage: bash scripts/gpu_check.sh [--python PATH] [--steps LIST] [--no-tests] [--archive FILE] OUT_DIR [SECONDS]}
BUDGET=${2:-540}
TESTS_SEC=${TESTS_SEC:-240}
[[ "$BUDGET" =~ ^[0-9]+$ ]] || { echo "gpu_check.sh: SECONDS must be a whole number, not $BUDGET" >&2; exit 2; }
[[ "$STEPS_LIST" =~ ^[0-9,]*$ ]] || { echo "gpu_check.sh: --steps takes numbers such as 1,8, not $STEPS_LIST" >&2; exit 2; }
PYPATH=$(command -v "$PY") || { echo "gpu_check.sh: no interpreter $PY (give --python PATH)" >&2; exit 2; }
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || exit 2
if [[ -n "$ARCHIVE" ]]; then
  mkdir -p "$(dirname "$ARCHIVE")" && ARCHIVE="$(cd "$(dirname "$ARCHIVE")" && pwd)/$(basename "$ARCHIVE")" || exit 2
fi
cd "$ROOT"

if [[ ! -f .venv/pyvenv.cfg ]]; then
  mkdir -p .venv/bin
  printf '#!/bin/sh\nexec %q "$@"\n' "$PYPATH" >.venv/bin/python
  chmod +x .venv/bin/python
fi
status=0
: >"$OUT/commands.txt"
# timed LIMIT COMMAND...: runs COMMAND under LIMIT seconds (and what is left of the budget),
# notes it, its exit status and its seconds in commands.txt.
timed() {
  local limit=$1 left=$((BUDGET - 20 - SECONDS))
  shift
  ((limit > left)) && limit=$left
  if ((limit < 40)); then
    echo "- skipped (time budget): $*" | tee -a "$OUT/commands.txt"
    status=1
    return
  fi
  echo "+ $* (at most $limit s)" | tee -a "$OUT/commands.txt"
  local t0=$SECONDS rc=0
  timeout --kill-after=15 "$limit" "$@" || rc=$?
  echo "  exit $rc after $((SECONDS - t0)) s" | tee -a "$OUT/commands.txt"
  ((rc == 0)) || status=1
}

{
  date -u +"%Y-%m-%d %H:%M:%S UTC"
  nvidia-smi -L 2>&1
  echo ".venv/bin/python: $(head -c 300 .venv/bin/python | tr '\n' ' ' | tr -d '\0')"
  echo "git $(git describe --always --dirty --abbrev=40 2>/dev/null)"
} >"$OUT/machine.txt"

if ((TESTS)); then
  cores=$(nproc)
  timed "$TESTS_SEC" env XLA_PYTHON_CLIENT_PREALLOCATE=false OMP_WAIT_POLICY=PASSIVE \
    .venv/bin/python -m pytest tests --ignore=tests/mxnet -q -rs -p no:cacheprovider \
    -n "$((cores < 6 ? cores : 6))" --dist loadfile --durations=20 \
    --junitxml="$OUT/tests.xml" >"$OUT/tests.log" 2>&1
  tail -3 "$OUT/tests.log" 2>/dev/null
fi
IFS=, read -r -a steps <<<"$STEPS_LIST"
for n in ${steps[@]+"${steps[@]}"}; do
  left=$((BUDGET - 20 - SECONDS))
  timed "$left" env STEPS="$n" bash benchmarks/gpu_suite.sh --python "$ROOT/.venv/bin/python" \
    "$OUT/step$n" "$((left - 10))"
done
echo "gpu_check: $OUT after $SECONDS s (exit $status)" | tee -a "$OUT/commands.txt"
if [[ -n "$ARCHIVE" ]]; then
  tar -cJf "$ARCHIVE" -C "$(dirname "$OUT")" "$(basename "$OUT")" && rm -rf "$OUT" &&
    echo "gpu_check: packed into $ARCHIVE ($(du -h "$ARCHIVE" | cut -f1))"
fi
exit $status
