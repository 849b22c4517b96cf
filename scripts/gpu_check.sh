#!/usr/bin/env bash
# The whole GPU check in one call, for a machine whose own python already holds CUDA builds of
# torch and JAX (a lent or an offline machine, where scripts/setup.sh cannot install them):
#   0. a check of that python (scripts/gpu_preflight.py: torch and JAX see the GPU; Flax, Optax,
#      pytest, pytest-xdist import) that stops the call in seconds, exit 2, where they do not,
#   1. benchmarks/gpu_suite.sh's steps in the order given (default 1,7,8: the headline table
#      first, on a quiet host, every row in epochs of a CIFAR-10 epoch's length; the JAX rows
#      with XLA's command buffers off; the GPU tests),
#   2. then the main test suite as CI runs it (every test pinned to the CPU; parallel workers)
#      in the time left,
# and, with --archive, everything packed into ONE file (the logs, the exact commands, the
# tables and the records), the loose folder removed. It ends with the verdicts on what it wrote
# (benchmarks/analysis/gpu_verdicts.py: tests, rows reached, precision, real/compute-only, the
# GPU; also written to OUT_DIR/verdicts.txt), when step 1, the table they judge, was asked:
# exit 1 if one fails.
#
#   bash scripts/gpu_check.sh [--python PATH] [--steps LIST] [--no-tests] [--archive FILE] \
#       OUT_DIR [SECONDS]
#   bash scripts/gpu_check.sh [--python PATH] --judge ARCHIVE   # the verdicts on an earlier one
#
# --python  the interpreter with CUDA torch, JAX, Flax, Optax, pytest and pytest-xdist (default:
#           python3). Unless .venv is already an environment (it has a pyvenv.cfg),
#           .venv/bin/python becomes a two-line script that execs it: a link to a virtual
#           environment's python would lose its packages, and scripts/setup.sh uses such a
#           script as it is and never rebuilds it.
# --judge   print the verdicts on ARCHIVE (or an OUT_DIR) and exit: 0 all pass, 1 one fails, 2
#           it cannot be read. Runs on .venv/bin/python, else python3 (--python PATH: that one).
# --steps   gpu_suite.sh's steps, run in this order (default 1,7,8); "" for none.
# SECONDS   the budget of the whole call (default 540): the steps get all of it but the last
#           TESTS_SEC (default 60) and the 30 s kept for packing; the suite gets what is left.
#
# The plan: 9 minutes on one H100 or H200 (a 15-minute device slot, 1-2 of them the machine's
# start). Estimated from the H200 runs of 2026-11-27 and 2026-11-28 (6 rows of 3 epochs of 16
# steps in 246 s; the GPU tests 225 s one at a time): the 8 headline rows of 3 epochs of 98
# steps about 5 minutes, the 3 JAX rows without command buffers about 1.5, the GPU tests (-n 4)
# the rest; the CPU-pinned suite only where time is left (a step cut short keeps what it
# measured, and the verdicts name the rows it did not reach).
# The MFU step (9) is optional: --steps 1,7,8,9 where the slot has 4 minutes more.
# DRY_RUN=1: the plan, in commands.txt and on screen, with nothing run but the pre-flight.
# Writes under OUT_DIR: machine.txt (the GPU, the python, which optional packages it has),
# commands.txt (every command, its exit status and seconds), tests.log and tests.xml (the
# suite), suite.log and suite/ (gpu_suite.sh's output) and, with --archive, nothing else: FILE
# (.tar.xz) holds OUT_DIR (without the profiler traces if it would pass 15 MiB).
set -u -o pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=python3 STEPS_LIST=1,7,8 TESTS=1 ARCHIVE="" JUDGE="" PY_GIVEN=0
fail() { echo "gpu_check.sh: $*" >&2; exit 2; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --python) PY=${2:?--python needs the path of an interpreter}; PY_GIVEN=1; shift 2 ;;
    --judge) JUDGE=${2:?--judge needs the archive to judge}; shift 2 ;;
    --steps) STEPS_LIST=${2?--steps needs a list such as 1,7,8}; shift 2 ;;
    --no-tests) TESTS=0; shift ;;
    --archive) ARCHIVE=${2:?--archive needs a file name}; shift 2 ;;
    -*) fail "unknown option $1 (see the comment at the top of $0)" ;;
    *) break ;;
  esac
done
if [[ -n "$JUDGE" ]]; then  # the verdicts on an earlier check, nothing else
  [[ "$JUDGE" == /* ]] || JUDGE="$PWD/$JUDGE"
  cd "$ROOT" || fail "cannot enter $ROOT"
  ((PY_GIVEN)) || { [[ -x .venv/bin/python ]] && PY=.venv/bin/python; }
  exec "$PY" -m benchmarks.analysis.gpu_verdicts "$JUDGE"
fi
OUT=${1:?usage: bash scripts/gpu_check.sh [--python PATH] [--steps LIST] [--no-tests] [--archive FILE] OUT_DIR [SECONDS]}
BUDGET=${2:-540}
TESTS_SEC=${TESTS_SEC:-60}
[[ "$BUDGET" =~ ^[0-9]+$ ]] || fail "SECONDS must be a whole number, not $BUDGET"
[[ "$STEPS_LIST" =~ ^([1-9](,[1-9])*)?$ ]] || fail "--steps takes step numbers 1-9 such as 1,7,8, not $STEPS_LIST"
PYPATH=$(command -v "$PY") || fail "no interpreter $PY (give --python PATH)"
[[ "$PYPATH" == /* ]] || PYPATH="$PWD/$PYPATH"  # absolute, links kept (a venv's python is one)
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || fail "cannot create $OUT"
case "$ROOT/" in "$OUT"/*) fail "OUT_DIR $OUT holds the repository; name a folder of its own" ;; esac
if [[ -n "$ARCHIVE" ]]; then
  mkdir -p "$(dirname "$ARCHIVE")" || fail "cannot create the folder of $ARCHIVE"
  ARCHIVE="$(cd "$(dirname "$ARCHIVE")" && pwd)/$(basename "$ARCHIVE")"
  case "$ARCHIVE" in "$OUT"/*) fail "--archive $ARCHIVE is inside OUT_DIR, which is removed once packed" ;; esac
fi
cd "$ROOT"

if [[ ! -f .venv/pyvenv.cfg ]]; then
  [[ "$PYPATH" == "$ROOT/.venv/bin/python" ]] && fail "--python $PY is the script this call writes; name the interpreter it should run"
  [[ -L .venv ]] && rm -f .venv  # a link from another checkout (copied with the tree) leads elsewhere
  mkdir -p .venv/bin && printf "#!/bin/sh\nexec '%s' \"\$@\"\n" "${PYPATH//\'/\'\\\'\'}" >.venv/bin/python &&
    chmod +x .venv/bin/python || fail "cannot write .venv/bin/python"
fi
{
  date -u +"%Y-%m-%d %H:%M:%S UTC"
  nvidia-smi -L 2>&1
  echo ".venv/bin/python: $(tr '\n' ' ' <.venv/bin/python | head -c 300)"
  echo "git $(git describe --always --dirty --abbrev=40 2>/dev/null)"
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 180 .venv/bin/python scripts/gpu_preflight.py 2>&1 | tail -3
} >"$OUT/machine.txt"
cat "$OUT/machine.txt"
grep -q "^optional:" "$OUT/machine.txt" || fail "$PYPATH cannot run the check (see $OUT/machine.txt: $(tail -1 "$OUT/machine.txt"))"

status=0
: >"$OUT/commands.txt"
# timed LIMIT COMMAND...: runs COMMAND under LIMIT seconds (and what is left of the budget),
# notes it, its exit status and its seconds in commands.txt. SIGINT first, as Ctrl-C: pytest
# and the runners keep what they finished and write their summaries.
timed() {
  local limit=$1 left=$((BUDGET - 30 - SECONDS))
  shift
  ((limit > left)) && limit=$left
  if ((limit < 40)); then
    echo "- skipped (time budget): $*" | tee -a "$OUT/commands.txt"
    status=1
    return
  fi
  echo "+ $* (at most $limit s)" | tee -a "$OUT/commands.txt"
  [[ -n "${DRY_RUN:-}" && "$*" != *gpu_suite.sh* ]] && return  # the plan only (gpu_suite.sh's own)
  local t0=$SECONDS rc=0
  timeout -s INT --kill-after=10 "$limit" "$@" || rc=$?
  echo "  exit $rc after $((SECONDS - t0)) s" | tee -a "$OUT/commands.txt"
  ((rc == 0)) || status=1
}

if [[ -n "$STEPS_LIST" ]]; then
  left=$((BUDGET - 30 - SECONDS - (TESTS ? TESTS_SEC : 0)))
  # the suite ends its steps 20 s before this call's limit: its own children are stopped first
  timed "$left" env STEPS="$STEPS_LIST" bash benchmarks/gpu_suite.sh --python "$ROOT/.venv/bin/python" \
    "$OUT/suite" "$((left - 20))" >"$OUT/suite.log" 2>&1
  tail -40 "$OUT/suite.log"
fi
if ((TESTS)); then  # the time left, at least TESTS_SEC
  cores=$(nproc)
  timed "$((BUDGET - 30 - SECONDS))" env XLA_PYTHON_CLIENT_PREALLOCATE=false OMP_WAIT_POLICY=PASSIVE \
    .venv/bin/python -m pytest tests --ignore=tests/mxnet -q -rs -p no:cacheprovider \
    -n "$((cores < 12 ? cores : 12))" --dist loadfile --durations=20 \
    --junitxml="$OUT/tests.xml" >"$OUT/tests.log" 2>&1
  tail -3 "$OUT/tests.log" 2>/dev/null
fi
verdicts=""
if [[ ",$STEPS_LIST," == *,1,* ]]; then  # the verdicts judge step 1's table: none without it
  judged=0
  verdicts=$(.venv/bin/python -m benchmarks.analysis.gpu_verdicts "$OUT" 2>&1) || judged=$?
  printf '%s\n' "$verdicts" >"$OUT/verdicts.txt"
  ((judged == 0)) || status=1
else
  verdicts="gpu_check: no verdicts (they judge step 1's throughput table, not asked)"
fi
echo "gpu_check: $OUT after $SECONDS s (exit $status)" | tee -a "$OUT/commands.txt"
if [[ -n "$ARCHIVE" ]]; then
  # Python's tarfile, not `tar -J`: a minimal machine may have no xz (Debian 13's has none)
  pack() {  # pack SUFFIX: OUT into ARCHIVE, leaving out the paths with a part ending in SUFFIX
    python3 - "$ARCHIVE" "$OUT" "$1" <<'PY'
import sys, tarfile
from pathlib import Path
archive, out, exclude = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
keep = lambda info: info if not exclude or not any(
    part.endswith(exclude) for part in Path(info.name).parts) else None
with tarfile.open(archive, "w:xz") as tar:
    tar.add(out, arcname=out.name, filter=keep)
PY
  }
  packed=0
  pack "" && packed=1
  if ((packed)) && (($(stat -c %s "$ARCHIVE") > 15 * 1024 * 1024)); then
    echo "gpu_check: over 15 MiB; packed again without the profiler traces" | tee -a "$OUT/commands.txt"
    packed=0
    pack ".profile" && packed=1
  fi
  if ((packed)); then  # the loose folder goes only once the archive holds it
    rm -rf -- "$OUT" && echo "gpu_check: packed into $ARCHIVE ($(du -h "$ARCHIVE" | cut -f1))"
  else
    echo "gpu_check: packing failed; the results stay in $OUT" >&2
    status=1
  fi
fi
printf '%s\n' "$verdicts"
exit $status
