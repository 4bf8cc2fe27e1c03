"""One replica member on this node as the agent holds it: what it reports (`status`, the
`ReplicaStatus` sent to the control plane), what it holds while it runs (GPUs, its engine's
ports and listening host), its engine's exits that count for the restart policy, and the
one-shot events of its life (assigned, observed, done) and its cancel scope.

A member lives through `fetching -> starting -> ready`, `restarting` after an engine exit (with
the engine's last log lines in `detail`), `failed` when it cannot start or failed too often, and
`stopping -> stopped` when cancelled; `Member.set` holds every move to `TRANSITIONS`
(agent.replica_plan), and a member being stopped only goes on to stopped. Its life is
`agent.replica_life`'s; its engine, while it runs, `agent.replica_watch`'s; which members there
are, `agent.replica_supervisor`'s.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import trio

from agent.replica_plan import TRANSITIONS, Key
from llmgw.backoff import Failures
from llmgw.log import get_logger
from llmgw.wakeup import Wakeup
from llmgw.wire import agent_link as w

log = get_logger("llmgw.agent.replicas")


def _nobody() -> None:
    pass


@attrs.define(eq=False, kw_only=True)
class Member:
    """One replica member on this node: what it reports, what it holds, and the events of its life."""

    status: w.ReplicaStatus
    fingerprint: str  # of the assignment it runs
    engine: str
    assignment: w.ReplicaAssignment | None  # None: adopted, until a desired state confirms it
    on_change: Callable[[], None] = _nobody  # called after each change of `status`
    assigned: trio.Event = attrs.Factory(trio.Event)
    observed: trio.Event = attrs.Factory(trio.Event)  # its engine was probed once (or it ended)
    scope: trio.CancelScope = attrs.Factory(trio.CancelScope)
    done: trio.Event = attrs.Factory(trio.Event)
    gpus: tuple[int, ...] = ()
    port: int = 0  # kept across restarts while it is free, so the gateway's address holds
    events_port: int = 0  # where rank 0's engine publishes KV-cache events (kept likewise); 0: none
    host: str = ""  # where rank 0's engine listens (while it runs)
    exits: Failures  # its engine's exits that count for the restart policy
    answered: int = 0  # liveness probes its engine answered (200) since it was ready, all starts together
    # Whether the control plane wants its engine parked now (`ReplicaAssignment.parked`), and a
    # wake-up for each change of that: rank 0's watch parks or wakes the engine to match.
    park_wanted: bool = False
    park_changed: Wakeup = attrs.Factory(Wakeup)

    @property
    def key(self) -> Key:
        return (self.status.replica_id, self.status.node_rank)

    def set(self, state: str, *, detail: str | None = None, **fields: object) -> None:
        """Move to `state` as `TRANSITIONS` allows (a bug otherwise); a member being stopped only
        goes on to stopped. `detail` None keeps the detail while the state stays."""
        old = self.status
        if old.state == w.STOPPING and state != w.STOPPED:
            return
        if state != old.state and state not in TRANSITIONS[old.state]:
            raise RuntimeError(f"replica member may not go from {old.state} to {state}")
        if detail is None:
            detail = old.detail if state == old.state else ""
        new = attrs.evolve(old, state=state, detail=detail, **fields)
        if new == old:
            return
        self.status = new
        if state != old.state:
            replica, rank = self.key
            log.info("replica_state", replica=replica, rank=rank, state=state, was=old.state, pid=new.pid)
        self.on_change()

    def want_parked(self, parked: bool) -> None:
        """The control plane's wish for its engine, from each desired state."""
        if parked != self.park_wanted:
            self.park_wanted = parked
            self.park_changed.fire()

    def fail(self, reason: str) -> None:
        replica, rank = self.key
        log.warning("replica_failed", replica=replica, rank=rank, reason=reason)
        self.set(w.FAILED, detail=reason, pid=0)
