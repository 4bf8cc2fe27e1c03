"""A gateway's processes: the parent runs N workers (`llmgw gateway ... --worker-index I`, the
same llmgw run again, `llmgw.selfexec`) and keeps them running; each worker binds the listening
port itself with SO_REUSEPORT, so the kernel spreads connections among them and none passes
through the parent.

The parent and each worker share a socket pair, the worker's end passed as `--parent-fd`:
- the worker writes one line on it once it serves (`ParentLink.ready`): until then the worker is
  starting, and a first run that ends before it is ready ends the gateway (`WorkerFailed`: a
  port taken or a certificate missing would end every restart the same way);
- a worker that ends after it was ready is started again after `WORKER_BACKOFF`;
- the worker reads its end until EOF: the parent is gone (killed, however it died), and the
  worker stops as on SIGTERM (`ParentLink.watch`), so no worker outlives its parent.

Workers lead sessions of their own, so a terminal's Ctrl-C reaches the parent alone, which stops
each worker once: SIGTERM (the worker drains its requests in flight, `worker.DRAIN_S`), then
SIGKILL to its process group past the drain and `STOP_GRACE_S`.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path

import attrs
import trio

from llmgw.backoff import Backoff, Failures
from llmgw.gatewayd import figures
from llmgw.gatewayd.errors import WorkerFailed
from llmgw.log import get_logger

log = get_logger("llmgw.gatewayd")

# The first restart waits 1 s, each quick one after it twice as long up to 30 s; a worker that
# served 60 s was healthy, and the next wait is 1 s again.
WORKER_BACKOFF = Backoff(first_s=1.0, max_s=30.0, healthy_s=60.0)
STOP_GRACE_S = 5.0  # past a worker's drain: SIGKILL
KILL_WAIT_S = 5.0  # after SIGKILL, for the kernel to reap it
READY = b"ready\n"


@attrs.frozen(kw_only=True)
class WorkerCommand:
    argv: tuple[str, ...]  # a worker's command, without --worker-index and --parent-fd
    drain_s: float
    env: Mapping[str, str] | None = None  # None: this process's
    pass_fds: tuple[int, ...] = ()  # open in each worker under the same numbers (listening sockets)
    figures_dir: Path | None = None  # where the workers share their figures: an ended worker's file goes


def worker_argv(command: WorkerCommand, index: int, parent_fd: int) -> list[str]:
    return [*command.argv, "--worker-index", str(index), "--parent-fd", str(parent_fd)]


async def serve_workers(command: WorkerCommand, count: int, *, task_status: trio.TaskStatus[list[int]]) -> None:
    """Run `count` workers until cancelled; started (with their pids) once every one serves."""
    pids: dict[int, int] = {}
    async with trio.open_nursery() as nursery:

        async def start(index: int) -> None:
            pids[index] = await nursery.start(serve_worker, command, index)

        async with trio.open_nursery() as starting:
            for index in range(count):
                starting.start_soon(start, index)
        task_status.started([pids[i] for i in range(count)])


async def serve_worker(command: WorkerCommand, index: int, *, task_status: trio.TaskStatus[int]) -> None:
    """Worker `index`, started again after each exit once it has served; started (with its pid)
    when its first run is ready. Cancelling stops it."""
    failures = Failures(WORKER_BACKOFF)
    started = False

    def ready(pid: int) -> None:
        nonlocal started
        log.info("gateway_worker_ready", worker=index, pid=pid)
        if not started:
            started = True
            task_status.started(pid)

    while True:
        began = trio.current_time()
        returncode = await run_worker(command, index, ready)
        if command.figures_dir is not None:
            figures.forget(command.figures_dir, index)  # its series go: its next run is a new instance
        if not started:
            raise WorkerFailed(index, returncode)
        now = trio.current_time()
        failures.failed(now, ran_s=now - began)
        delay = failures.delay()
        log.warning("gateway_worker_exited", worker=index, **exit_fields(returncode), restart_in_s=delay)
        await trio.sleep(delay)


async def run_worker(command: WorkerCommand, index: int, ready: Callable[[int], None]) -> int | None:
    """Run worker `index` once, to its end; `ready(pid)` when it says it serves. Its exit status
    (None: it could not be started)."""
    ours, theirs = socket.socketpair()
    with ours:
        argv = worker_argv(command, index, theirs.fileno())
        try:
            with theirs:  # closed here once the worker has it: EOF on `ours` when the worker ends
                proc = await trio.lowlevel.open_process(
                    argv,
                    env=None if command.env is None else dict(command.env),
                    pass_fds=(theirs.fileno(), *command.pass_fds),
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
        except OSError as exc:
            log.error("gateway_worker_start_failed", worker=index, command=shlex.join(argv), reason=str(exc))
            return None
        try:
            async with trio.open_nursery() as watching:
                watching.start_soon(_watch_ready, trio.SocketStream(trio.socket.from_stdlib_socket(ours)), proc, ready)
                try:
                    await proc.wait()
                finally:
                    watching.cancel_scope.cancel()
        finally:
            if proc.returncode is None:
                await stop_worker(proc, command.drain_s)
    return proc.returncode


async def _watch_ready(stream: trio.SocketStream, proc: trio.Process, ready: Callable[[int], None]) -> None:
    try:
        said = await stream.receive_some(len(READY))
    except trio.BrokenResourceError:
        return  # the worker ended: its exit status says how
    if said:
        ready(proc.pid)


async def stop_worker(proc: trio.Process, drain_s: float) -> None:
    """SIGTERM, then SIGKILL to its process group past its drain; shielded and bounded."""
    deadline = drain_s + STOP_GRACE_S
    with trio.CancelScope(shield=True), trio.move_on_after(deadline + KILL_WAIT_S):
        proc.send_signal(signal.SIGTERM)
        with trio.move_on_after(deadline):
            await proc.wait()
        if proc.returncode is None:
            log.warning("gateway_worker_kill", pid=proc.pid, after_s=deadline)
            _kill_group(proc.pid)
            await proc.wait()


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def exit_fields(returncode: int | None) -> dict[str, object]:
    if returncode is None:
        return {"exit_status": "not_started"}
    if returncode < 0:
        try:
            return {"signal": signal.Signals(-returncode).name}
        except ValueError:
            return {"signal": -returncode}
    return {"exit_status": returncode}


# -- the worker's side ----------------------------------------------------------------------


class ParentLink:
    """A worker's end of the socket pair its parent gave it (`--parent-fd`)."""

    def __init__(self, fd: int) -> None:
        self._stream = trio.SocketStream(trio.socket.from_stdlib_socket(socket.socket(fileno=fd)))

    async def ready(self) -> None:
        """Tell the parent this worker serves."""
        await self._stream.send_all(READY)

    async def watch(
        self, stop: trio.CancelScope, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Until the parent is gone (EOF, or the pair broken), then cancel `stop`."""
        task_status.started()
        try:
            while await self._stream.receive_some(64):
                pass  # the parent sends nothing: anything is ignored
        except trio.BrokenResourceError:
            pass
        finally:
            await trio.aclose_forcefully(self._stream)
        log.warning("gateway_parent_gone", reason="the parent process ended; stopping as on SIGTERM")
        stop.cancel()


def parent_link(fd: int | None) -> ParentLink | None:
    return None if fd is None else ParentLink(fd)
