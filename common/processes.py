"""Child processes in process groups of their own, that never outlive the process that started
them: the one way the tools (and the trainers' own probes) start a child.

`start_group` runs a command under common/guard.py, the leader of a new session and process
group, which ends the whole group (the command and everything it started) when this process
dies, SIGKILL included. `wait_group` waits for it and kills the group on a timeout or an
interrupt; `end_group` kills what the command left behind once it has exited. `run_captured`
is `subprocess.run(..., capture_output=True, timeout=...)` built from the three, for the short
children: interpreter and device probes, nvidia-smi.

`identity` and `gone` bind a pid to one process (its start time), for a reader of a file that
names the process that wrote it (benchmarks.report: is the runner of a sweep still there?).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

GUARD = Path(__file__).with_name("guard.py")
STOP_GRACE = 2.0  # seconds between SIGTERM (a trainer writes its record) and SIGKILL
CAPTURE_LIMIT = 1 << 20  # the last bytes of a short child's output that run_captured keeps

_lifelines: dict[int, int] = {}  # a live group's id -> the write end of its guard's lifeline
_lock = threading.Lock()


def start_group(
    command: Sequence[str], grace: float = STOP_GRACE, **popen: Any
) -> subprocess.Popen[Any]:
    """Start `command` (Popen's other arguments in `popen`) in a session and process group of
    its own, under common/guard.py, which exits as the command exits and, should this process
    die (even by SIGKILL), ends the group: SIGTERM, `grace` seconds, SIGKILL. The group's id is
    the returned process's pid. Raises OSError, as Popen does, when `command` cannot start.
    Once it has exited, call `end_group`."""
    life_r, life_w = os.pipe()
    status_r, status_w = os.pipe()
    guard = [sys.executable, "-I", "-S", str(GUARD), str(life_r), str(status_w), f"{grace:g}"]
    try:
        proc = subprocess.Popen(
            [*guard, "--", *command],
            start_new_session=True,
            pass_fds=(life_r, status_w),
            **popen,
        )
    except BaseException:
        for fd in (life_r, life_w, status_r, status_w):
            os.close(fd)
        raise
    os.close(life_r)
    os.close(status_w)
    with _lock:
        _lifelines[proc.pid] = life_w
    with open(status_r, "rb") as status:  # end of file: the command's exec succeeded
        failed = status.read()
    if failed:  # the guard exits 127 at once
        proc.wait()
        end_group(proc)
        errno = int(failed) if failed.isdigit() else 0
        raise OSError(errno, os.strerror(errno), command[0])
    return proc


def wait_group(
    proc: subprocess.Popen[Any], timeout: float, start: Callable[[], None] | None = None
) -> tuple[int, Any, str]:
    """Reap the group's leader `proc` (started by `start_group`) with os.wait4, whose resource
    usage covers the leader and its reaped descendants (ru_maxrss: the largest); `start` runs
    first, inside the guard against an interrupt. Returns (wait status, resource usage, how it
    ended): "exited" on its own, "timeout" (`timeout` seconds) or "interrupted" (Ctrl-C, or
    SIGTERM turned into KeyboardInterrupt): in those two the whole group is killed (SIGTERM,
    then SIGKILL after STOP_GRACE seconds). Then `end_group` has run in every case."""
    deadline = time.monotonic() + timeout
    ended = "exited"
    try:
        try:
            if start is not None:
                start()
            while time.monotonic() <= deadline:
                pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    proc.returncode = os.waitstatus_to_exitcode(status)
                    return status, usage, ended
                time.sleep(0.1)
            ended = "timeout"
        except KeyboardInterrupt:
            ended = "interrupted"
        status, usage = _stop(proc)
        proc.returncode = os.waitstatus_to_exitcode(status)
        return status, usage, ended
    finally:
        end_group(proc)


def _stop(proc: subprocess.Popen[Any]) -> tuple[int, Any]:
    """SIGTERM the group of `proc`, SIGKILL what is left after STOP_GRACE seconds; reap `proc`
    meanwhile (a leader waiting to be reaped would keep the group there) and return its wait
    status and resource usage."""
    reaped = None
    for sig, grace in ((signal.SIGTERM, STOP_GRACE), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if reaped is None:
                pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
                reaped = (status, usage) if pid else None
            if reaped is not None and not group_alive(proc.pid):
                return reaped
            time.sleep(0.05)
    if reaped is None:
        _, status, usage = os.wait4(proc.pid, 0)
        reaped = (status, usage)
    return reaped


def end_group(proc: subprocess.Popen[Any]) -> None:
    """Once the leader has exited: kill what is left of its group, and let the guard go."""
    kill_group(proc.pid, grace=0)
    with _lock:
        life_w = _lifelines.pop(proc.pid, None)
    if life_w is not None:
        os.close(life_w)


def end_groups() -> None:
    """Kill every group this process has started that is still running (an interrupt in the main
    thread, while other threads wait for their children)."""
    with _lock:
        groups = list(_lifelines)
    for pgid in groups:
        kill_group(pgid, grace=0)


def kill_group(pgid: int, grace: float = STOP_GRACE) -> None:
    """SIGTERM the process group, then SIGKILL whatever is left after `grace` seconds (at once
    with `grace` 0)."""
    for sig in (signal.SIGTERM, signal.SIGKILL) if grace else (signal.SIGKILL,):
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and group_alive(pgid):
            time.sleep(0.05)


def group_alive(pgid: int) -> bool:
    """Whether a process of group `pgid` still runs: one that is only waiting to be reaped (a
    zombie, whose reaper may be a slow init) does not count."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    try:
        pids = [int(e.name) for e in os.scandir("/proc") if e.name.isdigit()]
    except OSError:  # no /proc: every member counts
        return True
    for pid in pids:
        fields = _stat(pid)
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
            return True
    return False


def run_captured(
    command: Sequence[str], timeout: float, **popen: Any
) -> subprocess.CompletedProcess[str]:
    """`subprocess.run(command, capture_output=True, text=True, timeout=timeout)` for a short
    child, in a process group of its own (`start_group`): on the timeout or an interrupt the
    whole group is killed, not the leader only, and so is what the leader leaves behind when it
    exits (whose open pipes would otherwise hold the wait). The last CAPTURE_LIMIT bytes of each
    output are kept. Raises subprocess.TimeoutExpired and OSError as subprocess.run does, and
    KeyboardInterrupt after the group is killed."""
    outputs: list[bytearray] = [bytearray(), bytearray()]

    def drain(stream: Any, into: bytearray) -> None:
        for chunk in iter(lambda: stream.read1(65536), b""):
            into += chunk
            if len(into) > 2 * CAPTURE_LIMIT:
                del into[:-CAPTURE_LIMIT]

    proc = start_group(
        command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen
    )
    readers = [
        threading.Thread(target=drain, args=(stream, into), daemon=True)
        for stream, into in zip((proc.stdout, proc.stderr), outputs)
    ]

    def start() -> None:
        for reader in readers:
            reader.start()

    try:
        status, _, ended = wait_group(proc, timeout, start)
    finally:
        for reader in readers:
            if reader.ident is not None:
                reader.join(timeout=10)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
    if ended == "interrupted":
        raise KeyboardInterrupt
    if ended == "timeout":
        raise subprocess.TimeoutExpired(list(command), timeout)
    out, err = (bytes(o[-CAPTURE_LIMIT:]).decode(errors="replace") for o in outputs)
    return subprocess.CompletedProcess(list(command), os.waitstatus_to_exitcode(status), out, err)


# -- which process wrote a file -----------------------------------------------------------------


def identity(pid: int | None = None) -> dict[str, Any]:
    """What names one process for as long as it lives, here: host, pid and start time (the boot
    and the clock ticks since it, /proc; pids are reused, this pair is not)."""
    pid = os.getpid() if pid is None else pid
    return {"host": socket.gethostname(), "pid": pid, "start": start_time(pid)}


def _stat(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name (the state is [0]); [] where the
    process is gone or there is no /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()
    except (OSError, ValueError):
        return []


def process_state(pid: int) -> str:
    """A process's state letter from /proc (R running, S sleeping, T stopped, Z zombie ...);
    "" where it is gone or there is no /proc."""
    return (_stat(pid) or [""])[0]


def start_time(pid: int) -> str | None:
    """When process `pid` started, "<boot id>:<clock ticks since boot>" (Linux /proc); None
    where it is gone or there is no /proc."""
    fields = _stat(pid)
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None
    return f"{boot}:{fields[19]}" if len(fields) > 19 else None  # stat's field 22


def gone(who: Any) -> bool | None:
    """Whether the process an `identity` names has ended: True (gone, a zombie, or its pid is
    another process now), False (still there), None (cannot tell: another host, no /proc, not
    an identity)."""
    if not isinstance(who, dict):
        return None
    pid, start = who.get("pid"), who.get("start")
    if not isinstance(pid, int) or isinstance(pid, bool) or not isinstance(start, str):
        return None
    if who.get("host") != socket.gethostname() or start_time(os.getpid()) is None:
        return None
    return start_time(pid) != start or process_state(pid) in ("Z", "X")
