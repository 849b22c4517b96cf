#!/usr/bin/env bash
# Create (or check) the two virtual environments at the project root, with the builds that fit the
# machine: scripts/setup_plan.py reads nvidia-smi and picks each environment's requirements file
# (without an NVIDIA driver the CPU builds, as always on CI). Idempotent: an environment whose
# requirements (the chosen file and the files it includes) have not changed since it was built is
# left alone (a second call takes about a second).
#   .venv        torch, JAX/Flax/Optax, scikit-learn, matplotlib, rich, pytest, ruff
#                requirements/main.txt (CPU), cuda13.txt or cuda12.txt (by the driver's CUDA)
#   .venv-mxnet  mxnet 1.9.1 + numpy 1.23.5 (MXNet cannot share numpy>=2 with current JAX)
#                requirements/mxnet.txt (CPU), or mxnet-cu117/112/110.txt on GPUs MXNet supports
# Each is built with the first Python that fits it (setup_plan.py): .venv with Python 3.10 to
# 3.13 ($PYTHON, python3.11, python3, ...), .venv-mxnet with 3.10 or 3.11 (numpy 1.23.5 has no
# wheel for 3.12+: DPBENCH_SETUP_MXNET_PYTHON, $PYTHON, python3.11, python3.10, python3, else uv,
# which fetches a managed 3.11). Where none fits .venv-mxnet, it is not built: one line says why
# and how to fix it, the same line lands in .venv-mxnet/not-built.txt (the runners' reason for
# skipping mxnet-gluon, test.sh's for skipping tests/mxnet), and the rest goes on.
# Usage: bash scripts/setup.sh [--dry-run] [--device auto|cpu|cuda12|cuda13] [main|mxnet|all]
#   --dry-run  print the plan (which file, into which environment, why) and install nothing
#   --device   instead of what nvidia-smi says (also DPBENCH_SETUP_DEVICE): cpu on a GPU machine,
#              or cuda12/cuda13 where no driver is visible (e.g. building an image)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
usage="usage: bash scripts/setup.sh [--dry-run] [--device auto|cpu|cuda12|cuda13] [main|mxnet|all]"

dry_run=0 what="" device=()
while (($#)); do
  case "$1" in
    --dry-run) dry_run=1 ;;
    --device) (($# > 1)) || { echo "setup.sh: --device needs a value; $usage" >&2; exit 2; }
      device=(--device "$2"); shift ;;
    --device=*) device=("$1") ;;
    main | mxnet | all) [[ -z "$what" ]] || { echo "setup.sh: one of main, mxnet, all; $usage" >&2; exit 2; }
      what="$1" ;;
    *) echo "setup.sh: unknown argument '$1'; $usage" >&2; exit 2 ;;
  esac
  shift
done
what="${what:-all}"

# machine, main_req, main_why, main_digest, main_python, mxnet_req, ... (shell-quoted); a bad
# --device or DPBENCH_SETUP_MXNET_PYTHON is its one line and exit 2
plan="$("$PYTHON" scripts/setup_plan.py --shell ${device[@]+"${device[@]}"})" || exit $?
eval "$plan"

not_built() {  # not_built NAME VENV WHY: .venv stops the set-up; without .venv-mxnet the rest
  # runs, and the runners and test.sh read why from the note
  if [[ "$1" == main ]]; then
    echo "[setup] $1 environment $2 cannot be built: $3" >&2
    exit 1
  fi
  mkdir -p "$2" && echo "$3" >"$2/not-built.txt"
  echo "[setup] $1 environment $2 not built: $3"
}

build() {  # build NAME VENV REQUIREMENTS DIGEST EARLIER_DIGEST WHY CPU_REQUIREMENTS PYTHON PYTHON_WHY
  local name="$1" venv="$2" req="$3" want="$4" earlier="$5" why="$6" cpu_req="$7"
  local python="$8" python_why="$9"
  local stamp="$2/.requirements.sha256" not_built="$2/not-built.txt"
  local have="" have_req="" clear=()
  echo "[setup] $name environment $venv: $req -- $why"
  ((dry_run)) && echo "[setup] $name environment $venv: $python_why"
  if [[ -x "$venv/bin/python" && ! -f "$venv/pyvenv.cfg" ]]; then
    # not a virtual environment but the user's own interpreter put there (a GPU machine's
    # python with its CUDA builds, behind a script that execs it): used as it is, never rebuilt
    echo "[setup] $name environment $venv: $venv/bin/python is not a virtual environment (no pyvenv.cfg); used as it is"
    return 0
  fi
  [[ -f "$stamp" ]] && { read -r have have_req <"$stamp" || true; }
  # a stamp from before the plan holds the digest alone: built from the CPU file, the only one then
  have_req="${have_req:-$cpu_req}"
  # earlier: the digest of $req before a comment-only edit (setup_plan.py's EARLIER)
  if [[ -x "$venv/bin/python" && "$have_req" == "$req" &&
        ("$have" == "$want" || (-n "$earlier" && "$have" == "$earlier")) ]]; then
    if ((dry_run)); then
      echo "[setup] dry run: $name environment $venv is up to date"
      return 0
    fi
    # console scripts that name another environment's python (the checkout moved): rewritten
    local fixed
    fixed="$("$venv/bin/python" scripts/fix_scripts.py "$venv")"
    if [[ -n "$fixed" ]]; then
      echo "[setup] $name environment $venv: $(wc -l <<<"$fixed") console script(s) named another environment's python; pointed at $venv/bin/python"
    fi
    echo "[setup] $name environment $venv is up to date"
    return 0
  fi
  local doing="building the $name environment in $venv from $req" would="would be built"
  if [[ -x "$venv/bin/python" && -f "$stamp" && "$have_req" != "$req" ]]; then
    # built from another file: started afresh, since pip keeps whatever satisfies a pin (PyPI's
    # torch 2.14.1 satisfies cuda12.txt's torch==2.14.1, so the +cu128 build would not replace
    # it) and never removes what the new file lacks (JAX's CUDA plugin after a switch to CPU)
    clear=(--clear)
    doing="rebuilding the $name environment in $venv from $req (it was built from $have_req)"
    would="would be rebuilt afresh (it was built from $have_req)"
  fi
  if [[ -z "$python" ]]; then
    if ((dry_run)); then
      echo "[setup] dry run: $name environment $venv cannot be built here"
      return 0
    fi
    not_built "$name" "$venv" "$python_why"
    return 0
  fi
  if ((dry_run)); then
    echo "[setup] dry run: $name environment $venv $would"
    return 0
  fi
  echo "[setup] $doing (a few minutes, once)"
  echo "[setup] $name environment $venv: built with $python_why"
  if [[ -f "$not_built" ]]; then
    rm -f "$not_built"
    rmdir "$venv" 2>/dev/null || true  # the note's folder, unless it is a link or holds more
  fi
  if [[ "$python" == uv ]]; then
    # --seed: pip in the environment, as python -m venv gives it; UV_VENV_CLEAR: replace one
    # that exists (newer uv refuses otherwise, older uv always replaced it)
    if ! UV_VENV_CLEAR=1 uv venv -q --no-project --seed --python "$uv_python" "$venv"; then
      not_built "$name" "$venv" "uv venv --python $uv_python failed (its message above; a \
managed Python comes from GitHub); install python$uv_python, or name one with \
DPBENCH_SETUP_MXNET_PYTHON=PATH, then run bash scripts/setup.sh $name"
      return 0
    fi
  else
    "$python" -m venv ${clear[@]+"${clear[@]}"} "$venv"
  fi
  "$venv/bin/python" -m pip install -q --upgrade pip 2> >(grep -v "is ignored" >&2)
  "$venv/bin/python" -m pip install -q -r "$req" 2> >(grep -v "is ignored" >&2)
  echo "$want $req" >"$stamp"
  echo "[setup] $name environment ready"
  if [[ "$name" == main && "$req" != "$cpu_req" && -f benchmarks/devices.py ]]; then
    # whether torch and JAX found the GPU, said now rather than at the first run
    .venv/bin/python -m benchmarks.devices ||
      echo "[setup] .venv/bin/python -m benchmarks.devices exited $? (see above); the environment is installed"
  fi
}

((dry_run)) && echo "[setup] dry run, nothing is installed; machine: $machine"
case "$what" in
  main) build main .venv "$main_req" "$main_digest" "$main_earlier" "$main_why" requirements/main.txt "$main_python" "$main_python_why" ;;
  mxnet) build mxnet .venv-mxnet "$mxnet_req" "$mxnet_digest" "$mxnet_earlier" "$mxnet_why" requirements/mxnet.txt "$mxnet_python" "$mxnet_python_why" ;;
  all)
    build main .venv "$main_req" "$main_digest" "$main_earlier" "$main_why" requirements/main.txt "$main_python" "$main_python_why"
    build mxnet .venv-mxnet "$mxnet_req" "$mxnet_digest" "$mxnet_earlier" "$mxnet_why" requirements/mxnet.txt "$mxnet_python" "$mxnet_python_why"
    ;;
esac
