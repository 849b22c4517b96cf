"""Framework-neutral data-and-metrics layer: config, data, sharding, LR schedules, timing, results.

Everything here imports numpy and the standard library only, never a deep-learning framework, so
that every framework module (and the MXNet environment with its old numpy) can use it unchanged.
"""
