#!/usr/bin/env bash
# Run the whole test suite: the main environment (common/, PyTorch, JAX, the benchmark runner),
# then the MXNet environment (tests/mxnet). Creates the environments first if missing.
# Extra arguments go to both pytest calls (e.g. -x, -k NAME).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup.sh all || exit 1
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(nproc)}"
# Tests run several framework processes at once on few cores: idle OpenMP threads must sleep,
# not spin (spinning made an oversubscribed 1-process torch run 10x slower here).
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
status=0
echo "[test] main environment: .venv/bin/python -m pytest tests --ignore=tests/mxnet"
.venv/bin/python -m pytest tests --ignore=tests/mxnet "$@" || status=1
echo "[test] mxnet environment: .venv-mxnet/bin/python -m pytest tests/mxnet"
.venv-mxnet/bin/python -m pytest tests/mxnet "$@" || status=1
exit $status
