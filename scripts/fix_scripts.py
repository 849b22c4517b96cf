"""Point an environment's console scripts at its own interpreter again.

    python scripts/fix_scripts.py VENV

pip writes the interpreter's absolute path into every console script it installs (a `#!` line,
or for a path with spaces or over 127 characters a `#!/bin/sh` line that `exec`s it). When the
checkout is moved or copied, or packages were installed through another path to the same
environment, those lines name another environment and the script fails with "required file not
found" (or runs another environment's packages) while `VENV/bin/python` still works. This
rewrites those lines, as pip would write them now; it needs no network and no package. Prints
one line per script rewritten. Standard library only: scripts/setup.sh runs it with the
environment's own python.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

SH_EXEC = b"'''exec' "


def interpreter(head: bytes) -> bytes | None:
    """The interpreter a console script starts, from its first two lines (None: not one)."""
    lines = head.split(b"\n")
    first = lines[0]
    if first == b"#!/bin/sh" and len(lines) > 1 and lines[1].startswith(SH_EXEC + b'"'):
        return lines[1][len(SH_EXEC) + 1 :].split(b'"', 1)[0]
    if first.startswith(b"#!") and b"/bin/python" in first:
        return first[2:].split(b" ", 1)[0]
    return None


def header(python: str) -> bytes:
    """The lines pip puts before a console script's code for this interpreter."""
    if " " in python or len(python) > 127:
        return f"#!/bin/sh\n'''exec' \"{python}\" \"$0\" \"$@\"\n' '''\n".encode()
    return f"#!{python}\n".encode()


def fix(venv: Path) -> list[Path]:
    bin_dir = venv / "bin"
    own = os.path.realpath(bin_dir)  # a symlinked environment is still this one, and is
    python = os.path.join(own, "python")  # named by its real path: the link may go, it stays
    fixed = []
    for f in sorted(bin_dir.iterdir()):
        if f.is_symlink() or not f.is_file():
            continue
        try:
            if rewrite(f, own, python):
                fixed.append(f)
        except OSError as exc:  # one script that cannot be read or replaced: said, the rest go on
            print(f"fix_scripts: {f} left as it is: {exc.strerror or exc}", file=sys.stderr)
    return fixed


def rewrite(f: Path, own: str, python: str) -> bool:
    """Point console script `f` at `python` if it names another environment's; True if it did."""
    with open(f, "rb") as fh:
        head = fh.read(4096)
    interp = interpreter(head)
    if interp is None:
        return False
    where = os.path.dirname(interp.decode(errors="replace"))
    if os.path.realpath(where) == own:
        return False
    if os.path.exists(interp) and not os.path.exists(os.path.join(where, "..", "pyvenv.cfg")):
        return False  # a system interpreter (#!/usr/bin/python3), not a moved environment
    data = f.read_bytes()
    header_lines = 3 if data.startswith(b"#!/bin/sh\n") else 1  # pip's sh form: three
    body = b"".join(data.splitlines(keepends=True)[header_lines:])
    tmp = f.with_name(f".{f.name}.fixing")
    try:
        tmp.write_bytes(header(python) + body)
        os.chmod(tmp, f.stat().st_mode)
        os.replace(tmp, f)
    finally:
        tmp.unlink(missing_ok=True)
    return True


if __name__ == "__main__":
    for path in fix(Path(sys.argv[1])):
        print(path)
