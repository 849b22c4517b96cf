"""Not a module of the project: the guard for a trainer started as a script.

`python frameworks/torch_dp.py` puts frameworks/ (not the project root) first on sys.path, so
the trainer's first `from common.... import` finds this file instead of the package common/
and ended in "ModuleNotFoundError: No module named 'common'". Here it is one line naming the
command that works, exit 2. Run as `python -m frameworks.<trainer>`, frameworks/ is not on
sys.path and this file is never imported (it is no `frameworks.common` anyone imports either).
A guard inside common/ cannot do this: common/ is exactly what a script cannot import.
"""

import sys
from pathlib import Path

_script = Path(sys.argv[0] if sys.argv and sys.argv[0] else "frameworks/<trainer>.py")
sys.stderr.write(
    f"{_script.name}: error: run the trainers as modules from the project root: "
    f"python -m frameworks.{_script.stem} (not python {sys.argv[0] or _script})\n"
)
raise SystemExit(2)
