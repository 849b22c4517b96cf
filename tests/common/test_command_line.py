"""The shared command line is built from the Config fields: every field has help, choices
enforced, only given flags override the preset. Bad values: tests/trainers/test_bad_input.py."""

from __future__ import annotations

import argparse
import dataclasses
import types

import pytest

from common import cli
from common.config import Config, ConfigError, opt, preset

FIELDS = {f.name: f for f in dataclasses.fields(Config)}
SHOWN = [f for f in FIELDS.values() if not f.metadata["hidden"]]


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def fails(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one stderr line of a refused command line (exit code 2)."""
    with pytest.raises(SystemExit) as exc:
        cli.parse_args(argv, "torch-ddp")
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.endswith("(see --help)\n"), err
    return err


def test_every_field_has_help(monkeypatch: pytest.MonkeyPatch) -> None:
    assert [name for name, f in FIELDS.items() if not f.metadata.get("help")] == []
    runner = cli.build_parser("compare", exclude=("gpus", "output"))
    assert {"--gpus", "--output", "--lr"} & set(runner._option_string_actions) == {"--lr"}
    momentum = FIELDS["momentum"]
    monkeypatch.setattr(
        momentum, "metadata", types.MappingProxyType({**momentum.metadata, "help": ""})
    )
    with pytest.raises(TypeError, match="Config.momentum has no help"):
        cli.build_parser("x")


def test_a_new_flag_is_one_field() -> None:
    new = dataclasses.make_dataclass("New", [
        ("knob", int, opt(3, "a new knob")), ("pair", tuple, opt((1, 2), "a pair")),
        ("mode", str, opt("a", "a new mode", choices=("a", "b"))),
        ("switch", bool, opt(False, "a new switch"))])  # fmt: skip
    knob, pair, mode, switch = dataclasses.fields(new)
    assert cli._flag_kwargs(knob) == dict(default=argparse.SUPPRESS, help="a new knob", type=int)
    assert cli._flag_kwargs(mode)["choices"] == ("a", "b")
    assert cli._flag_kwargs(switch)["action"] is argparse.BooleanOptionalAction
    with pytest.raises(TypeError, match="parse="):
        cli._flag_kwargs(pair)  # a tuple cannot be read from text without parse=


@pytest.mark.parametrize("name", [f.name for f in SHOWN if f.metadata["choices"]])
def test_choices_are_enforced(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    choices = FIELDS[name].metadata["choices"]
    err = fails([flag(name), "nope"], capsys)
    assert f"argument {flag(name)}: invalid choice: 'nope'" in err
    assert all(c in err for c in choices), err  # 3.13 names them unquoted
    with pytest.raises(ConfigError, match=", ".join(choices)):
        preset("smoke", **{name: "nope"})  # and by validate(), for configs built in code


@pytest.mark.parametrize("name", [f.name for f in SHOWN if isinstance(f.default, bool)])
def test_bool_flags_have_no_forms(name: str) -> None:
    no = "--no-" + name.replace("_", "-")
    extra = ["--checkpoint-dir", "ckpt"] if name == "resume" else []
    assert getattr(cli.parse_args([flag(name), *extra], "torch-ddp"), name) is True
    assert getattr(cli.parse_args([no], "torch-ddp"), name) is False


def test_given_flags_override_the_preset_and_others_do_not(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DPBENCH_DEVICES")  # the test session's default for --devices
    base = preset("fashion-mnist-d2l")
    assert base.momentum == 0.0 and not base.augment and base.lr == 0.1
    cfg = cli.parse_args(["--preset", "fashion-mnist-d2l", "--lr", "0.3"], "jax-pmap")
    # Not given: the preset's value stays, not Config's default (momentum 0.9, augment on).
    assert cfg.lr == 0.3 and cfg.momentum == 0.0 and not cfg.augment
    assert cfg == base.replace(lr=0.3, framework="jax-pmap")
    # Given, even when equal to Config's default: it overrides.
    cfg = cli.parse_args(
        ["--preset", "fashion-mnist-d2l", "--momentum", "0.9", "--augment"], "torch-ddp"
    )
    assert cfg.momentum == 0.9 and cfg.augment
    # An explicit --batch-size is the global batch, even over a per-device preset.
    argv = ["--preset", "cifar10-wrn-nvidia", "--gpus", "4"]
    assert cli.parse_args(argv, "torch-ddp").batch_size == 1024
    cfg = cli.parse_args([*argv, "--batch-size", "512"], "torch-ddp")
    assert cfg.batch_size == 512 and cfg.batch_per_device == 0


def test_parsed_types_come_from_the_fields() -> None:
    argv = ["--lr-step-epochs", "3,6", "--warmup-start-factor", "none", "--width", "0.5"]
    cfg = cli.parse_args([*argv, "--epochs", "7"], "torch-dp")
    assert cfg.lr_step_epochs == (3, 6) and cfg.warmup_start_factor is None
    assert cfg.width == 0.5 and cfg.epochs == 7 and isinstance(cfg.epochs, int)


def test_nesterov_needs_momentum(capsys: pytest.CaptureFixture[str]) -> None:
    err = fails(["--nesterov", "--momentum", "0"], capsys)
    assert "--nesterov needs --momentum > 0" in err
    with pytest.raises(ConfigError, match="--momentum > 0"):
        preset("smoke", nesterov=True, momentum=0.0)
    assert preset("smoke", nesterov=True, momentum=0.9).nesterov
    assert preset("smoke", nesterov=True, momentum=0.0, optimizer="novograd").nesterov


@pytest.mark.parametrize("name", sorted(cli.PATH_FIELDS))
def test_an_empty_path_is_refused(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`--output "$OUT"` with OUT unset is refused, not a run without its record."""
    assert name in FIELDS and isinstance(FIELDS[name].default, str)
    for empty in ("", " "):
        err = fails([flag(name), empty], capsys)
        assert f"argument {flag(name)}: is empty: give a path" in err
        assert len(err.strip().splitlines()) == 1
