"""Who wakes whom: every wake-up in llmgw is a `Wakeup`, and every one is listed here (`WAKEUPS`).

A waiter takes `wakeup.next()` *before* it looks at the state, then waits on it; whoever changes
that state calls `wakeup.fire()`, which sets the event and replaces it. So a change made while
the waiter is still looking is never lost (its event is already set), and a waiter never sees an
event that fired for a change it has already looked at. No module swaps a `trio.Event` by hand.

An event that is set once and never replaced (a milestone: a body settled, every worker joined,
a drain finished) stays a `trio.Event`; those are listed too (`ONE_SHOT`), with why each is one.
tests/llmgw/test_owners.py reads the sources and holds them to both lists: a `Wakeup` made
anywhere is named in `WAKEUPS`, and a `trio.Event()` is made only where `ONE_SHOT` says, once.
"""

from __future__ import annotations

from collections.abc import Sequence

import trio


class Wakeup:
    def __init__(self) -> None:
        self._event = trio.Event()

    def next(self) -> trio.Event:
        """Set at the next `fire()`."""
        return self._event

    def fire(self) -> None:
        self._event.set()
        self._event = trio.Event()

    async def wait(self) -> None:
        """Until the next `fire()`: for a waiter that has nothing to look at first."""
        await self._event.wait()


async def any_of(events: Sequence[trio.Event]) -> None:
    """Until one of `events` is set (a waiter of several `Wakeup`s takes each one's `next()` first);
    none: forever."""
    if not events:
        await trio.sleep_forever()
    if len(events) == 1:
        await events[0].wait()
        return

    async def one(event: trio.Event, done: trio.CancelScope) -> None:
        await event.wait()
        done.cancel()

    async with trio.open_nursery() as nursery:
        for event in events:
            nursery.start_soon(one, event, nursery.cancel_scope)


# Each wake-up by where it lives (module.Class.attribute): what fires it, and who waits on it.
WAKEUPS: dict[str, str] = {
    # The control plane (llmgw.server).
    "llmgw.server.state.changes.Changes.nodes": "a node connected, left, reported or was removed, an operator's intent "
    "(`server/state/intent.py`) or the catalog (a reload) changed -> the reconciler (`server/state/liveness.py`) looks again",
    "llmgw.server.state.changes.Changes.rotation": "what the gateway's rotation is made of may have changed -> the "
    "gateways' table follows: over the link (`GatewayFeed`), and in memory on the control plane's loop "
    "(`server/gateways/inprocess.py`); the cluster page's feed looks again (`Feed.serve`)",
    "llmgw.server.state.changes.Changes.settled": "the reconciler finished a pass -> the spreader looks (`Moves`); the "
    "cluster page's feed looks again; a reload or a cordon waiting for its push returns (`Reconciler.next_pass`)",
    "llmgw.server.state.autoscale.Autoscaler.again": "a scale-down's replica was retired (or could not be) -> "
    "the autoscaler looks again at once: a model waiting for the room it made starts now",
    "llmgw.server.state.autoscale.Autoscaler.stepped": "the autoscaler looked at the gateways' loads once -> "
    "tests and benches waiting for a decision look again",
    "llmgw.server.state.moves.Moves.reported": "an agent reported its replicas' states -> a move waiting for its "
    "replacement to be ready looks again",
    "llmgw.server.admin.page.Page.touched": "an operator's change through the admin API succeeded -> the cluster "
    "page's feed looks again",
    "llmgw.server.admin.pagefeed.Feed.published": "the cluster page's feed published a version -> each open page's "
    "stream sends it (`events.stream`)",
    "llmgw.server.admin.pagefeed.Feed._watchers_moved": "a page's stream opened or closed -> the feed looks at the "
    "cluster for the first (a fresh look), or forgets it after the last",
    "llmgw.server.store.asyncstore.LatestWriter.to_write": "a new version was offered -> the background writer writes it",
    "llmgw.server.nodes.weightsorigin.WeightsOrigin.wake": "a node wants a weights file the control plane seeds, or "
    "one of its downloads ended -> its serve loop starts what is wanted",
    # The gateway (llmgw.gateway).
    "llmgw.server.links.usagereports.UsageReports.arrived": "a gateway's usage report came over its link -> the "
    "ledger's writer adds it to the store and acknowledges it",
    "llmgw.gateway.usage.Usage.flushing": "a gateway worker stops, its requests drained -> its link sends the "
    "usage counted and not yet reported at once (`gatewayd/link.py`), not at the next interval",
    "llmgw.gateway.usage.Usage.acknowledged": "the control plane acknowledged a usage report -> a stopping worker "
    "waiting for its last counts to be in the ledger looks again (`Usage.flushed`)",
    "llmgw.gateway.budgets.Budgets.granted": "a grant came, a budget's request ended or the link's state changed "
    "-> the requests waiting for a grant look again (`gateway/budgets.py`, `reserve`)",
    "llmgw.gateway.budgets.Budgets.due": "what an instance holds or wants of a budget changed -> its link sends a "
    "budget report (`gatewayd/link.py`)",
    "llmgw.gateway.app.Gateway.freed": "a replica may have become free (the rotation changed, a request let "
    "go of its replica, a probe reached a down replica) -> a move waiting for the original's requests "
    "(`quiesce`) looks again",
    "llmgw.gateway.queues.ModelQueue.freed": "a replica of the model may have become free (a request of it let go "
    "of its replica, a probe reached one) or the rotation changed -> the requests queued for that model pick "
    "again, and look whether the control plane says it is unservable now (`Gateway._wait_for_endpoint`)",
    "llmgw.gateway.app.Gateway.cold": "a request began to wait for a model with no replica in rotation (one on "
    "demand, scaled to zero), the first of its queue -> a gateway process's link sends a heartbeat at once with "
    "the models' load (`gatewayd/link.py`), and the control plane's autoscaler looks (the gateway on its own "
    "loop), so that a replica starts without waiting for the next interval",
    "llmgw.gateway.app.Gateway.applied": "the gateway routes by a new rotation -> a gateway process's link "
    "sends a heartbeat at once, saying the rotation's version (`gatewayd/link.py`), so that a move waiting for "
    "the gateways (`GatewayFeed.quiesce`) learns it without waiting for the next interval; the KV-cache events "
    "subscriptions follow the rotation (`gateway/cachewatch.py`)",
    "llmgw.gateway.app.Gateway.went_down": "a replica left rotation -> the prober plans its probes again "
    "(`gateway/probes.py`)",
    "llmgw.gateway.app.Gateway.finished": "the last request in flight finished -> a gateway draining for "
    "shutdown (`drain`) returns",
    "llmgw.gatewayd.table.GatewayTable.changed": "the control plane sent a new rotation (a gateway process's "
    "link, its table file, or in memory on the control plane's loop) -> the gateway's rotation follows "
    "(`Gateway.serve_rotation`)",
    "llmgw.server.links.gatewaylinks.GatewayFeed.heard": "a gateway instance's heartbeat came, an instance left, or the "
    "rotation or the keys sent to gateways changed -> a move waiting for the gateways' requests on a replica "
    "(`GatewayFeed.quiesce`), a key's change waiting for the control plane's workers (`keys_reached`) and its "
    "start waiting for them (`OwnGateway`) look again",
    "llmgw.server.state.budgetring.BudgetRing.changed": "a token budget was set or removed -> every gateway is "
    "sent the budgets again (`GatewayFeed`)",
    "llmgw.server.state.budgetring.BudgetRing.work": "a budget changed, a ledger read is due or a gateway's link "
    "closed -> the ring reads the ledger, reclaims and grants (`BudgetRing.serve`)",
    "llmgw.server.state.keys.KeyRing.changed": "an API key was made or revoked -> the gateways' table sends "
    "the valid keys again (`GatewayFeed`; in memory, `server/gateways/inprocess.py`)",
    "llmgw.http.server._Departure.stopped": "a connection is no longer read for its client's departure -> "
    "the request that ended waits for it before the connection is read for the next",
    "llmgw.gateway.history.History.sampled": "a sample of the gateway's figures was taken -> open cluster "
    "pages send the history",
    # The agent.
    "agent.replica_supervisor.Supervisor.changed": "a member's status changed -> `serve_reports` sends `ReplicasChanged`; "
    "tests wait on it (`Supervisor.changed`)",
    "agent.replica_life.Life.released": "a member gave its GPUs back -> members waiting for GPUs look again",
    "agent.replica_watch.EngineWatch.probed": "a ready engine's liveness was probed -> tests waiting for probes look "
    "(`Supervisor.answered_probes`)",
    "agent.node_address.NodeAddress.changed": "the link's local address changed -> engines listening on an "
    "address that left the machine are started again",
    "agent.rpctunnel.TunnelClient.lost": "a helper's side ended an RPC connection it relayed (its rpc-server or its "
    "agent gone) -> rank 0's watch stops its llama-server, to start it again once the helpers answer",
    "agent.progress.Latest.noted": "the installer reported progress -> `serve_progress` sends the latest, throttled",
    "agent.swarm.Swarm.changed": "a piece arrived, a piece request ended or a peer said which pieces it has -> "
    "the download's loop starts the next requests (`Swarm.run`)",
    "agent.link.AgentLink._desired_changed": "a DesiredState arrived -> the agent's replicas follow it "
    "(`AgentLink.desired_changed`)",
    "agent.replica_member.Member.park_changed": "the control plane asked one member's engine to park or wake -> "
    "rank 0's watch asks the engine (`EngineWatch._keep_parked`)",
}

# Events set once and never replaced, by where they live: why each is one.
ONE_SHOT: dict[str, str] = {
    "llmgw.http.body.ConnectionBody.settled": "one request body: read whole or abandoned, once",
    "llmgw.http.budget._Waiters.wait.event": "one wait for room in a body budget: its turn came, once (the "
    "waiters are woken oldest first, one at a time, so each has its own)",
    "llmgw.nodeadd.screen._ScreenQuestions._ask.answered": "one question on the node add screen, answered once",
    "llmgw.simengine.rendezvous.Rank0.complete": "every worker of one rendezvous joined, once",
    "llmgw.server.state.drains.DrainProgress.finished": "one drain: done or stopped, once (tests and callers wait on it)",
    "agent.replica_member.Member.assigned": "one member: its assignment arrived (an adopted engine's successor waits)",
    "agent.replica_member.Member.observed": "one member: its engine was probed once, or it ended",
    "agent.replica_member.Member.done": "one member: its task ended",
    "agent.node_address.NodeAddress._known": "the first address the link reported",
    "llmgw.gatewayd.table.GatewayTable.whole": "one gateway process: its first whole table came, once (the "
    "control plane's workers listen only then)",
    "llmgw.linkio.Writer.finished": "one link's writer: its task returned, once",
    "llmgw.linkio._Waiting.done": "one log request: its reply arrived (or the link ended), once",
    "llmgw.server.store.asyncstore._Sightings.done": "one batch of nodes seen connecting: written (or refused), once",
}
