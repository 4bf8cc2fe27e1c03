"""Running a long-lived process (server, agent) until SIGTERM or SIGINT, then stopping cleanly.

Shutdown is cancellation: the signal cancels the root nursery, every task unwinds through its
own cleanup (bounded where it must run), and the process exits 0. Whatever `serve` raises (a
failure at start: its background loops contain their own later failures) reaches the CLI,
which prints an `LlmgwError`'s message and exits with its status.
"""

from __future__ import annotations

import signal
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from llmgw.log import get_logger

log = get_logger("llmgw.service")


def run_service(name: str, serve: Callable[..., Awaitable[Any]], *args: Any) -> int:
    async def main() -> None:
        # The receiver outlives the nursery: were it closed first, a serve() that fails at once
        # would leave watch() reading a closed receiver, and its error would hide serve()'s.
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with trio.open_nursery() as nursery:

                async def watch(*, task_status: trio.TaskStatus[None]) -> None:
                    task_status.started()
                    async for signum in signals:
                        log.info(f"{name}_stopping", signal=signal.Signals(signum).name)
                        nursery.cancel_scope.cancel()
                        return

                await nursery.start(watch)
                await serve(*args)
                nursery.cancel_scope.cancel()

    trio.run(main)
    log.info(f"{name}_stopped")
    return 0
