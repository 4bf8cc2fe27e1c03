"""The weights cache as the control plane sees it, and the models staged to this node.

`held_now` is what the cache holds (`WeightsStore.held`: whole files and downloads under way,
their sizes and last use; the cache's bytes, limit and the disk's free space): the hello carries
it, and `serve_weights_report` sends it again (`WeightsChanged`) whenever it changes, looking
every `REPORT_INTERVAL_S` (a directory listing and a stat per file). Placement reads it: a
replica goes where its files are.

`serve_staging` downloads the models the control plane stages here (`DesiredState.stage`,
`llmgw ctl models stage`), one after another, running nothing; the next report says they are
held, and the control plane takes them off the list.
"""

from __future__ import annotations

import shutil
from collections.abc import Awaitable, Callable

import trio

from agent.weights import WeightsStore
from llmgw.errors import LlmgwError
from llmgw.log import get_logger
from llmgw.wire import agent_link as w

log = get_logger("llmgw.agent")

REPORT_INTERVAL_S = 5.0


def held_now(weights: WeightsStore) -> w.WeightsHeld:
    """What the cache holds now. Blocking (a listing and a stat per file): call it in a thread."""
    held = weights.held()
    try:
        free = shutil.disk_usage(weights.root).free
    except OSError:
        free = 0
    return w.WeightsHeld(
        files=tuple(
            w.HeldFile(sha256=h.sha256, size=h.bytes, complete=h.complete, last_used=round(h.last_used, 3))
            for h in held
        ),
        cache_bytes=sum(h.bytes for h in held),
        limit_bytes=weights.limit_bytes,
        free_bytes=free,
        port=weights.serve_port,
    )


async def serve_weights_report(
    weights: WeightsStore,
    current: Callable[[], w.WeightsHeld],
    report: Callable[[w.WeightsHeld], Awaitable[None]],
    *,
    interval_s: float = REPORT_INTERVAL_S,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Look at the cache every `interval_s`; `report` what it holds when that changed (the disk's
    free space alone is no change: it moves with everything else on the disk)."""
    task_status.started()
    while True:
        await trio.sleep(interval_s)
        fresh = await trio.to_thread.run_sync(held_now, weights)
        before = current()
        if (fresh.files, fresh.cache_bytes, fresh.limit_bytes, fresh.port) != (
            before.files,
            before.cache_bytes,
            before.limit_bytes,
            before.port,
        ):
            await report(fresh)


async def serve_staging(
    weights: WeightsStore,
    desired: Callable[[], w.DesiredState | None],
    desired_changed: Callable[[], Awaitable[None]],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Download each model the desired state stages here, one at a time; a failure is logged and
    tried again with the next desired state (the control plane keeps it staged until it is held)."""
    task_status.started()
    done_for = -1  # the generation whose stage list was worked through
    while True:
        state = desired()
        if state is None or state.generation == done_for:
            await desired_changed()
            continue
        for source in state.stage:
            try:
                await weights.prepare(source)
            except LlmgwError as exc:
                log.warning("stage_failed", repo=source.repo or source.url, error=str(exc))
        done_for = state.generation
