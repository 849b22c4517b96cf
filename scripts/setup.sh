#!/usr/bin/env bash
# Create (or check) the two virtual environments at the project root. Idempotent: an environment
# whose requirements file has not changed since it was built is left alone (a second call takes
# about a second).
#   .venv        torch, JAX/Flax/Optax, scikit-learn, matplotlib, rich, pytest, ruff
#   .venv-mxnet  mxnet 1.9.1 + numpy 1.23.5 (MXNet cannot share numpy>=2 with current JAX)
# Usage: bash scripts/setup.sh [main|mxnet|all]   (default: all)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3

build() {  # build NAME VENV REQUIREMENTS
  local name="$1" venv="$2" req="$3" stamp="$2/.requirements.sha256"
  local want
  want="$(sha256sum "$req" | cut -d' ' -f1)"
  if [[ -x "$venv/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
    # console scripts that name another environment's python (the checkout moved): rewritten
    local fixed
    fixed="$("$venv/bin/python" scripts/fix_scripts.py "$venv")"
    if [[ -n "$fixed" ]]; then
      echo "[setup] $name environment $venv: $(wc -l <<<"$fixed") console script(s) named another environment's python; pointed at $venv/bin/python"
    fi
    echo "[setup] $name environment $venv is up to date"
    return 0
  fi
  echo "[setup] building the $name environment in $venv from $req (a few minutes, once)"
  "$PYTHON" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip 2> >(grep -v "is ignored" >&2)
  "$venv/bin/python" -m pip install -q -r "$req" 2> >(grep -v "is ignored" >&2)
  echo "$want" >"$stamp"
  echo "[setup] $name environment ready"
}

what="${1:-all}"
case "$what" in
  main) build main .venv requirements/main.txt ;;
  mxnet) build mxnet .venv-mxnet requirements/mxnet.txt ;;
  all)
    build main .venv requirements/main.txt
    build mxnet .venv-mxnet requirements/mxnet.txt
    ;;
  *) echo "usage: bash scripts/setup.sh [main|mxnet|all]" >&2; exit 2 ;;
esac
