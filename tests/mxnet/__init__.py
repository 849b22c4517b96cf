"""Tests of the MXNet Gluon module. They run in the MXNet environment only:
`.venv-mxnet/bin/python -m pytest tests/mxnet` (mxnet 1.9.1 + numpy 1.23.5; no torch there).
Torch reference values come from the main environment through a subprocess and an .npz file."""

import os

# Before any test module imports mxnet (it reads the count once): the in-process tests use tiny
# models, for which OpenMP teams on 2 shared cores cost more than they gain (up to 10x slower
# when another process holds a core). The module runs started by the tests set their own count.
os.environ["OMP_NUM_THREADS"] = "1"
