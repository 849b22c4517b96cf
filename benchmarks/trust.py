"""Accept checkpoints written elsewhere: `python -m benchmarks.trust FILE [FILE ...]` re-seals
each checkpoint file (torch's .pt, JAX's .msgpack, MXNet's index .json) with this machine's key
once its content matches the sha256 it carries (common/sealed.py). `--resume` refuses a
checkpoint sealed with another key (moved from another machine, written by another user, or
edited with its sha256 rewritten) until it is trusted here. Exit 0, or 2 with one line naming
a file that cannot be trusted (damaged, not a checkpoint)."""

from __future__ import annotations

import sys
from pathlib import Path

from benchmarks import harness
from common.checkpoints import trust_checkpoint
from common.errors import ConfigError
from common.sealed import key_path


def main(argv: list[str] | None = None) -> int:
    p = harness.Parser("trust", description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", metavar="FILE", help="checkpoint files to accept")
    ns = p.parse_args(sys.argv[1:] if argv is None else argv)
    for name in ns.files:
        try:
            trust_checkpoint(Path(name))
        except ConfigError as exc:
            print(f"trust: error: {exc}", file=sys.stderr)
            return 2
        except OSError as exc:  # read-only, a full disk: the file is left as it was
            print(f"trust: error: cannot rewrite {name} ({exc.strerror or exc})", file=sys.stderr)
            return 2
        print(f"trusted {name}: sealed with this machine's key ({key_path()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
