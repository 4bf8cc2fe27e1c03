"""The agent's replica supervisor: which replica members run on this node.

`Supervisor.assign` takes the whole set this node should run (level-triggered, from every
`DesiredState`); `plan` compares it with what runs: new members start, members no longer
listed stop, a member whose assignment changed is stopped and started again, identical ones
are left alone. So a control plane that restarts and resends the same assignments adopts the
running replicas and restarts none; a dropped link changes nothing here.

Engines outlive their agent (`agent.adoption`): each leads its own session and writes its
output straight to its log file, and a record of it is kept in STATE/run while it runs. An
agent that starts adopts the recorded engines that still run: they are members from the start
(in the hello, ready once their /health answers), and the first desired state decides their
fate like anyone's, by the fingerprint of their assignment: identical, kept; changed or gone,
stopped. Until a desired state arrives nothing is stopped. So an agent that was killed and
started again moves nothing.

Each member is one task in the supervisor's nursery; its whole life (fetch, engine, GPUs,
start, watch, restart, stop) is `agent.replica_life`, and cancelling its task is its stop. A
member replacing another (same replica and rank) starts once that one is done. The decisions
are pure, in `agent.replica_plan` (state table, restart policy, plan).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from pathlib import Path

import attrs
import trio

from agent.adoption import Adopted, adopt_all, fingerprint, read_boot_id
from agent.engine_proc import HEALTH_TIMEOUT_S
from agent.node_address import NodeAddress, address_present
from agent.replica_life import Life
from agent.replica_logs import CHECK_INTERVAL_S, FILES, MAX_BYTES, tail_replica
from agent.replica_member import Member
from agent.replica_plan import RESTART_BACKOFF, Key, key_of, plan
from agent.replica_rpc import RpcIdentity
from agent.replica_watch import (
    HEALTH_INTERVAL_S,
    LIVENESS_FAILURES,
    LIVENESS_INTERVAL_S,
    LIVENESS_TIMEOUT_S,
    STOP_TIMEOUT_S,
)
from agent.weights import WeightsStore
from llmgw.backoff import Backoff, Failures
from llmgw.log import get_logger
from llmgw.wakeup import Wakeup
from llmgw.wire import agent_link as w

log = get_logger("llmgw.agent.replicas")

# How long a starting agent waits for the first /health answer of the engines it adopts before
# its hello goes out: long enough for one probe, so the hello says "ready" and nothing moves.
ADOPT_PROBE_S = HEALTH_TIMEOUT_S + 0.5


class Supervisor:
    """Every replica member on this node: one task each, in the nursery of `serve`."""

    def __init__(
        self,
        *,
        state_dir: Path,
        weights: WeightsStore,
        engine_command: Callable[[str], Sequence[str]],
        gpus: Callable[[], Sequence[int]] = lambda: (),
        env: Mapping[str, str] | None = None,
        listen_host: str | NodeAddress,
        backoff: Backoff = RESTART_BACKOFF,
        stop_timeout_s: float = STOP_TIMEOUT_S,
        health_interval_s: float = HEALTH_INTERVAL_S,
        liveness: tuple[float, float, int] = (LIVENESS_INTERVAL_S, LIVENESS_TIMEOUT_S, LIVENESS_FAILURES),
        log_max_bytes: int = MAX_BYTES,
        log_files: int = FILES,
        log_check_s: float = CHECK_INTERVAL_S,
        use_pidfd: bool = True,
        address_present: Callable[[str], bool] = address_present,
        rpc: RpcIdentity | None = None,
    ) -> None:
        """`engine_command(name)` is the argv prefix of an engine (`Engines.command_for`);
        `gpus()` the GPU indices of this node; `env` the engines' base environment (default:
        the agent's, read at each start); `listen_host` where rank 0 engines listen: the link's
        `NodeAddress`, or a fixed address; `address_present(host)` whether an address is still
        this machine's (tests stand in for an address that leaves); `use_pidfd=False` watches
        adopted engines through /proc as on kernels without pidfds; `rpc` this node's TLS for
        llama.cpp's RPC tunnels (`agent.replica_rpc`; None: no replica over RPC runs here)."""
        self.address = listen_host if isinstance(listen_host, NodeAddress) else NodeAddress(listen_host)
        self.use_pidfd = use_pidfd
        self._wanted: tuple[w.ReplicaAssignment, ...] | None = None  # None: no desired state yet
        self._members: dict[Key, Member] = {}
        self._retiring: list[Member] = []  # cancelled, not yet finished
        self._nursery: trio.Nursery | None = None
        self._version = 0
        self.changed = Wakeup()  # `statuses()` changed: reports go out, tests look again
        self.life = Life(
            state_dir=state_dir,
            weights=weights,
            engine_command=engine_command,
            gpus=gpus,
            env=env,
            address=self.address,
            address_present=address_present,
            backoff=backoff,
            stop_timeout_s=stop_timeout_s,
            health_interval_s=health_interval_s,
            liveness=liveness,
            log_max_bytes=log_max_bytes,
            log_files=log_files,
            log_check_s=log_check_s,
            holders=lambda: (*self._members.values(), *self._retiring),
            retiring=lambda: self._retiring,
            rpc=rpc,
        )
        self.probed = self.life.watch.probed  # a ready engine's liveness was probed (`answered_probes`)

    # -- what the rest of the agent calls

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Adopt the engines an earlier agent left running, then run the members until cancelled;
        cancelling stops every engine (gracefully, bounded).

        Started, it has looked once at each adopted engine (bounded by `ADOPT_PROBE_S`), so the
        hello that follows says which serve. Run again after a failure (each member contains its
        own, so only a bug in this class gets here), it starts over from what is wanted: the
        previous run's members all ended with its nursery."""
        self._members.clear()
        self._retiring.clear()
        self.life.boot_id = read_boot_id()
        found = adopt_all(self.life.records, boot_id=self.life.boot_id, use_pidfd=self.use_pidfd)
        self.life.keys.sweep(engine.record.key for engine in found)  # the others' engines are gone
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                adopted = [self._adopt(engine) for engine in found]
                self._apply()
                with trio.move_on_after(ADOPT_PROBE_S):
                    for m in adopted:
                        await m.observed.wait()
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None

    def assign(self, assignments: Iterable[w.ReplicaAssignment]) -> None:
        """Make exactly `assignments` run on this node (call with every desired state)."""
        self._wanted = tuple(assignments)
        if self._nursery is not None:
            self._apply()

    def adopted_engines(self) -> frozenset[str]:
        """The engines that adopted members not yet confirmed by a desired state run."""
        return frozenset(m.engine for m in self._members.values() if m.assignment is None)

    def statuses(self) -> tuple[w.ReplicaStatus, ...]:
        """Every member as observed now: for the hello and `ReplicasChanged`."""
        shown = dict(self._members)
        for m in self._retiring:
            shown.setdefault(m.key, m)  # a successor waiting for it speaks for the key
        return tuple(shown[k].status for k in sorted(shown))

    async def wait_changed(self) -> None:
        """Return at the next change of `statuses()` (`changed.next()` for a waiter that looks first)."""
        await self.changed.wait()

    async def serve_reports(
        self,
        send: Callable[[w.AgentMessage], Awaitable[object]],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Send `ReplicasChanged` after every change (bursts coalesce: the whole set goes each time).

        A send while the link is down is lost, which is fine: the next hello carries `statuses()`.
        """
        task_status.started()
        sent = None
        while True:
            changed = self.changed.next()
            if sent == self._version:
                await changed.wait()
                continue
            sent = self._version
            await send(w.ReplicasChanged(replicas=self.statuses()))

    def answered_probes(self, replica_id: str, rank: int = 0) -> int:
        """The liveness probes a member's engine answered since it was ready (0 for none such);
        `probed` fires after each probe, answered or not."""
        m = self._members.get((replica_id, rank))
        return m.answered if m is not None else 0

    def tail(self, replica_id: str, lines: int = 100) -> str:
        """The last `lines` lines of the engine logs of `replica_id` on this node ("" if none)."""
        return tail_replica(self.life.logs_dir, replica_id, lines)

    # -- bookkeeping (synchronous)

    def _adopt(self, engine: Adopted) -> Member:
        assert self._nursery is not None
        r = engine.record
        m = Member(
            status=w.ReplicaStatus(
                replica_id=r.replica_id, model=r.model, state=w.STARTING, node_rank=r.node_rank, pid=r.pid
            ),
            fingerprint=r.fingerprint,
            engine=r.engine,
            assignment=None,
            on_change=self._changed,
            exits=Failures(self.life.backoff),
            gpus=r.gpus,
            port=r.port,
            events_port=r.events_port,
            host=r.host or "0.0.0.0",  # recorded before engines had their own address: all of them
        )
        self._members[r.key] = m
        self._nursery.start_soon(self._run, m, [], engine)
        return m

    def _apply(self) -> None:
        assert self._nursery is not None
        if self._wanted is None:
            return  # no desired state since the agent started: adopted engines keep running meanwhile
        todo = plan({k: m.fingerprint for k, m in self._members.items()}, self._wanted)
        for k in todo.stop:
            self._retire(self._members.pop(k))
        for a in todo.keep:
            m = self._members[key_of(a)]
            m.want_parked(a.parked)
            if m.assignment is None:
                m.assignment = a
                m.assigned.set()
                log.info("replica_adoption_confirmed", replica=a.replica_id, rank=a.node_rank, pid=m.status.pid)
        for a in todo.start:
            k = key_of(a)
            before = [m for m in self._retiring if m.key == k]
            m = Member(
                status=w.ReplicaStatus(replica_id=a.replica_id, model=a.model, state=w.FETCHING, node_rank=a.node_rank),
                fingerprint=fingerprint(a),
                engine=a.engine,
                assignment=a,
                on_change=self._changed,
                exits=Failures(self.life.backoff),
            )
            m.want_parked(a.parked)
            m.assigned.set()
            self._members[k] = m
            log.info("replica_assigned", replica=a.replica_id, rank=a.node_rank, model=a.model, engine=a.engine)
            self._nursery.start_soon(self._run, m, before)
        if todo.start or todo.stop:
            self._changed()

    def _retire(self, m: Member) -> None:
        replica, rank = m.key
        log.info("replica_unassigned", replica=replica, rank=rank, adopted=m.assignment is None)
        if m.done.is_set():
            return  # failed and finished already: nothing runs
        m.set(w.STOPPING, detail="")
        self._retiring.append(m)
        m.scope.cancel()

    def _changed(self) -> None:
        self._version += 1
        self.changed.fire()

    async def _run(self, m: Member, before: list[Member], adopted: Adopted | None = None) -> None:
        """One member's task: its life (`Life.run`), then it is off the books."""
        try:
            await self.life.run(m, before, adopted)
        finally:
            if m in self._retiring:
                self._retiring.remove(m)
                # Directly, not through the table: a member that failed on its way out is stopped too.
                m.status = attrs.evolve(m.status, state=w.STOPPED, pid=0, port=0)
                replica, rank = m.key
                log.info("replica_state", replica=replica, rank=rank, state=w.STOPPED)
            m.done.set()
            self._changed()


async def serve_assignments(
    supervisor: Supervisor,
    desired: Callable[[], w.DesiredState | None],
    desired_changed: Callable[[], Awaitable[None]],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Give the supervisor the replicas of every desired state the link receives, forever.

    A dropped link leaves the last desired state in place, so nothing stops while the control
    plane is away; the desired state it sends on its return is compared, not obeyed blindly."""
    task_status.started()
    seen: w.DesiredState | None = None
    while True:
        state = desired()
        if state is None or state is seen:
            # Nothing awaited since `desired()` was read: a state arriving now wakes this wait.
            await desired_changed()
            continue
        seen = state
        supervisor.assign(state.replicas)
        if state.keep_files is not None:
            # The catalog no longer names them: downloaded files no replica here uses go. A
            # desired state arriving meanwhile is read at the top of the loop, not waited for.
            using = [a.weights for a in state.replicas]
            await supervisor.life.weights.collect(set(state.keep_files), using)
