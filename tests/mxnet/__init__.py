"""Tests of the MXNet Gluon module. They run in the MXNet environment only:
`.venv-mxnet/bin/python -m pytest tests/mxnet` (mxnet 1.9.1 + numpy 1.23.5; no torch there).
Torch reference values come from the main environment through a subprocess and an .npz file."""
