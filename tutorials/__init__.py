"""The seed tutorials' own training loops, rebuilt on this project's data, model and config.

`python -m benchmarks.tutorial_loops` times each of these against the trainer it seeded, on the
same work (same Config, same arrays from `common.datasets`, same model built by the trainer's
own `build_model`), so that the only difference is the loop: its input pipeline, its per-step
host syncs, whether the step is compiled / hybridized, its evaluation. Each module is written
from the tutorial's published structure (cited in its docstring) and keeps the lines that cost
time as the tutorial has them; where it must differ (no dataset download here, CPU stand-ins
for NCCL), `DEVIATIONS` in the module says so and the record carries that list.
"""

from common.runtime import check_interpreter

check_interpreter()  # run with the wrong interpreter: one line and exit 2, before any import
