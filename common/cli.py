"""The one command line shared by every `python -m frameworks.<name>` (and passed through by the
benchmark runner). Parsing happens only when `parse_args` is called, never at import time.

Every flag is built from a `Config` field and the metadata beside it (`common.config.opt`: help,
choices, parse, hidden), so a new flag is one edit in `common/config.py`.
Bad values give one line, `<prog>: error: <problem and fix> (see --help)`, and exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Collection, Sequence
from typing import Any, NoReturn

from common import devices
from common.config import PRESETS, Config, preset
from common.errors import ConfigError
from common.memory import check_machine
from common.runtime import ENTRY_POINTS, module_command


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one clear line, exit 2
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


# Flags that name a file or directory: an empty value (`--output "$OUT"` with OUT unset) is
# refused, not taken as "none" (the run would go on without its record or checkpoints).
PATH_FIELDS = frozenset(
    "output tensorboard checkpoint_dir save_state profile_dir cache_dir data_dir".split()
)


def _path(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty: give a path, or leave the flag out")
    return text


def _flag_kwargs(f: dataclasses.Field[Any]) -> dict[str, Any]:
    """argparse keywords for Config field `f`, from its metadata and the type of its default
    (SUPPRESSed: only flags given on the command line override the preset)."""
    meta = f.metadata
    if not meta.get("help"):
        raise TypeError(f"Config.{f.name} has no help: declare it with opt(default, help, ...)")
    kwargs: dict[str, Any] = dict(default=argparse.SUPPRESS, help=meta["help"])
    if meta.get("parse"):
        kwargs["type"] = meta["parse"]
    elif f.name in PATH_FIELDS:
        kwargs["type"] = _path
    elif isinstance(f.default, bool) or meta.get("switch"):
        kwargs["action"] = argparse.BooleanOptionalAction
    elif isinstance(f.default, (int, float, str)):
        kwargs["type"] = type(f.default)
    else:
        raise TypeError(f"Config.{f.name}: give opt(..., parse=...) to read it from text")
    if meta.get("choices"):
        kwargs["choices"] = meta["choices"]
    return kwargs


def build_parser(prog: str, exclude: Collection[str] = ()) -> argparse.ArgumentParser:
    """The shared flags; `exclude` leaves out fields a caller sets itself (the benchmark runner
    owns --gpus and --output)."""
    parser = _Parser(prog=prog, description="Train an image classifier with data parallelism.")
    # The preset is chosen first, then the flags given override it: the one flag with a default.
    fields = {f.name: f for f in dataclasses.fields(Config)}
    parser.add_argument(
        "--preset",
        default=fields["preset"].default,
        help=f"{fields['preset'].metadata['help']}: {', '.join(PRESETS)}",
    )
    for f in fields.values():
        if f.metadata.get("hidden") or f.name in exclude:
            continue
        parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, **_flag_kwargs(f))
    return parser


class _Checking(_Parser):
    def error(self, message: str) -> NoReturn:  # for a tool checking a child's flags
        raise ConfigError(message)


def check_args(argv: Sequence[str], framework: str) -> Config:
    """The Config a trainer would resolve from `argv`, or ConfigError naming the first problem:
    a tool that starts trainers (benchmarks.analysis.ab) refuses bad flags before any run starts."""
    parser = build_parser(f"python -m frameworks.{framework.replace('-', '_')}")
    parser.__class__ = _Checking
    ns = parser.parse_args(list(argv))
    return resolved(ns, framework)


def overrides_of(ns: argparse.Namespace) -> dict[str, Any]:
    """The Config values the command line gave (every flag's default is SUPPRESSed), plus
    --devices from DPBENCH_DEVICES where the flag was not given (ConfigError on a bad value)."""
    overrides = {k: v for k, v in vars(ns).items() if k != "preset"}  # only flags given
    if "batch_size" in overrides:  # an explicit global batch wins over a per-device preset
        overrides.setdefault("batch_per_device", 0)
    if "devices" not in overrides:
        try:
            chosen = devices.default()
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if chosen:
            overrides["devices"] = chosen
    return overrides


def resolved(ns: argparse.Namespace, framework: str) -> Config:
    """The Config of parsed flags `ns`; --batch-size and --batch-per-device both given (not by a
    preset) and disagreeing is refused."""
    overrides = overrides_of(ns)
    cfg = preset(ns.preset, framework=framework, **overrides)
    check_machine(cfg)  # what this machine can hold at all (common/memory.py)
    given, per_device = overrides.get("batch_size"), overrides.get("batch_per_device", 0)
    if given is not None and per_device > 0 and given != cfg.batch_size:
        raise ConfigError(
            f"--batch-size {given} disagrees with --batch-per-device {per_device} x --gpus "
            f"{cfg.gpus} = {cfg.batch_size}: give only one of the two flags"
        )
    return cfg


def parse_args(argv: Sequence[str] | None, framework: str, prog: str | None = None) -> Config:
    """Parse the shared command line into a resolved Config (exit 2 with one line on bad input)."""
    prog = prog or f"python -m frameworks.{framework.replace('-', '_')}"
    parser = build_parser(prog)
    ns = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        return resolved(ns, framework)
    except ConfigError as exc:
        parser.error(str(exc))


def check_command_line(argv: Sequence[str] | None = None) -> None:
    """`python -m frameworks.<name> args`: the command line parsed and resolved as the trainer's
    `main()` will, before the module imports its framework (the package's `__init__` calls it),
    so that bad input is one line and exit 2 before torch's or JAX's 2-3 s import. For any
    other command it does nothing; the checks that need the framework or the disk stay in main."""
    command = module_command(argv)
    if command is None:
        return
    module, args = command
    package, _, name = module.partition(".")
    if package == "frameworks" and module in ENTRY_POINTS:
        parse_args(args, name.replace("_", "-"), prog=f"python -m {module}")
