"""Content-bound files: every checkpoint and saved state carries the sha256 of its content,
written in the same atomic write as the content, and checked before anything in it is used.

A zip's CRCs (torch's .pt, numpy's .npz) do not bind a file's content: a tensor changed inside
the archive with its CRCs rewritten to match, or a few bytes flipped in a format without any
check (JAX's msgpack, MXNet's NDArray files), loaded without a word and the run went on from
wrong weights. Three forms, one digest (sha256):

- `seal` / `unseal`: a byte payload (torch's .pt, JAX's .msgpack) followed by one trailer line,
  `SEAL_MAGIC` + the payload's sha256 + " hmac " + its `mac` + a newline (153 bytes).
- `seal_json` / `unseal_json`: a JSON object (MXNet's checkpoint index) with a "sha256" field,
  the digest of the object's other fields in canonical JSON, and its "hmac"; the index also
  holds the sha256 of each file it names (`check_digest` before MXNet opens one).
- `seal_arrays` / `unseal_arrays`: an .npz (--save-state) whose zip comment is
  {"sha256": the digest of its arrays} (common/init.py's `digest`: names, dtypes, shapes, bytes;
  np.load sees the arrays alone).

A file without its digest, or whose content does not match it, is ConfigError: one line naming
the file and the fix (exit 2), before anything is loaded. numpy and the standard library only.

What the sha256 binds: the file to its content, against damage (flipped bytes, a cut, a
CRC-consistent edit, another file in its place). What the hmac binds: a checkpoint to the
machine and user that wrote it, against an edit that rewrote the sha256 with the content (the
sha256 alone let such a file load and a resumed run go on from weights no run had made). It is
the HMAC-SHA256 of the sha256 under `machine_key`, 32 random bytes kept at `key_path()`
($XDG_DATA_HOME/dp-bench/checkpoint.key, mode 600), as Jupyter keeps the key that says which
notebooks this user trusts. A checkpoint moved to another machine, or written by another user,
is refused in one line that names the way to accept it: `python -m benchmarks.trust FILE`
re-seals it with this machine's key once its sha256 holds (a cluster whose nodes share a home
folder shares the key). The key stops an edit made without it, not one made by a process that
can read it (this user's own). --save-state files carry the sha256 alone: they are results, meant
to travel (benchmarks/parity.py reads them from any machine).
"""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import os
import re
import secrets
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from common.errors import ConfigError
from common.init import digest

SEAL_MAGIC = b"\n#dp-bench sha256 "
MAC_MAGIC = b" hmac "
SEAL_BYTES = len(SEAL_MAGIC) + 64 + len(MAC_MAGIC) + 64 + 1  # magic, sha256, hmac, newline
_TAIL = re.compile(rb"([0-9a-f]{64}) hmac ([0-9a-f]{64})\n")
_KEY_TEXT = re.compile(rb"[0-9a-f]{64}\n?")
TRUST = "python -m benchmarks.trust"
_KEYS: dict[Path, bytes] = {}


def key_path() -> Path:
    """Where this user's checkpoint key lives: $XDG_DATA_HOME (an absolute path, as the XDG
    rules ask) or ~/.local/share, then dp-bench/checkpoint.key."""
    base = os.environ.get("XDG_DATA_HOME", "")
    root = Path(base) if os.path.isabs(base) else Path.home() / ".local" / "share"
    return root / "dp-bench" / "checkpoint.key"


def machine_key() -> bytes:
    """This user's checkpoint key (32 bytes), made on first use: written to a temp file of mode
    600 and linked into place, so that two processes that start at once (ranks, tests) keep the
    one that was linked first. ConfigError (one line) when it cannot be kept or is damaged."""
    path = key_path()
    if path in _KEYS:
        return _KEYS[path]
    try:
        if not path.exists():
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, secrets.token_hex(32).encode() + b"\n")
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.link(tmp, path)  # never replaces a key another process linked first
            except FileExistsError:
                pass
            finally:
                os.unlink(tmp)
        with open(path, "rb") as f:
            text = f.read(80)
    except OSError as exc:
        raise ConfigError(
            f"cannot keep the checkpoint key {path} ({exc.strerror or exc}): checkpoints are "
            "sealed with it; set XDG_DATA_HOME to a writable folder"
        ) from None
    if not _KEY_TEXT.fullmatch(text):
        raise ConfigError(
            f"checkpoint key {path} is damaged (not 64 hex digits): delete it (a new one is "
            f"made; checkpoints sealed with the old one then need {TRUST} FILE)"
        )
    _KEYS[path] = bytes.fromhex(text[:64].decode())
    return _KEYS[path]


def mac(sha_hex: str) -> str:
    """HMAC-SHA256 of a sha256 (hex) under this user's checkpoint key."""
    return hmac.new(machine_key(), sha_hex.encode(), "sha256").hexdigest()


def check_mac(sha_hex: str, got: Any, where: str, trust: str, fix: str) -> None:
    """`got` is `mac(sha_hex)`, else ConfigError: the file was sealed with another key."""
    if not (isinstance(got, str) and hmac.compare_digest(mac(sha_hex), got)):
        raise ConfigError(
            f"cannot read {where} (its content matches its sha256, but its seal is not this "
            f"machine's key's ({key_path()}): written on another machine or by another user, "
            f"or edited and its sha256 rewritten); if you trust it: {TRUST} {trust}; else {fix}"
        )


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def seal(payload: bytes) -> bytes:
    """`payload` and its trailer (written together, in one atomic write)."""
    digest_hex = sha256_hex(payload)
    return payload + SEAL_MAGIC + digest_hex.encode() + MAC_MAGIC + mac(digest_hex).encode() + b"\n"


def unseal(data: bytes, where: str, fix: str, trust: str = "FILE", keyed: bool = True) -> bytes:
    """The payload of sealed `data` (from `where`, e.g. "checkpoint PATH") once its sha256 is the
    one in its trailer and (`keyed`) its hmac this machine's; ConfigError (one line) when the
    trailer is missing or does not match. `trust`: the file, for the way to accept it."""
    payload, tail = data[:-SEAL_BYTES], data[-SEAL_BYTES:]
    found = _TAIL.fullmatch(tail[len(SEAL_MAGIC) :]) if tail.startswith(SEAL_MAGIC) else None
    if len(data) < SEAL_BYTES or found is None:
        raise ConfigError(
            f"cannot read {where} (it carries no content digest: cut short, damaged, or written "
            f"by an older dp-bench); {fix}"
        )
    digest_hex = found.group(1).decode()
    check_digest(payload, digest_hex, where, fix)
    if keyed:
        check_mac(digest_hex, found.group(2).decode(), where, trust, fix)
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
    """sha256 of `obj` without its "sha256" and "hmac" fields, as canonical JSON (sorted keys,
    no spaces)."""
    rest = {k: v for k, v in obj.items() if k not in ("sha256", "hmac")}
    return sha256_hex(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode())


def seal_json(obj: Mapping[str, Any]) -> dict[str, Any]:
    digest_hex = json_digest(obj)
    rest = {k: v for k, v in obj.items() if k not in ("sha256", "hmac")}
    return {**rest, "sha256": digest_hex, "hmac": mac(digest_hex)}


def unseal_json(
    obj: Any, where: str, fix: str, trust: str = "FILE", keyed: bool = True
) -> dict[str, Any]:
    """`obj` (parsed JSON) once its "sha256" field is the digest of its other fields and (`keyed`)
    its "hmac" this machine's."""
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
    if keyed:
        check_mac(obj["sha256"], obj.get("hmac"), where, trust, fix)
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
