"""JSON that the tools read back (run records, a comparison's config.json, breakdowns, tables,
traces), parsed and checked before any field of it is used. numpy-free, stdlib only.

- `parse`: nesting deeper than MAX_DEPTH, a number literal that overflows a float (1e999) and an
  integer of more than MAX_INT_DIGITS digits are refused while parsing (were: RecursionError,
  OverflowError where the value was used, ValueError past Python's 4300 digits). NaN and
  Infinity, which json.dumps writes for a diverged run's loss, parse.
- `check`: the fields a reader uses have the types it needs (were: AttributeError, TypeError
  and KeyError deep in a table's code). A schema is a Python type (`int`: an integer, not a
  bool; `float`: any number; `str`, `bool`, `dict`, `list`; `object`: anything), a tuple of
  schemas (any of them; None: null), `[S]` (a list of S), `{key: S}` (an object whose keys, where
  present, match; `Required(S)`: the key must be there) or `Whole(lo, hi)` (an integer in range).
  Keys a schema does not name are not checked: a reader names what it reads.

Each refusal is `Refused`: one line naming the file, the field and what is wrong; the tools turn
it into exit 2.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

MAX_DEPTH = 64  # a run record nests 4 deep; a trace 3
MAX_INT_DIGITS = 20  # a uint64: byte counts, seeds, nanosecond times, MXNet traces' thread ids


class Refused(Exception):
    """JSON that a reader cannot use: one line naming the file and the field."""


@dataclass(frozen=True)
class Required:
    schema: Any


@dataclass(frozen=True)
class Whole:
    """An integer (not a bool) in [lo, hi]."""

    lo: int = 0
    hi: int = 2**63 - 1


class _OutOfRange:
    """A number literal no reader can use, kept where it stood until `_walk` names its field."""

    def __init__(self, why: str) -> None:
        self.why = why


def _int(text: str) -> Any:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        return _OutOfRange(f"an integer of {digits} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def _float(text: str) -> Any:
    value = float(text)
    if value in (float("inf"), float("-inf")):  # a literal past float's range, e.g. 1e999
        return _OutOfRange(f"the number {text[:40]}, out of range")
    return value


def parse(raw: bytes | str, where: str) -> Any:
    """The JSON value in `raw` (from file `where`), within MAX_DEPTH and number bounds; Refused
    otherwise. Text that is no JSON at all raises ValueError (json.JSONDecodeError), as before:
    a reader may call a truncated record "damaged"."""
    try:
        value = json.loads(raw, parse_int=_int, parse_float=_float)
    except RecursionError:
        raise Refused(f"{where}: nested deeper than {MAX_DEPTH} levels") from None
    _walk(value, where)
    return value


def _path(link: tuple[Any, ...] | None) -> str:
    keys: list[Any] = []
    while link is not None:
        link, key = link
        keys.append(key)
    name = "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in reversed(keys))
    return name.lstrip(".") if len(name) <= 60 else f"{name.lstrip('.')[:60]}..."


def _walk(value: Any, where: str) -> None:
    """Depth and numbers, iteratively: a value nested just under the parser's limit must not
    overflow a reader's recursion (json.dumps, copy.deepcopy) either. Paths are linked pairs,
    built into a field name only for the message."""
    stack: list[tuple[Any, int, tuple[Any, ...] | None]] = [(value, 1, None)]
    while stack:
        v, depth, link = stack.pop()
        if isinstance(v, _OutOfRange):
            name = f"field {_path(link)}" if link else "its top level"
            raise Refused(f"{where}: {name} is {v.why}")
        if isinstance(v, dict | list):
            if depth > MAX_DEPTH:
                raise Refused(f"{where}: nested deeper than {MAX_DEPTH} levels at {_path(link)}")
            items = v.items() if isinstance(v, dict) else enumerate(v)
            stack.extend((c, depth + 1, (link, k)) for k, c in items)


def shown(value: Any) -> str:
    """`value` in a message: its JSON type and a short excerpt."""
    kind = {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            int: "an integer", float: "a number", type(None): "null"}  # fmt: skip
    if isinstance(value, dict | list):  # not dumped whole to show a few characters
        return f"{kind[type(value)]} of {len(value)} items"
    text = json.dumps(value)
    text = text if len(text) <= 40 else f"{text[:40]}..."
    return f"{kind.get(type(value), type(value).__name__)} {text}"


def _expected(schema: Any) -> str:
    if isinstance(schema, tuple):
        return " or ".join(_expected(s) for s in schema)
    if isinstance(schema, Whole):
        hi = "" if schema.hi == 2**63 - 1 else f" <= {schema.hi}"
        return f"an integer >= {schema.lo}{hi}"
    if isinstance(schema, list):
        return "a list"
    if isinstance(schema, dict):
        return "an object"
    names = {int: "an integer", float: "a number", str: "a string", bool: "a boolean",
             dict: "an object", list: "a list", None: "null"}  # fmt: skip
    return names.get(schema, str(schema))


def _matches(value: Any, schema: Any) -> bool:
    """Does `value` have the shape of `schema`, at this level (not inside)?"""
    if schema is object:
        return True
    if schema is None:
        return value is None
    if isinstance(schema, tuple):
        return any(_matches(value, s) for s in schema)
    if isinstance(schema, Whole):
        return _matches(value, int) and schema.lo <= value <= schema.hi
    if isinstance(schema, list):
        return isinstance(value, list)
    if isinstance(schema, dict):
        return isinstance(value, dict)
    if schema is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if schema is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, schema)


def check(value: Any, schema: Any, where: str, field: str = "") -> Any:
    """`value` unchanged if it matches `schema` (module doc), else Refused naming `where` and the
    field (`runs[2].devices`)."""
    if not _matches(value, schema):
        name = f"field {field}" if field else "its top level"
        raise Refused(f"{where}: {name} is {shown(value)}, not {_expected(schema)}")
    if isinstance(schema, tuple):  # the first alternative it matches decides what is inside
        return check(value, next(s for s in schema if _matches(value, s)), where, field)
    if isinstance(schema, list) and schema:
        for i, item in enumerate(value):
            check(item, schema[0], where, f"{field}[{i}]")
    elif isinstance(schema, dict):
        for key, sub in schema.items():
            required = isinstance(sub, Required)
            if key not in value:
                if required:
                    raise Refused(f"{where}: no field {f'{field}.' if field else ''}{key}")
                continue
            check(value[key], sub.schema if required else sub, where, f"{field}.{key}".lstrip("."))
    return value


def load(raw: bytes | str, schema: Any, where: str) -> Any:
    """`parse` then `check`."""
    return check(parse(raw, where), schema, where)
