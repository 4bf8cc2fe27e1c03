"""Run the real `llmgw` CLI as a child process, the way an operator would: at once to its end
(`run_llmgw`), or as a long-lived `Proc` whose output goes to a log file of its own, read back as
its JSON events and shown by its tail when a wait fails. A test's setup steps that are not what
it tests (a cluster's CA, a node's key and certificate) run the command's own code in the test's
process instead (`llmgw_here`): a process of its own spends 0.25-0.3 CPU-s importing for them.

Under Pants a test runs inside a PEX, so a bare `python -m llmgw` would not see the
third-party packages; the child gets this process's `sys.path` through PYTHONPATH.
`umask(...)` sets the umask the processes started inside it inherit.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from testlib import activation

REPO_MARKER = "pants.toml"
STOP_TIMEOUT_S = 10.0
TAIL_LINES = 40


def llmgw_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    env.update(extra or {})
    return env


def run_llmgw(*args: str, env: dict[str, str] | None = None, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "llmgw", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=llmgw_env(env),
        check=False,
        **kw,
    )


def llmgw_here(*args: str) -> str:
    """`llmgw COMMAND ARGS` run in this process: the command's parser and `run`, as `llmgw.cli`
    runs them, without its logging set up (this process's stays as it was). Its standard output; a
    refusal (an LlmgwError or a status other than 0) fails the test with the command's message."""
    from llmgw.cli import build_parser
    from llmgw.errors import LlmgwError

    command, *rest = args
    parsed = build_parser(command).parse_args(rest)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            status = parsed.run(parsed)
    except LlmgwError as exc:
        raise AssertionError(f"`llmgw {shlex.join(args)}` refused: {exc}") from None
    if status:
        raise AssertionError(f"`llmgw {shlex.join(args)}` exited {status}; it said:\n{out.getvalue()}")
    return out.getvalue()


def build_root() -> Path:
    """The directory Pants runs the test in (the sandbox root), or the checkout outside Pants."""
    here = Path.cwd()
    for d in (here, *here.parents):
        if (d / REPO_MARKER).exists() or (d / "docs").is_dir():
            return d
    return here


@contextmanager
def umask(value: int) -> Iterator[None]:
    """This process's umask while inside, and so that of the processes started there."""
    old = os.umask(value)
    try:
        yield
    finally:
        os.umask(old)


class Proc:
    """One child process whose standard output and error go to one log file."""

    def __init__(
        self,
        name: str,
        args: list[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        *,
        sockets: list[socket.socket] | None = None,
        prefix: list[str] | None = None,
    ) -> None:
        """`sockets`: listening sockets passed to it as systemd's socket activation does.
        `prefix`: a command that runs it (`ip netns exec NAME`), exec'ing it in its own pid."""
        self.name = name
        self.log_path = log_path
        self._log = log_path.open("wb")
        command = [*(prefix or ()), sys.executable, "-m", "llmgw", *args]
        self.popen = subprocess.Popen(
            activation.argv(command, sockets) if sockets else command,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=llmgw_env(env),
            pass_fds=[s.fileno() for s in sockets or ()],
        )

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def events(self, event: str | None = None) -> list[dict[str, Any]]:
        """The JSON log lines written so far (other lines, e.g. tracebacks, are skipped)."""
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            if not line.startswith("{"):
                continue
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line still being written
            if event is None or record.get("event") == event:
                out.append(record)
        return out

    def tail(self, lines: int = TAIL_LINES) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        status = "running" if self.returncode is None else f"exited {self.returncode}"
        return f"--- {self.name} ({status}) {self.log_path} ---\n" + "\n".join(text)

    def stop(self, sig: signal.Signals, timeout: float = STOP_TIMEOUT_S) -> int | None:
        """Send `sig` and wait; the exit status, or None if it did not exit in time (then it is killed)."""
        if self.returncode is not None:
            return self.returncode
        self.popen.send_signal(sig)
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait(STOP_TIMEOUT_S)
        self._log.close()


def tails(procs: Iterable[Proc]) -> str:
    return "\n".join(p.tail() for p in procs)
