"""The process-group guard: the leader of every child process group a tool starts.

    python -I -S common/guard.py LIFELINE_FD STATUS_FD GRACE COMMAND...

Started by common.runtime.start_group in a session (and so a process group) of its own, it runs
COMMAND as its child in that group and exits as it exits (the same code, or the same signal), so
to the tool it is the child. Its one other job: when the tool dies, whatever killed it (kill -9,
the OOM killer), end the whole group, COMMAND and everything COMMAND started. It learns of that
death from LIFELINE_FD, the read end of a pipe whose write end only the tool holds (end of file:
the tool is gone), and, as a backstop, from its parent pid changing. The group then gets
SIGTERM (a trainer writes its "interrupted" record), and SIGKILL after GRACE seconds.

A COMMAND that cannot be started is reported on STATUS_FD (close-on-exec: a successful exec
closes it, so the tool reads end of file without a byte) as "<errno>", and the guard exits 127.

Standard library only, no project import: it runs isolated (-I -S) in the tool's interpreter.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time

PARENT_ENV = "DPBENCH_PARENT_PID"  # common.runtime's: a trainer's own watchdog watches this pid
EXEC_FAILED = 127


def _ignore(signum: int, frame: object) -> None:
    """SIGTERM, SIGINT and SIGHUP sent to the group are for COMMAND: the guard waits for it to
    exit (a handler, not SIG_IGN, which COMMAND would inherit through exec)."""


def _tool_gone(lifeline: int, parent: int, wait: float) -> bool:
    """True once the tool is gone: end of file on the lifeline (the tool never writes to it),
    or this process's parent pid changed (a backstop)."""
    if os.getppid() != parent:
        return True
    readable, _, _ = select.select([lifeline], [], [], wait)
    return bool(readable) and not os.read(lifeline, 64)


def _watch(lifeline: int, parent: int, grace: float, done: threading.Event) -> None:
    """Wait until the tool dies; then end the group: SIGTERM, GRACE seconds, SIGKILL."""
    while not _tool_gone(lifeline, parent, 0.5):
        pass
    ending.set()
    os.killpg(0, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while not done.is_set() and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(0, signal.SIGKILL)  # what is left of the group, the guard included


ending = threading.Event()  # set by _watch when it starts ending the group


def _exit_as(status: int) -> None:
    """Exit as the child did: its exit code, or death by the same signal."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            import resource

            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the child's core, not ours
        except (ImportError, OSError, ValueError):
            pass
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # those two cannot be set (EINVAL)
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)  # a signal whose default is not to end a process
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


def main() -> None:
    lifeline, status_fd, grace = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    command = sys.argv[5:] if sys.argv[4] == "--" else sys.argv[4:]
    parent = os.getppid()
    os.set_inheritable(lifeline, False)
    os.set_inheritable(status_fd, False)  # closed by COMMAND's exec
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        if signal.getsignal(sig) != signal.SIG_IGN:  # one the tool ignored stays ignored
            signal.signal(sig, _ignore)
    env = dict(os.environ)
    if PARENT_ENV in env:  # a trainer stops itself if its leader (this process) dies
        env[PARENT_ENV] = str(os.getpid())
    pid = os.fork()
    if pid == 0:
        try:
            os.execvpe(command[0], command, env)
        except OSError as exc:
            os.write(status_fd, str(exc.errno or 0).encode())
        os._exit(EXEC_FAILED)
    os.close(status_fd)
    done = threading.Event()
    watcher = threading.Thread(target=_watch, args=(lifeline, parent, grace, done), daemon=True)
    watcher.start()
    _, status = os.waitpid(pid, 0)
    done.set()
    if ending.is_set():
        watcher.join()  # the watcher is ending the group: it kills this process too
    if _tool_gone(lifeline, parent, 0):  # gone as COMMAND ended: what COMMAND left goes too
        os.killpg(0, signal.SIGKILL)
    _exit_as(status)


if __name__ == "__main__":
    main()
