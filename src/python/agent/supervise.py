"""`llmgw agent supervise` and `llmgw agent stop`: llmgw's own supervisor for the agent, used
where systemd is not the init (containers, some VMs).

It runs one child (`llmgw agent run --config ...`) with stdin from /dev/null and stdout and
stderr appended to the log file, starts it again after it exits (`CHILD_BACKOFF`), and
on SIGTERM or SIGINT stops it (SIGTERM, then SIGKILL to its process group after 10 s) and exits 0.

Its parts: the pid file, locked while a supervisor runs (`agent.supervise_pidfile`), and
detaching with `--daemon` (`agent.supervise_detach`); here the child's loop and the two commands.

Invariants:
- The lock, not the number written in the pid file, says whether a supervisor runs
  (`supervise_pidfile`): `stop` signals a pid only while its lock is held.
- The lock is taken before detaching (`--daemon`), so a refusal is an ordinary error at the
  caller's terminal; the daemon keeps it through fork.
- Paths and the child's command are made absolute before detaching: the daemon runs in `/`.
- The daemon reports "ready" (pid written, signal handlers in place) through a pipe the original
  process waits on, bounded.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TextIO

import attrs
import trio

from agent.supervise_detach import ReadyPipe, detach, wait_ready
from agent.supervise_pidfile import PidFile, holder
from llmgw import log as llmgw_log
from llmgw.backoff import Backoff, Failures
from llmgw.errors import MachineError
from llmgw.selfexec import llmgw_command

log = llmgw_log.get_logger("llmgw.agent.supervise")

DEFAULT_PID_FILE = "/run/llmgw-agent.pid"
DEFAULT_LOG = "/var/log/llmgw-agent.log"
STOP_TIMEOUT_S = 10.0  # SIGTERM to SIGKILL of the child
KILL_WAIT_S = 5.0  # after SIGKILL, for the kernel to reap it
READY_TIMEOUT_S = 30.0  # how long `--daemon` waits for the daemon to say it runs
DEFAULT_STOP_WAIT_S = 20.0  # `stop`: more than the child's SIGTERM-to-SIGKILL time
POLL_S = 0.05


# The first restart waits 1 s, each quick one after it twice as long up to 30 s; a child that
# stayed up 60 s was healthy, and the next wait is 1 s again.
CHILD_BACKOFF = Backoff(first_s=1.0, max_s=30.0, healthy_s=60.0)


@attrs.frozen(kw_only=True)
class Spec:
    """What one supervisor runs and where it keeps its files; every path absolute."""

    argv: tuple[str, ...]
    pid_file: Path
    log_file: Path
    env: Mapping[str, str] | None = None  # None: this process's environment
    backoff: Backoff = CHILD_BACKOFF
    stop_timeout_s: float = STOP_TIMEOUT_S


def agent_argv(config: Path, *, log_level: str = "info", log_format: str = "kv") -> tuple[str, ...]:
    """`llmgw agent run` by this same llmgw: the zipapp at /usr/local/bin/llmgw, a PEX, or `-m llmgw`."""
    return (
        *llmgw_command(),
        "--log-level",
        log_level,
        "--log-format",
        log_format,
        "agent",
        "run",
        "--config",
        str(config.absolute()),
    )


def child_env(environ: Mapping[str, str]) -> dict[str, str]:
    """This environment with PYTHONPATH made absolute, so that `python -m llmgw` from a checkout
    still finds the same code once a daemon has moved to `/`."""
    env = dict(environ)
    if env.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) for p in env["PYTHONPATH"].split(os.pathsep) if p)
    return env


# -- the child -------------------------------------------------------------------------------


def _exit_fields(code: int | None) -> dict[str, object]:
    if code is None:
        return {"exit_status": "not_started"}
    if code < 0:
        try:
            return {"signal": signal.Signals(-code).name}
        except ValueError:
            return {"signal": -code}
    return {"exit_status": code}


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


async def _stop_child(proc: trio.Process, timeout_s: float) -> None:
    """SIGTERM, then SIGKILL to its process group after `timeout_s`; shielded and bounded."""
    with trio.CancelScope(shield=True), trio.move_on_after(timeout_s + KILL_WAIT_S):
        log.info("agent_stopping", pid=proc.pid, signal="SIGTERM")
        proc.send_signal(signal.SIGTERM)
        with trio.move_on_after(timeout_s):
            await proc.wait()
        if proc.returncode is None:
            log.warning("agent_kill", pid=proc.pid, after_s=timeout_s)
            _signal_group(proc.pid, signal.SIGKILL)
            await proc.wait()
        log.info("agent_stopped", pid=proc.pid, **_exit_fields(proc.returncode))


async def serve_child(spec: Spec, log_fd: int, *, task_status: trio.TaskStatus[int | None]) -> None:
    """Run the child, and again after each exit, until cancelled; cancelling stops the child."""
    failures = Failures(spec.backoff)
    started = False
    while True:
        try:
            proc: trio.Process | None = await trio.lowlevel.open_process(
                list(spec.argv),
                env=None if spec.env is None else dict(spec.env),
                stdin=subprocess.DEVNULL,
                stdout=log_fd,
                stderr=log_fd,
                start_new_session=True,  # its own group: a SIGKILL reaches what it started too
            )
        except OSError as exc:
            log.error("agent_start_failed", command=shlex.join(spec.argv), reason=exc.strerror or str(exc))
            proc = None
        if not started:
            task_status.started(proc.pid if proc else None)
            started = True
        began = trio.current_time()
        if proc is not None:
            log.info("agent_started", pid=proc.pid, command=shlex.join(spec.argv))
            try:
                await proc.wait()
            finally:
                if proc.returncode is None:
                    await _stop_child(proc, spec.stop_timeout_s)
        now = trio.current_time()
        uptime = now - began
        failures.failed(now, ran_s=uptime)
        delay = failures.delay()
        log.warning(
            "agent_exited",
            pid=proc.pid if proc else 0,
            **_exit_fields(proc.returncode if proc else None),
            uptime_s=round(uptime, 1),
            restart_in_s=delay,
        )
        await trio.sleep(delay)


async def _supervise(spec: Spec, pid_file: PidFile, log_fd: int, ready: Callable[[int], None]) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        pid_file.write_pid(os.getpid())
        log.info("supervisor_started", pid=os.getpid(), pid_file=str(spec.pid_file), log=str(spec.log_file))
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                async for signum in signals:
                    log.info("supervisor_stopping", signal=signal.Signals(signum).name)
                    nursery.cancel_scope.cancel()
                    return

            nursery.start_soon(watch)
            await nursery.start(serve_child, spec, log_fd)
            ready(os.getpid())
    log.info("supervisor_stopped", pid=os.getpid())


# -- the commands ----------------------------------------------------------------------------


def open_log(path: Path) -> int:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise MachineError(
            f"cannot open the log file {path}: {exc.strerror}; pass --log in a directory you can write"
        ) from None


def run(
    spec: Spec,
    *,
    daemon: bool = False,
    out: TextIO | None = None,
    log_level: str = "info",
    log_format: str = "kv",
    ready_timeout_s: float = READY_TIMEOUT_S,
) -> int:
    """Supervise until SIGTERM or SIGINT (exit 0). With `daemon`, the calling process returns
    once the detached supervisor runs, having printed its pid."""
    out = out or sys.stdout
    log_fd = open_log(spec.log_file)
    try:
        pid_file = PidFile.acquire(spec.pid_file)
    except BaseException:
        os.close(log_fd)
        raise
    pipe: ReadyPipe | None = None
    if daemon:
        side = detach(log_fd)
        if side.original:
            pid = wait_ready(side.fd, timeout_s=ready_timeout_s, log_file=spec.log_file, pid_file=spec.pid_file)
            print(f"agent supervisor started, pid {pid}, log {spec.log_file}", file=out, flush=True)
            return 0
        pipe = ReadyPipe(side.fd)

    def ready(pid: int) -> None:
        if pipe is not None:
            pipe.send(f"{pid}\n")
            return
        print(
            f"agent supervisor running, pid {pid}, log {spec.log_file}; "
            f"stop it with `llmgw agent stop --pid-file {spec.pid_file}`",
            file=out,
            flush=True,
        )

    try:
        llmgw_log.setup(level=log_level, fmt=log_format, stream=os.fdopen(os.dup(log_fd), "a", buffering=1))
        trio.run(_supervise, spec, pid_file, log_fd, ready)
    except BaseException as exc:
        if pipe is not None:
            pipe.send(f"{exc.__class__.__name__}: {exc}")  # nothing when it was ready already
        raise
    finally:
        pid_file.release()
        os.close(log_fd)
    return 0


def stop(pid_file: Path, *, timeout_s: float = DEFAULT_STOP_WAIT_S, out: TextIO | None = None) -> int:
    """SIGTERM the supervisor holding `pid_file` and wait until it has let go. Not running is
    not an error: node add and node remove both call this whatever the node's state."""
    out = out or sys.stdout
    deadline = time.monotonic() + timeout_s
    held = holder(pid_file)
    if not held.exists:
        print(f"agent supervisor not running (no pid file {pid_file})", file=out)
        return 0
    while held.locked and held.pid is None and time.monotonic() < deadline:
        time.sleep(POLL_S)  # a supervisor starting: locked, its pid not written yet
        held = holder(pid_file)
    if not held.locked:
        stale = f"; {pid_file} names pid {held.pid}, which does not hold it" if held.pid else ""
        print(f"agent supervisor not running{stale}", file=out)
        return 0
    if held.pid is None:
        raise MachineError(
            f"{pid_file} is locked but holds no pid after {timeout_s:g} s; see who holds it: fuser -v {pid_file}"
        )
    pid = held.pid
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass  # it exited just now; the lock says so below
    except PermissionError:
        raise MachineError(f"not allowed to signal the agent supervisor (pid {pid}); run as its user or root") from None
    began = time.monotonic()
    while holder(pid_file).locked:
        if time.monotonic() >= deadline:
            raise MachineError(
                f"the agent supervisor (pid {pid}) still runs {timeout_s:g} s after SIGTERM; see its log, "
                f"or end it with `kill -KILL {pid}` (its agent then stays behind: kill that too)"
            )
        time.sleep(POLL_S)
    print(f"agent supervisor stopped (pid {pid}, SIGTERM, {time.monotonic() - began:.1f} s)", file=out)
    return 0
