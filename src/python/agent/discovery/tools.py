"""Running the node's tools (nvidia-smi, sminfo, ip): bounded in time, never raising.

Discovery is blocking code (sysfs and /proc reads, a few short tool runs), so it is plain
synchronous Python and the agent calls it through `trio.to_thread.run_sync`. Tools therefore
run with `subprocess`, not `trio.run_process`: one synchronous snapshot is simpler to test and
is shared as-is by `llmgw doctor`, and a tool cannot outlive its timeout. Each tool runs in a
session of its own so that a timeout kills whatever it started as well, and a child that
kept our pipes open cannot hang the read.

A tool's result is data (`ToolRun`): "missing" (no such file: the tool is not installed, or
the path is wrong), "failed" (it ran and exited non-zero, or cannot be executed), "timeout"
or "ok". Callers decide what each means; an agent that cannot find nvidia-smi must not look
like a node that has no GPU.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Mapping, Sequence

import attrs

OK = "ok"
MISSING = "missing"
FAILED = "failed"
TIMEOUT = "timeout"

DEFAULT_TIMEOUT_S = 30.0  # nvidia-smi without the persistence daemon takes seconds per GPU


@attrs.frozen(kw_only=True)
class ToolRun:
    argv: tuple[str, ...]
    outcome: str
    returncode: int | None = None
    stdout: str = ""
    stderr: str = ""
    error: str = ""  # why it could not run, for "missing", "failed" without a return code, "timeout"

    @property
    def ok(self) -> bool:
        return self.outcome == OK

    def problem(self) -> str:
        """What went wrong, for a sentence that has already named the tool: "exits 9: <its last words>"."""
        if self.outcome == OK:
            return "ran"
        if self.outcome in (MISSING, TIMEOUT) or self.returncode is None:
            return self.error
        said = _last_words(self.stderr) or _last_words(self.stdout)
        return f"exits {self.returncode}" + (f": {said}" if said else "")


def _last_words(text: str, limit: int = 300) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    said = " ".join(lines[-3:])
    return said if len(said) <= limit else said[: limit - 3] + "..."


def run_tool(
    argv: Sequence[str], *, timeout_s: float = DEFAULT_TIMEOUT_S, env: Mapping[str, str] | None = None
) -> ToolRun:
    argv = tuple(str(a) for a in argv)
    # LC_ALL=C: tools' output is parsed, and a translated message would not match.
    env = {**os.environ, "LC_ALL": "C", **(env or {})}
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            env=env,
            start_new_session=True,
        )
    except FileNotFoundError:
        return ToolRun(argv=argv, outcome=MISSING, error=f"not found at {argv[0]}")
    except OSError as exc:  # PermissionError, a directory, a bad interpreter line
        return ToolRun(argv=argv, outcome=FAILED, error=f"cannot run {argv[0]}: {exc.strerror or exc}")
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_session(proc)
        stdout, stderr = proc.communicate()
        return ToolRun(
            argv=argv,
            outcome=TIMEOUT,
            stdout=stdout,
            stderr=stderr,
            error=f"no answer in {timeout_s:g} s (killed)",
        )
    outcome = OK if proc.returncode == 0 else FAILED
    return ToolRun(argv=argv, outcome=outcome, returncode=proc.returncode, stdout=stdout, stderr=stderr)


def _kill_session(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
