"""What the control plane's process does around its services (`ControlPlane.serve`): a SIGHUP reads
server.toml again (`serve_reload_on_sighup`); `STATE_DIR/admin.url` says where it answers for as
long as it does (`serve_admin_url`); and once it is cancelled its front stops first
(`cancel_at_stop`), so that the requests in flight finish while the rest still runs.
"""

from __future__ import annotations

import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from llmgw import paths
from llmgw.errors import LlmgwError
from llmgw.log import get_logger

log = get_logger("llmgw.server")


async def serve_reload_on_sighup(
    reload: Callable[[], Awaitable[Any]], *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """SIGHUP reads server.toml again. Each reload's failure is its own: a bad file is said, a bug
    is logged with its traceback, and the next SIGHUP is still received."""
    with trio.open_signal_receiver(signal.SIGHUP) as signals:
        task_status.started()
        async for _ in signals:
            try:
                await reload()
            except LlmgwError as exc:
                log.error("reload_failed", reason=str(exc), kept="the running configuration")
            except Exception:
                log.exception("reload_failed", kept="the running configuration")


async def serve_admin_url(
    state_dir: Path, admin_url: str, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """`admin_url` in STATE_DIR/admin.url (`llmgw ctl` sends the credential there) until cancelled;
    a stopped server leaves none behind, so `llmgw ctl` says none is running."""
    path = paths.admin_url_path(state_dir)
    paths.write_public(path, admin_url + "\n")
    try:
        task_status.started()
        await trio.sleep_forever()
    finally:
        path.unlink(missing_ok=True)


async def cancel_at_stop(front: trio.CancelScope) -> None:
    """When the control plane is cancelled, cancel its front first (`ControlPlane.serve`)."""
    try:
        await trio.sleep_forever()
    finally:
        front.cancel()
