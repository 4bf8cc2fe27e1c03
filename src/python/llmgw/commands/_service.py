"""Running a long-lived process (`server`, `agent run`, `up`) until SIGTERM or SIGINT, then
stopping cleanly.

Shutdown is cancellation: the first signal cancels the service, every task unwinds through its
own cleanup (bounded where it must run: requests in flight finish, engines get SIGTERM and a
deadline), and the process exits 0. A second signal while that stop is under way interrupts it:
every process this one started (engines and whatever they started) gets SIGKILL and the process
exits 130 at once, the status of a command interrupted by Ctrl-C. Whatever `serve` raises (a
failure at start: its background loops contain their own later failures) reaches the CLI, which
prints an `LlmgwError`'s message and exits with its status. While it runs, the garbage
collector runs as a serving process needs (`llmgw.gcpolicy`).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from llmgw import gcpolicy
from llmgw.log import get_logger

log = get_logger("llmgw.service")

EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a command stopped by Ctrl-C


def run_service(name: str, serve: Callable[..., Awaitable[Any]], *args: Any) -> int:
    async def main() -> None:
        # The receiver outlives the nursery: were it closed first, a serve() that fails at once
        # would leave watch() reading a closed receiver, and its error would hide serve()'s. It
        # also keeps trio's own KeyboardInterrupt out of the stop: only watch() decides.
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with trio.open_nursery() as nursery:
                service = trio.CancelScope()

                async def watch(*, task_status: trio.TaskStatus[None]) -> None:
                    task_status.started()
                    async for signum in signals:
                        if not service.cancel_called:
                            log.info(f"{name}_stopping", signal=signal.Signals(signum).name, again="stops at once")
                            service.cancel()
                            continue
                        interrupt_stop(name, signal.Signals(signum).name)

                await nursery.start(watch)
                with service:
                    await serve(*args)
                nursery.cancel_scope.cancel()

    with gcpolicy.serving():
        trio.run(main)
    log.info(f"{name}_stopped")
    return 0


def interrupt_stop(name: str, signal_name: str) -> None:
    """The stop was interrupted: kill everything this process started, and exit 130 now.

    The engines lead their own process groups (so that a stop reaches their children), which
    also keeps a terminal's Ctrl-C from reaching them: nothing but this would stop them."""
    killed = kill_descendants(os.getpid())
    log.warning(f"{name}_stop_interrupted", signal=signal_name, killed_processes=killed)
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(EXIT_INTERRUPTED)


def descendants(pid: int, parents: dict[int, tuple[int, int]]) -> list[tuple[int, int]]:
    """(pid, process group) of every descendant of `pid`, given each process's (parent, group)."""
    children: dict[int, list[int]] = {}
    for child, (parent, _) in parents.items():
        children.setdefault(parent, []).append(child)
    out, todo = [], list(children.get(pid, ()))
    while todo:
        child = todo.pop()
        out.append((child, parents[child][1]))
        todo.extend(children.get(child, ()))
    return out


def _process_table() -> dict[int, tuple[int, int]]:
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # gone meanwhile
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
        fields = stat.rsplit(")", 1)[1].split()
        table[int(entry)] = (int(fields[1]), int(fields[2]))
    return table


def kill_descendants(pid: int) -> int:
    """SIGKILL every descendant of `pid`, and the process group of each that leads one (what an
    engine started may have been handed to init already); returns how many were signalled."""
    found = descendants(pid, _process_table())
    for child, group in found:
        try:
            if group == child:
                os.killpg(group, signal.SIGKILL)
            else:
                os.kill(child, signal.SIGKILL)
        except OSError:
            pass  # already gone
    return len(found)
