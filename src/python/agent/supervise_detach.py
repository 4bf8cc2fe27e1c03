"""Detaching the agent supervisor (`llmgw agent supervise --daemon`, `agent.supervise`): fork,
setsid, fork, and the ready pipe through which the daemon tells the original process that it
runs (its pid) or why it could not start.

Invariants:
- The daemon has no controlling terminal, is no session leader, runs in `/`, and holds none of
  the caller's stdin, stdout or stderr (an SSH channel closes at once): its stdout and stderr are
  the log file.
- A forked child never unwinds into its parent's code: a failure while detaching ends it with
  `os._exit`, and the original process reads end of file and says the daemon did not start.
- The original process waits for the daemon's word bounded (`wait_ready`); a daemon whose
  caller gave up still runs, and its pid file tells the truth.
"""

from __future__ import annotations

import os
import select
import sys
import time
from pathlib import Path

import attrs

from llmgw.errors import MachineError


@attrs.frozen
class Detached:
    """One side of `detach`: the original process reads the ready pipe, the daemon writes it."""

    original: bool
    fd: int


def detach(log_fd: int) -> Detached:
    """Fork, setsid, fork: the daemon has no controlling terminal and is no session leader."""
    sys.stdout.flush()
    sys.stderr.flush()
    read_end, write_end = os.pipe()
    middle = os.fork()
    if middle:
        os.close(write_end)
        os.waitpid(middle, 0)  # it exits as soon as it has forked the daemon
        return Detached(original=True, fd=read_end)
    try:
        os.close(read_end)
        os.setsid()
        if os.fork():
            os._exit(0)
        os.chdir("/")
        os.umask(0o022)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        # The caller's stdout and stderr (an SSH channel, a test's pipes) are let go here.
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
    except BaseException:  # noqa: BLE001 - a forked child must never unwind into its parent's code
        os._exit(1)  # the original reads end of file and says the daemon did not start
    return Detached(original=False, fd=write_end)


class ReadyPipe:
    """The daemon's end of the ready pipe: its pid once it runs, or why it could not start."""

    def __init__(self, fd: int) -> None:
        self.fd: int | None = fd

    def send(self, text: str) -> None:
        if self.fd is None:
            return
        try:
            os.write(self.fd, text.encode()[:4000])
        except OSError:
            pass  # the caller gave up waiting (and said so); the pid file still tells the truth
        finally:
            os.close(self.fd)
            self.fd = None


def wait_ready(read_end: int, *, timeout_s: float, log_file: Path, pid_file: Path) -> int:
    """The original process's end: the daemon's pid, once it says it runs."""
    deadline = time.monotonic() + timeout_s
    data = b""
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([read_end], [], [], left)[0]:
                raise MachineError(
                    f"the agent supervisor did not say it runs within {timeout_s:g} s; see {log_file}, and "
                    f"stop it with `llmgw agent stop --pid-file {pid_file}` before starting it again"
                )
            chunk = os.read(read_end, 4096)
            if not chunk:
                break
            data += chunk
    finally:
        os.close(read_end)
    text = data.decode(errors="replace").strip()
    if text.isdigit():
        return int(text)
    raise MachineError(f"the agent supervisor did not start: {text or 'it exited at once'}; see {log_file}")
