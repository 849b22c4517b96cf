"""The six data-parallel trainers: `python -m frameworks.<module> --help`."""

from common.runtime import check_interpreter

check_interpreter()  # run with the wrong interpreter: one line and exit 2, before any import

from common.cli import check_command_line  # noqa: E402  (imports numpy: after that check)

check_command_line()  # bad flags: one line and exit 2, before torch, JAX or MXNet loads
