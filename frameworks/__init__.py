"""The five data-parallel trainers: `python -m frameworks.<module> --help`."""

from common.runtime import check_interpreter

check_interpreter()  # run with the wrong interpreter: one line and exit 2, before any import
