"""Content-bound files: every checkpoint and saved state carries the sha256 of its content,
written in the same atomic write as the content, and checked before anything in it is used.

A zip's CRCs (torch's .pt, numpy's .npz) do not bind a file's content: a tensor changed inside
the archive with its CRCs rewritten to match, or a few bytes flipped in a format without any
check (JAX's msgpack, MXNet's NDArray files), loaded without a word and the run went on from
wrong weights. Three forms, one digest (sha256):

- `seal` / `unseal`: a byte payload (torch's .pt, JAX's .msgpack) followed by one trailer line,
  `SEAL_MAGIC` + the payload's sha256 in hex + a newline (82 bytes).
- `seal_json` / `unseal_json`: a JSON object (MXNet's checkpoint index) with a "sha256" field,
  the digest of the object's other fields in canonical JSON; the index also holds the sha256 of
  each file it names (`check_digest` before MXNet opens one).
- `seal_arrays` / `unseal_arrays`: an .npz (--save-state) whose zip comment is
  {"sha256": the digest of its arrays} (common/init.py's `digest`: names, dtypes, shapes, bytes;
  np.load sees the arrays alone).

A file without its digest, or whose content does not match it, is ConfigError: one line naming
the file and the fix (exit 2), before anything is loaded. numpy and the standard library only.

What it binds: the file to its content, against damage (flipped bytes, a cut, a CRC-consistent
edit, another file in its place). Not against a forger: one who rewrites the digest with the
content makes a file that is theirs, and a key that could tell would stay on this machine, where
a checkpoint moved to another (a run resumed elsewhere, a shared file system) could not be read.
What a resumed run checks besides is that the checkpoint belongs to it (config, epochs, step,
finite weights: common/checkpoints.py).
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import zipfile
from collections.abc import Mapping
from typing import Any

import numpy as np

from common.errors import ConfigError
from common.init import digest

SEAL_MAGIC = b"\n#dp-bench sha256 "
SEAL_BYTES = len(SEAL_MAGIC) + 64 + 1  # the trailer: magic, 64 hex digits, newline
_HEX = re.compile(rb"[0-9a-f]{64}\n")


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def seal(payload: bytes) -> bytes:
    """`payload` and its trailer (written together, in one atomic write)."""
    return payload + SEAL_MAGIC + sha256_hex(payload).encode() + b"\n"


def unseal(data: bytes, where: str, fix: str) -> bytes:
    """The payload of sealed `data` (from `where`, e.g. "checkpoint PATH") once its sha256 is the
    one in its trailer; ConfigError (one line) when the trailer is missing or does not match."""
    payload, tail = data[:-SEAL_BYTES], data[-SEAL_BYTES:]
    if (
        len(data) < SEAL_BYTES
        or not tail.startswith(SEAL_MAGIC)
        or not _HEX.fullmatch(tail[len(SEAL_MAGIC) :])
    ):
        raise ConfigError(
            f"cannot read {where} (it carries no content digest: cut short, damaged, or written "
            f"by an older dp-bench); {fix}"
        )
    check_digest(payload, tail[len(SEAL_MAGIC) : -1].decode(), where, fix)
    return payload


def check_digest(data: bytes, want: Any, where: str, fix: str) -> None:
    """`data`'s sha256 is `want` (hex), else ConfigError naming `where`."""
    got = sha256_hex(data)
    if got != want:
        wanted = f"the {want[:16]}... written with it" if isinstance(want, str) else "recorded"
        raise ConfigError(
            f"cannot read {where} (damaged: the sha256 of its content is {got[:16]}..., not "
            f"{wanted}); {fix}"
        )


def json_digest(obj: Mapping[str, Any]) -> str:
    """sha256 of `obj` without its "sha256" field, as canonical JSON (sorted keys, no spaces)."""
    rest = {k: v for k, v in obj.items() if k != "sha256"}
    return sha256_hex(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode())


def seal_json(obj: Mapping[str, Any]) -> dict[str, Any]:
    return {**obj, "sha256": json_digest(obj)}


def unseal_json(obj: Any, where: str, fix: str) -> dict[str, Any]:
    """`obj` (parsed JSON) once its "sha256" field is the digest of its other fields."""
    if not isinstance(obj, dict) or not isinstance(obj.get("sha256"), str):
        raise ConfigError(
            f"cannot read {where} (it carries no content digest: damaged, or written by an older "
            f"dp-bench); {fix}"
        )
    if json_digest(obj) != obj["sha256"]:
        raise ConfigError(
            f"cannot read {where} (damaged: its fields do not give the sha256 written with "
            f"them); {fix}"
        )
    return obj


def seal_arrays(arrays: Mapping[str, Any]) -> bytes:
    """An .npz of `arrays` whose zip comment holds their digest."""
    plain = {k: np.asarray(v) for k, v in arrays.items()}
    buf = io.BytesIO()
    np.savez(buf, **plain)  # type: ignore[arg-type]  # numpy's stub: allow_pickle in **kwds
    with zipfile.ZipFile(buf, "a") as archive:
        archive.comment = json.dumps({"sha256": digest(plain)}).encode()
    return buf.getvalue()


def unseal_arrays(arrays: Mapping[str, np.ndarray], comment: bytes, where: str, fix: str) -> None:
    """The arrays read from an .npz are the ones its comment's digest names, else ConfigError."""
    try:
        want = json.loads(comment)["sha256"]
    except (ValueError, KeyError, TypeError):
        raise ConfigError(
            f"cannot read {where} (it carries no content digest: damaged, or written by an older "
            f"dp-bench); {fix}"
        ) from None
    if digest(dict(arrays)) != want:
        raise ConfigError(
            f"cannot read {where} (damaged: its arrays do not give the sha256 written with "
            f"them); {fix}"
        )
