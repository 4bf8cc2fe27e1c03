"""The agent's replica supervisor: runs the replica members the control plane assigns to this node.

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

Each member is one task in the supervisor's nursery, living through
`fetching -> starting -> ready`, `restarting` after an engine exit (with the engine's last log
lines in `detail`), `failed` when it cannot start or failed too often (`RestartPolicy`), and
`stopping -> stopped` when cancelled; `TRANSITIONS` is the whole table. An adopted member
starts at `starting`; when its engine exits it goes through the same restart policy and its
successor starts the ordinary way. Cancelling the task is the stop: SIGTERM to the engine's
process group, a deadline, then SIGKILL, in shielded and bounded cleanup. Rank 0 is ready when
`GET /health` answers 200; a worker when it runs. A rank 0 that stops answering /health while
it runs is stopped and restarted as if it had exited (`LIVENESS_*`: a hung engine is not left
holding its replica). A multi-node engine fails as a whole by itself (rank 0 exits when a
member is lost), so every member just restarts its own process and the rendezvous forms again.

The decisions are pure, in `agent.replica_plan` (state table, restart policy, plan); engine
output goes to rotated files (`agent.replica_logs`); the process plumbing (process group
signals, health probe, port) is `agent.engine_proc`; records and adoption `agent.adoption`;
weights are `agent.weights`.

Where an engine listens: rank 0 on the address the gateway reaches this node at
(`agent.node_address`: the local address of the agent's link), taken at each start and kept
while the engine runs; an engine whose address has left the machine when the link comes back
from another is stopped and started again there. Adopted engines keep the address their record
names. Workers serve nothing and get a loopback port.

Secrets never reach argv or a log: the API key goes in a private file the engine reads
(`agent.key_files`, written before each start and removed when the engine stops) or, for
engines that read no file, in its environment; commands are logged with `Command.for_log()`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from pathlib import Path

import attrs
import trio

from agent.adoption import Adopted, Record, RunRecords, adopt_all, fingerprint, read_boot_id
from agent.key_files import KeyFiles
from agent.engine_proc import (
    HEALTH_TIMEOUT_S,
    Child,
    EngineProcess,
    pick_port,
    probe_health,
    probe_host,
    signal_group,
)
from agent.engines import EngineUnavailable
from agent.node_address import NodeAddress, address_present
from agent.replica_logs import CHECK_INTERVAL_S, FILES, MAX_BYTES, EngineLog, log_path, tail_replica
from agent.replica_plan import (
    DEFAULT_POLICY,
    TRANSITIONS,
    Key,
    RestartPolicy,
    describe_end,
    describe_exit,
    key_of,
    plan,
)
from agent.weights import BadWeightsSource, WeightsStore, check_name, describe
from llmgw.config import Secret
from llmgw.engines import Command, ReplicaLaunch, build_command
from llmgw.errors import LlmgwError, leaves, only
from llmgw.log import get_logger
from llmgw.wakeup import Wakeup
from llmgw.wire import agent_link as w

log = get_logger("llmgw.agent.replicas")

STOP_TIMEOUT_S = 10.0  # SIGTERM to SIGKILL
KILL_WAIT_S = 5.0  # after SIGKILL, before giving up on reaping
HEALTH_INTERVAL_S = 0.5
# Once ready, rank 0's /health is asked again every LIVENESS_INTERVAL_S; LIVENESS_FAILURES
# answers in a row that are not 200 within LIVENESS_TIMEOUT_S mean the engine is stuck (alive,
# not serving): it is stopped and started again like an engine that exited. Generous, so that
# an engine busy under load is never taken for a stuck one: about a minute to notice.
LIVENESS_INTERVAL_S = 10.0
LIVENESS_TIMEOUT_S = 10.0
LIVENESS_FAILURES = 3
PROGRESS_INTERVAL_S = 2.0
ENGINE_POLL_S = 5.0  # how often a member waiting for its engine looks again
TAIL_LINES = 20  # engine log lines in a restarting/failed detail
# How long a starting agent waits for the first /health answer of the engines it adopts before
# its hello goes out: long enough for one probe, so the hello says "ready" and nothing moves.
ADOPT_PROBE_S = HEALTH_TIMEOUT_S + 0.5

# -- the supervisor --------------------------------------------------------------------------


@attrs.define(eq=False, kw_only=True)
class _Member:
    status: w.ReplicaStatus
    fingerprint: str  # of the assignment it runs
    engine: str
    assignment: w.ReplicaAssignment | None  # None: adopted, until a desired state confirms it
    assigned: trio.Event = attrs.Factory(trio.Event)
    observed: trio.Event = attrs.Factory(trio.Event)  # its engine was probed once (or it ended)
    scope: trio.CancelScope = attrs.Factory(trio.CancelScope)
    done: trio.Event = attrs.Factory(trio.Event)
    gpus: tuple[int, ...] = ()
    port: int = 0  # kept across restarts while it is free, so the gateway's address holds
    host: str = ""  # where rank 0's engine listens (while it runs)
    exits: list[float] = attrs.Factory(list)
    answered: int = 0  # liveness probes its engine answered (200) since it was ready, all starts together

    @property
    def key(self) -> Key:
        return (self.status.replica_id, self.status.node_rank)


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
        policy: RestartPolicy = DEFAULT_POLICY,
        stop_timeout_s: float = STOP_TIMEOUT_S,
        health_interval_s: float = HEALTH_INTERVAL_S,
        liveness: tuple[float, float, int] = (LIVENESS_INTERVAL_S, LIVENESS_TIMEOUT_S, LIVENESS_FAILURES),
        log_max_bytes: int = MAX_BYTES,
        log_files: int = FILES,
        log_check_s: float = CHECK_INTERVAL_S,
        use_pidfd: bool = True,
        address_present: Callable[[str], bool] = address_present,
    ) -> None:
        """`engine_command(name)` is the argv prefix of an engine (`Engines.command_for`);
        `gpus()` the GPU indices of this node; `env` the engines' base environment (default:
        the agent's, read at each start); `listen_host` where rank 0 engines listen: the link's
        `NodeAddress`, or a fixed address; `address_present(host)` whether an address is still
        this machine's (tests stand in for an address that leaves); `use_pidfd=False` watches
        adopted engines through /proc as on kernels without pidfds."""
        self.logs_dir = state_dir / "logs"
        self.records = RunRecords(state_dir / "run")
        self.keys = KeyFiles(state_dir / "keys")
        self.weights = weights
        self.engine_command = engine_command
        self.gpus = gpus
        self.env = env
        self.address = listen_host if isinstance(listen_host, NodeAddress) else NodeAddress(listen_host)
        self.policy = policy
        self.stop_timeout_s = stop_timeout_s
        self.health_interval_s = health_interval_s
        self.liveness_interval_s, self.liveness_timeout_s, self.liveness_failures = liveness
        self.log_max_bytes = log_max_bytes
        self.log_files = log_files
        self.log_check_s = log_check_s
        self.use_pidfd = use_pidfd
        self.address_present = address_present
        self._boot_id = ""
        self._wanted: tuple[w.ReplicaAssignment, ...] | None = None  # None: no desired state yet
        self._members: dict[Key, _Member] = {}
        self._retiring: list[_Member] = []  # cancelled, not yet finished
        self._nursery: trio.Nursery | None = None
        self._version = 0
        self.changed = Wakeup()  # `statuses()` changed: reports go out, tests look again
        self.released = Wakeup()  # a member gave its GPUs back
        self.probed = Wakeup()  # a ready engine's liveness was probed (`answered_probes`)

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
        self._boot_id = read_boot_id()
        found = adopt_all(self.records, boot_id=self._boot_id, use_pidfd=self.use_pidfd)
        self.keys.sweep(engine.record.key for engine in found)  # the others' engines are gone
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
        return tail_replica(self.logs_dir, replica_id, lines)

    # -- bookkeeping (synchronous)

    def _adopt(self, engine: Adopted) -> _Member:
        assert self._nursery is not None
        r = engine.record
        m = _Member(
            status=w.ReplicaStatus(
                replica_id=r.replica_id, model=r.model, state=w.STARTING, node_rank=r.node_rank, pid=r.pid
            ),
            fingerprint=r.fingerprint,
            engine=r.engine,
            assignment=None,
            gpus=r.gpus,
            port=r.port,
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
            if m.assignment is None:
                m.assignment = a
                m.assigned.set()
                log.info("replica_adoption_confirmed", replica=a.replica_id, rank=a.node_rank, pid=m.status.pid)
        for a in todo.start:
            k = key_of(a)
            before = [m for m in self._retiring if m.key == k]
            m = _Member(
                status=w.ReplicaStatus(replica_id=a.replica_id, model=a.model, state=w.FETCHING, node_rank=a.node_rank),
                fingerprint=fingerprint(a),
                engine=a.engine,
                assignment=a,
            )
            m.assigned.set()
            self._members[k] = m
            log.info("replica_assigned", replica=a.replica_id, rank=a.node_rank, model=a.model, engine=a.engine)
            self._nursery.start_soon(self._run, m, before)
        if todo.start or todo.stop:
            self._changed()

    def _retire(self, m: _Member) -> None:
        replica, rank = m.key
        log.info("replica_unassigned", replica=replica, rank=rank, adopted=m.assignment is None)
        if m.done.is_set():
            return  # failed and finished already: nothing runs
        self._set(m, w.STOPPING, detail="")
        self._retiring.append(m)
        m.scope.cancel()

    def _changed(self) -> None:
        self._version += 1
        self.changed.fire()

    def _set(self, m: _Member, state: str, *, detail: str | None = None, **fields: object) -> None:
        old = m.status
        if old.state == w.STOPPING and state != w.STOPPED:
            return
        if state != old.state and state not in TRANSITIONS[old.state]:
            raise RuntimeError(f"replica member may not go from {old.state} to {state}")
        if detail is None:
            detail = old.detail if state == old.state else ""
        new = attrs.evolve(old, state=state, detail=detail, **fields)
        if new == old:
            return
        m.status = new
        if state != old.state:
            replica, rank = m.key
            log.info("replica_state", replica=replica, rank=rank, state=state, was=old.state, pid=new.pid)
        self._changed()

    def _fail(self, m: _Member, reason: str) -> None:
        replica, rank = m.key
        log.warning("replica_failed", replica=replica, rank=rank, reason=reason)
        self._set(m, w.FAILED, detail=reason, pid=0)

    def _open_log(self, m: _Member) -> EngineLog:
        replica, rank = m.key
        return EngineLog(log_path(self.logs_dir, replica, rank), max_bytes=self.log_max_bytes, files=self.log_files)

    def _record(self, m: _Member, a: w.ReplicaAssignment, pid: int) -> None:
        """Note the engine in STATE/run, so that the next agent adopts it should this one die."""
        record = Record.of_child(
            a, pid, port=m.port, host=m.host, gpus=m.gpus, fingerprint=m.fingerprint, boot_id=self._boot_id
        )
        try:
            if record is not None:  # None: it is gone already, nothing to adopt
                self.records.write(record)
        except OSError as exc:
            # The engine runs all the same; only an agent that dies now would leave it unadopted.
            log.warning("replica_record_failed", replica=a.replica_id, rank=a.node_rank, reason=str(exc))

    # -- one member's life

    async def _run(self, m: _Member, before: list[_Member], adopted: Adopted | None = None) -> None:
        replica, rank = m.key
        try:
            with m.scope:
                for previous in before:
                    await previous.done.wait()  # its engine holds the port, the GPUs, the log file
                if adopted is not None and not await self._keep_adopted(m, adopted):
                    return
                await m.assigned.wait()  # an adopted engine that exited: its successor needs the assignment
                assert m.assignment is not None
                await self._live(m, m.assignment)
        except Exception as exc:  # one member's bug must not take down the others
            log.exception("replica_supervision_failed", replica=replica, rank=rank)
            m.status = attrs.evolve(
                m.status,
                state=w.FAILED,
                pid=0,
                detail=f"the agent failed supervising it: {exc!r} (a bug in llmgw; the agent's log has the traceback)",
            )
        finally:
            if adopted is not None:
                adopted.close()
            m.observed.set()
            if m.gpus:
                m.gpus = ()
                self.released.fire()
            if m in self._retiring:
                self._retiring.remove(m)
                # Directly, not through the table: a member that failed on its way out is stopped too.
                m.status = attrs.evolve(m.status, state=w.STOPPED, pid=0, port=0)
                log.info("replica_state", replica=replica, rank=rank, state=w.STOPPED)
            m.done.set()
            self._changed()

    async def _keep_adopted(self, m: _Member, engine: Adopted) -> bool:
        """Watch an engine an earlier agent started until it exits; True: start it again."""
        engine_log = self._open_log(m)
        try:
            ago = max(0.0, time.time() - engine.record.started_at)
            engine_log.note(
                f"adopted pid {engine.pid} (port {engine.record.port}), started {ago:.0f} s ago by an earlier "
                f"agent process; its exit is watched through {engine.watched_by}"
            )
            await self._watch(m, engine, engine_log)
            return await self._back_off(m, None, describe_end(engine), engine_log)
        finally:
            engine_log.close()

    async def _live(self, m: _Member, a: w.ReplicaAssignment) -> None:
        try:
            check_name(a.replica_id, "replica id")
            check_name(a.model, "model name")
            model_path = await self._fetch(m, a)
            prefix = await self._engine(m, a)
            await self._take_gpus(m, a)
        except Exception as exc:
            # Raised inside a nursery (the download's progress reporter), it comes in a group.
            if not only(exc, LlmgwError):
                raise
            self._fail(m, str(leaves(exc)[0]))
            return
        engine_log = self._open_log(m)
        try:
            await self._keep_running(m, a, model_path, prefix, engine_log)
        finally:
            engine_log.close()

    async def _fetch(self, m: _Member, a: w.ReplicaAssignment) -> str:
        source = a.weights
        if not source.url and not source.path:
            if a.engine == "sim":
                return ""  # the sim needs no weights
            raise BadWeightsSource(f"model {a.model} on {a.engine} has no weights url or path; set one in server.toml")
        self._set(m, w.FETCHING)

        async def report() -> None:
            while True:
                await trio.sleep(PROGRESS_INTERVAL_S)
                progress = self.weights.progress(source)
                if progress is not None:
                    self._set(m, w.FETCHING, detail=describe(progress))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(report)
            path = await self.weights.prepare(source, on_wait=lambda text: self._set(m, w.FETCHING, detail=text))
            nursery.cancel_scope.cancel()
        return path

    async def _engine(self, m: _Member, a: w.ReplicaAssignment) -> tuple[str, ...]:
        while True:
            try:
                return tuple(self.engine_command(a.engine))
            except EngineUnavailable as exc:
                if exc.pending:
                    self._set(m, w.FETCHING, detail=str(exc))
                else:
                    self._fail(m, str(exc))
            await trio.sleep(ENGINE_POLL_S)  # an install may finish, or be retried, at any time

    async def _take_gpus(self, m: _Member, a: w.ReplicaAssignment) -> None:
        wanted = a.gpus
        while True:
            released = self.released.next()
            held = {g for x in (*self._members.values(), *self._retiring) if x is not m for g in x.gpus}
            mine = list(self.gpus())
            free = [g for g in mine if g not in held]
            if len(free) >= wanted:
                m.gpus = tuple(free[:wanted])
                return
            detail = f"needs {wanted} GPUs; {len(free)} of this node's {len(mine)} are free"
            if any(x.gpus for x in self._retiring):
                self._set(m, w.FETCHING, detail=detail + ", waiting for stopping replicas to release theirs")
            else:
                self._fail(m, detail)
            await released.wait()

    async def _keep_running(
        self, m: _Member, a: w.ReplicaAssignment, model_path: str, prefix: tuple[str, ...], engine_log: EngineLog
    ) -> None:
        while True:
            host = await self._listen_host(m) if a.node_rank == 0 else "127.0.0.1"
            try:
                command = build_command(self._launch(m, a, model_path, host), prefix)
            except LlmgwError as exc:
                self._fail(m, str(exc))
                return
            code = await self._run_once(m, a, command, engine_log)
            if not await self._back_off(m, code, describe_exit(code), engine_log):
                return

    async def _back_off(self, m: _Member, code: int | None, what: str, engine_log: EngineLog) -> bool:
        """After an engine exit: wait as the restart policy says (True), or fail the member (False)."""
        replica, rank = m.key
        now = trio.current_time()
        m.exits = [*self.policy.recent(m.exits, now), now]
        delay = self.policy.next_delay(m.exits, now)
        if delay is None:
            engine_log.note(f"{what}; {len(m.exits)} exits within {self.policy.window_s:g} s: not restarting")
            self._fail(
                m,
                f"{what}, {len(m.exits)} times within {self.policy.window_s:g} s; not restarted until the "
                f"assignment changes. Last lines of its log:\n{engine_log.tail(TAIL_LINES)}",
            )
            return False
        engine_log.note(f"{what}; restarting in {delay:g} s")
        log.warning("replica_exited", replica=replica, rank=rank, exit_status=code, restart_in_s=delay)
        self._set(
            m,
            w.RESTARTING,
            detail=f"{what}; restarting in {delay:g} s. Last lines of its log:\n{engine_log.tail(TAIL_LINES)}",
            pid=0,
            port=0,
            restarts=m.status.restarts + 1,
        )
        await trio.sleep(delay)
        return True

    async def _listen_host(self, m: _Member) -> str:
        """Where rank 0's engine listens this start: the address the gateway reaches this node at
        now. Unknown only before the link's first connect (an adopted engine that exited early):
        then it waits rather than listen on every address."""
        if not self.address.current:
            self._set(
                m,
                w.FETCHING,
                detail="waiting for the link to the control plane: the engine listens on the address it reaches this "
                "node at",
            )
        return await self.address.wait_known()

    def _launch(self, m: _Member, a: w.ReplicaAssignment, model_path: str, host: str) -> ReplicaLaunch:
        # Workers serve nothing, but every spec wants a port: a free one on loopback, never reported.
        m.port = pick_port(host, m.port)
        m.host = host
        replica, rank = m.key
        return ReplicaLaunch(
            engine=a.engine,
            model_path=model_path,
            served_name=a.model,
            host=host,
            port=m.port,
            api_key=Secret(a.api_key),
            gpus=m.gpus,
            extra_args=a.args,
            nnodes=max(1, len(a.nodes)),
            node_rank=a.node_rank,
            rank0_addr=a.rank0_addr,
            dist_init_port=a.dist_init_port,
            ib_adapters=a.ib_adapters,
            private_dir=str(self.keys.dir_for(replica, rank)),
        )

    async def _run_once(
        self, m: _Member, a: w.ReplicaAssignment, command: Command, engine_log: EngineLog
    ) -> int | None:
        """Run the engine once, until it exits (its status) or the member is cancelled (then stop it)."""
        shown = command.for_log()
        self._set(m, w.STARTING, pid=0, port=0)
        await engine_log.rotate_if_needed()
        engine_log.note(f"starting {a.engine} for replica {a.replica_id} rank {a.node_rank}: {json.dumps(shown)}")
        log.info("replica_starting", replica=a.replica_id, rank=a.node_rank, **shown)
        env = command.environment(os.environ if self.env is None else self.env)
        try:
            self.keys.write(a.replica_id, a.node_rank, command)
        except OSError as exc:
            engine_log.note(f"cannot write the engine's key file: {exc}")
            log.error("replica_key_not_written", replica=a.replica_id, rank=a.node_rank, reason=str(exc))
            self.keys.remove(a.replica_id, a.node_rank)
            return None
        try:
            proc = await trio.lowlevel.open_process(
                list(command.argv),
                env=env,
                stdin=subprocess.DEVNULL,
                # The log file itself, not a pipe: the engine's output must not depend on this agent living.
                stdout=engine_log.fileno(),
                stderr=engine_log.fileno(),
                start_new_session=True,  # its own process group: a stop reaches the engine's children too
            )
        except OSError as exc:
            engine_log.note(f"cannot run {command.argv[0]}: {exc.strerror or exc}")
            self.keys.remove(a.replica_id, a.node_rank)
            return None
        self._set(m, w.STARTING, pid=proc.pid)
        engine_log.note(f"pid {proc.pid}")
        self._record(m, a, proc.pid)
        await self._watch(m, Child(proc), engine_log)
        return proc.returncode

    async def _watch(self, m: _Member, engine: EngineProcess, engine_log: EngineLog) -> None:
        """Until the engine exits; cancelled, it stops the engine first (shielded, bounded). Either
        way nothing of its process group is left and its run record is gone."""
        replica, rank = m.key
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(engine_log.serve_rotation, self.log_check_s)
                if rank == 0:
                    nursery.start_soon(self._watch_health, m, probe_host(m.host), m.port, engine, engine_log)
                    nursery.start_soon(self._watch_address, m, engine, engine_log)
                else:
                    self._set(m, w.READY)
                    m.observed.set()
                await engine.wait()
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(self.stop_timeout_s + KILL_WAIT_S):
                if not engine.exited:
                    self._set(m, w.STOPPING)
                    await self._terminate(m, engine, engine_log)
                signal_group(engine.pgid, signal.SIGKILL)  # whatever it left behind in its group
            if not engine.exited:  # the bounded cleanup ran out: leave nothing running
                signal_group(engine.pgid, signal.SIGKILL)
            self.records.remove(replica, rank)
            self.keys.remove(replica, rank)

    async def _terminate(self, m: _Member, engine: EngineProcess, engine_log: EngineLog) -> None:
        replica, rank = m.key
        started = trio.current_time()
        signal_group(engine.pgid, signal.SIGTERM)
        with trio.move_on_after(self.stop_timeout_s):
            await engine.wait()
        if not engine.exited:
            engine_log.note(f"still running {self.stop_timeout_s:g} s after SIGTERM: sending SIGKILL")
            log.warning("replica_kill", replica=replica, rank=rank, after_s=self.stop_timeout_s)
            signal_group(engine.pgid, signal.SIGKILL)
            with trio.move_on_after(KILL_WAIT_S):
                await engine.wait()
        took = trio.current_time() - started
        engine_log.note(f"stopped: {describe_end(engine)}, {took:.1f} s after SIGTERM")
        log.info(
            "replica_stopped",
            replica=replica,
            rank=rank,
            pid=engine.pid,
            exit_status=engine.returncode,
            took_s=round(took, 2),
        )

    async def _watch_address(self, m: _Member, engine: EngineProcess, engine_log: EngineLog) -> None:
        """Stop the engine, to be started again, once the address it listens on has left this
        machine: the gateway could no longer reach it. Looked at whenever the link's address changes."""
        while True:
            await self.address.wait_changed()
            if self.address_present(m.host):
                continue  # still here: the engine is not restarted for the link's sake
            said = (
                f"its address {m.host} is no longer one of this machine's (the link now comes from "
                f"{self.address.current}): stopping it to start it again there"
            )
            engine_log.note(said)
            replica, rank = m.key
            log.warning("replica_address_gone", replica=replica, rank=rank, host=m.host, now=self.address.current)
            self._set(m, w.RESTARTING, detail=said)
            await self._terminate(m, engine, engine_log)
            return

    async def _watch_health(
        self, m: _Member, host: str, port: int, engine: EngineProcess, engine_log: EngineLog
    ) -> None:
        """Ready once `GET /health` answers 200; then, while it runs, stopped if it stops answering."""
        while True:
            status = await probe_health(host, port)
            m.observed.set()
            if status == 200:
                self._set(m, w.READY, port=port)
                break
            if status is not None:
                self._set(m, w.STARTING, port=port)  # it listens, it does not serve yet
            await trio.sleep(self.health_interval_s)
        failures = 0
        while failures < self.liveness_failures:
            await trio.sleep(self.liveness_interval_s)
            status = await probe_health(host, port, timeout_s=self.liveness_timeout_s)
            failures = 0 if status == 200 else failures + 1
            m.answered += status == 200
            self.probed.fire()
        replica, rank = m.key
        last = "no answer" if status is None else f"status {status}"
        said = (
            f"GET /health: {last}, {failures} times in a row {self.liveness_interval_s:g} s apart (after it was "
            "ready): the engine is stuck; stopping it to start it again"
        )
        engine_log.note(said)
        log.warning("replica_unresponsive", replica=replica, rank=rank, failures=failures, last=last)
        self._set(m, w.RESTARTING, detail=said)
        await self._terminate(m, engine, engine_log)


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
    while True:
        state = desired()
        if state is not None:
            supervisor.assign(state.replicas)
        await desired_changed()
