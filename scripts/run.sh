#!/usr/bin/env bash
# The main job: create the environments if missing, then run the benchmark runner
# (`python -m benchmarks.compare`, offline default unless arguments are given).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup.sh all
exec .venv/bin/python -m benchmarks.compare "$@"
