"""The reconciler: notices every change of a node's liveness as it happens — including a loss no
message announces, at the deadline the registry names — and places replicas accordingly.

Each pass logs the liveness transitions, runs `Replicas.reconcile` and pushes the desired state
of every node whose assignments changed, then fires `changes.settled` (the spreader looks after
it). It waits for the next node change (`changes.nodes`) or the registry's next deadline.

Time is liveness time (`registry.clock`): when the loop was stalled, the pass that wakes at a
deadline the stall carried it past reads the clock first, which credits the stall, so it finds
nobody's deadline passed yet and waits again for the moved one (`clock.loop_time`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio

from llmgw.log import get_logger
from llmgw.server.changes import Changes
from llmgw.server.registry import Registry
from llmgw.server.replicas import Replicas

log = get_logger("llmgw.server")


async def serve_liveness(
    registry: Registry,
    replicas: Replicas,
    changes: Changes,
    push: Callable[[str], Awaitable[None]],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    clock = registry.clock
    task_status.started()
    while True:
        changed = changes.nodes.next()  # before looking: a change during this pass is not lost
        now = clock.now()
        for t in registry.transitions(now):
            log.info(f"node_{t.new}", node=t.node_id, was=t.old)
            changes.rotation.fire()
        for node_id in sorted(replicas.reconcile(now)):
            await push(node_id)
        changes.settled.fire()  # after the reconcile: the spreader sees its result
        with trio.move_on_at(clock.loop_time(registry.next_deadline(now))):
            await changed.wait()
