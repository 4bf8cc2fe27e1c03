"""One replica member's whole life on this node, from its assignment (or an engine an earlier
agent left running) to its end: fetch the weights, wait for the engine and the GPUs, start the
engine, have it watched, start it again by the restart policy, and stop it when cancelled. Which
members there are, and when one starts or is cancelled, is `agent.replica_supervisor`'s; the
member itself (its status and the moves `TRANSITIONS` allows) `agent.replica_member`'s.

After an engine exit a member goes `restarting` (the engine's last log lines in `detail`) and
waits as the restart policy says (`agent.replica_plan.RESTART_BACKOFF`), or goes `failed` when it
failed too often; it also fails when it cannot start. An adopted member starts at `starting`;
when its engine exits it goes through the same restart policy and its successor starts the
ordinary way. Each engine, once started, is watched until it exits or the member is cancelled
(`agent.replica_watch`: ready, alive, still reachable, and the stop: cancelling the member's task
stops its engine). A multi-node engine fails as a whole by itself (rank 0 exits when a member is
lost), so every member just restarts its own process and the rendezvous forms again.

Engine output goes to rotated files (`agent.replica_logs`); the process plumbing (process group
signals, health probe, port) is `agent.engine_proc`; run records `agent.adoption`; weights
`agent.weights`.

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
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from pathlib import Path

import attrs
import trio

from agent import replica_rpc
from agent.adoption import Adopted, Record, RunRecords
from agent.engine_proc import Child, pick_port
from agent.engines import EngineUnavailable
from agent.key_files import KeyFiles
from agent.node_address import NodeAddress
from agent.replica_logs import EngineLog, log_path
from agent.replica_member import Member
from agent.replica_plan import describe_end, describe_exit
from agent.replica_rpc import RpcIdentity
from agent.replica_watch import Beside, EngineWatch
from agent.rpctunnel import HelperUnreachable, TunnelClient
from agent.weights import BadWeightsSource, WeightsStore, check_name, describe
from llmgw.backoff import Backoff
from llmgw.config import Secret
from llmgw.engines import Command, ReplicaLaunch, build_command, llamacpp, spec_for
from llmgw.errors import LlmgwError, leaves, only
from llmgw.log import get_logger
from llmgw.wakeup import Wakeup
from llmgw.wire import agent_link as w

log = get_logger("llmgw.agent.replicas")

PROGRESS_INTERVAL_S = 2.0
ENGINE_POLL_S = 5.0  # how often a member waiting for its engine looks again
TAIL_LINES = 20  # engine log lines in a restarting/failed detail


class Life:
    """What the members of one supervisor live by (the node's engines, GPUs, weights and files,
    the restart policy, how their engines are watched), and `run`: one member's life."""

    def __init__(
        self,
        *,
        state_dir: Path,
        weights: WeightsStore,
        engine_command: Callable[[str], Sequence[str]],
        gpus: Callable[[], Sequence[int]],
        env: Mapping[str, str] | None,
        address: NodeAddress,
        address_present: Callable[[str], bool],
        backoff: Backoff,
        stop_timeout_s: float,
        health_interval_s: float,
        liveness: tuple[float, float, int],
        log_max_bytes: int,
        log_files: int,
        log_check_s: float,
        holders: Callable[[], Iterable[Member]],
        retiring: Callable[[], Iterable[Member]],
        rpc: RpcIdentity | None = None,
    ) -> None:
        """`holders()` are the members that may hold GPUs (running or on their way out),
        `retiring()` those on their way out; `rpc`: this node's TLS for llama.cpp's RPC tunnels
        (None: it takes no part in a replica over RPC); the rest is `Supervisor`'s arguments."""
        self.rpc = rpc
        self.logs_dir = state_dir / "logs"
        self.records = RunRecords(state_dir / "run")
        self.keys = KeyFiles(state_dir / "keys")
        self.weights = weights
        self.engine_command = engine_command
        self.gpus = gpus
        self.env = env
        self.address = address
        self.backoff = backoff
        self.log_max_bytes = log_max_bytes
        self.log_files = log_files
        self.holders = holders
        self.retiring = retiring
        self.boot_id = ""  # this boot's, read by the supervisor at each start: written into run records
        self.released = Wakeup()  # a member gave its GPUs back
        self.watch = EngineWatch(
            records=self.records,
            keys=self.keys,
            address=address,
            address_present=address_present,
            stop_timeout_s=stop_timeout_s,
            health_interval_s=health_interval_s,
            liveness=liveness,
            log_check_s=log_check_s,
        )

    async def run(self, m: Member, before: list[Member], adopted: Adopted | None = None) -> None:
        """The member's whole life: after the members it replaces (`before`) are done, keep the
        adopted engine while it runs, then run its assignment; until cancelled (the stop) or
        failed. A bug here fails this member only. Whatever way it ends, its GPUs are free after."""
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

    async def _keep_adopted(self, m: Member, engine: Adopted) -> bool:
        """Watch an engine an earlier agent started until it exits; True: start it again."""
        engine_log = self._open_log(m)
        try:
            ago = max(0.0, time.time() - engine.record.started_at)
            engine_log.note(
                f"adopted pid {engine.pid} (port {engine.record.port}), started {ago:.0f} s ago by an earlier "
                f"agent process; its exit is watched through {engine.watched_by}"
            )
            await self.watch.watch(m, engine, engine_log, _stop_at_once if engine.record.rpc else None)
            return await self._back_off(m, None, describe_end(engine), engine_log)
        finally:
            engine_log.close()

    async def _live(self, m: Member, a: w.ReplicaAssignment) -> None:
        try:
            check_name(a.replica_id, "replica id")
            check_name(a.model, "model name")
            # A llama.cpp RPC helper holds no weights: rank 0 sends it the tensors.
            model_path = "" if replica_rpc.is_helper(a) else await self._fetch(m, a)
            prefix = await self._engine(m, a)
            await self._take_gpus(m, a)
        except Exception as exc:
            # Raised inside a nursery (the download's progress reporter), it comes in a group.
            if not only(exc, LlmgwError):
                raise
            m.fail(str(leaves(exc)[0]))
            return
        engine_log = self._open_log(m)
        try:
            await self._keep_running(m, a, model_path, prefix, engine_log)
        finally:
            engine_log.close()

    async def _fetch(self, m: Member, a: w.ReplicaAssignment) -> str:
        source = a.weights
        if not source.url and not source.path and not source.files:
            if a.engine == "sim":
                return ""  # the sim needs no weights
            raise BadWeightsSource(f"model {a.model} on {a.engine} has no weights url or path; set one in server.toml")
        m.set(w.FETCHING)

        async def report() -> None:
            last: tuple[float, int] | None = None  # (when, bytes) at the last look: the rate since
            while True:
                await trio.sleep(PROGRESS_INTERVAL_S)
                progress = self.weights.progress(source)
                if progress is None:
                    last = None
                    continue
                now = trio.current_time()
                rate = (progress.done_bytes - last[1]) / (now - last[0]) if last and now > last[0] else None
                last = (now, progress.done_bytes)
                m.set(w.FETCHING, detail=describe(progress, rate))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(report)
            path = await self.weights.prepare(source, on_wait=lambda text: m.set(w.FETCHING, detail=text))
            nursery.cancel_scope.cancel()
        return path

    async def _engine(self, m: Member, a: w.ReplicaAssignment) -> tuple[str, ...]:
        while True:
            try:
                return tuple(self.engine_command(a.engine))
            except EngineUnavailable as exc:
                if exc.pending:
                    m.set(w.FETCHING, detail=str(exc))
                else:
                    m.fail(str(exc))
            await trio.sleep(ENGINE_POLL_S)  # an install may finish, or be retried, at any time

    async def _take_gpus(self, m: Member, a: w.ReplicaAssignment) -> None:
        wanted = a.gpus
        while True:
            released = self.released.next()
            held = {g for x in self.holders() if x is not m for g in x.gpus}
            mine = list(self.gpus())
            free = [g for g in mine if g not in held]
            if len(free) >= wanted:
                m.gpus = tuple(free[:wanted])
                return
            detail = f"needs {wanted} GPUs; {len(free)} of this node's {len(mine)} are free"
            if any(x.gpus for x in self.retiring()):
                m.set(w.FETCHING, detail=detail + ", waiting for stopping replicas to release theirs")
            else:
                m.fail(detail)
            await released.wait()

    async def _keep_running(
        self, m: Member, a: w.ReplicaAssignment, model_path: str, prefix: tuple[str, ...], engine_log: EngineLog
    ) -> None:
        while True:
            try:
                if replica_rpc.is_helper(a):
                    code, what = await self._run_helper(m, a, prefix, engine_log)
                elif replica_rpc.spans_rpc(a):
                    code, what = await self._run_with_helpers(m, a, model_path, prefix, engine_log)
                else:
                    host = await self._listen_host(m) if a.node_rank == 0 else "127.0.0.1"
                    code = await self._run_once(
                        m, a, build_command(self._launch(m, a, model_path, host), prefix), engine_log
                    )
                    what = describe_exit(code)
            except LlmgwError as exc:
                m.fail(str(exc))
                return
            if not await self._back_off(m, code, what, engine_log):
                return

    def _rpc_identity(self) -> RpcIdentity:
        if self.rpc is None:
            raise replica_rpc.RpcUnavailable("this agent was started without its node's TLS files for llama.cpp's RPC")
        return self.rpc

    async def _run_helper(
        self, m: Member, a: w.ReplicaAssignment, prefix: tuple[str, ...], engine_log: EngineLog
    ) -> tuple[int | None, str]:
        """A llama.cpp RPC helper's rpc-server once, its tunnel beside it (`agent.replica_rpc`)."""
        identity = self._rpc_identity()
        executable = replica_rpc.rpc_server_beside(prefix)
        bind = await self._listen_host(m)  # the tunnel's: where rank 0 dials this node
        named = a.member_addrs[a.node_rank] if len(a.member_addrs) > a.node_rank else bind
        if named != bind:  # a NAT between this node and the control plane: rank 0 dials what it names
            log.warning("rpc_tunnel_address", replica=a.replica_id, rank=a.node_rank, listens=bind, dialled=named)
        command = llamacpp.rpc_server_command(self._launch(m, a, "", replica_rpc.LOCAL), executable)
        beside = partial(replica_rpc.serve_helper, identity, a, m.port, bind)
        code = await self._run_once(m, a, command, engine_log, beside=beside)
        return code, describe_exit(code)

    async def _run_with_helpers(
        self, m: Member, a: w.ReplicaAssignment, model_path: str, prefix: tuple[str, ...], engine_log: EngineLog
    ) -> tuple[int | None, str]:
        """Rank 0 of a llama.cpp replica over RPC once: its local ends of the helpers' tunnels,
        the wait for every helper, then llama-server with --rpc to them (`agent.replica_rpc`)."""
        identity = self._rpc_identity()
        tunnels = TunnelClient(replica_rpc.helpers_of(a), identity.client_context, identity.ca)
        host = await self._listen_host(m)
        async with trio.open_nursery() as nursery:
            ports = await nursery.start(tunnels.serve)
            m.set(w.STARTING, detail="waiting for the helper nodes", pid=0, port=0, events_port=0)
            try:
                await tunnels.wait_reachable(
                    within_s=replica_rpc.HELPERS_WAIT_S, on_wait=lambda text: m.set(w.STARTING, detail=text)
                )
            except HelperUnreachable as exc:
                engine_log.note(str(exc))
                nursery.cancel_scope.cancel()
                return None, str(exc)
            m.set(w.STARTING, detail="")
            servers = tuple(f"{replica_rpc.LOCAL}:{port}" for port in ports)
            layers = await trio.to_thread.run_sync(replica_rpc.model_layers, model_path)
            launch = attrs.evolve(self._launch(m, a, model_path, host), rpc_servers=servers, model_layers=layers)
            command = build_command(launch, prefix)
            lost = tunnels.lost.next()

            async def beside(ready: Callable[[], None]) -> str:
                await lost.wait()
                return f"{tunnels.lost_how}: stopping llama-server to start it again once every helper answers"

            code = await self._run_once(m, a, command, engine_log, beside=beside)
            nursery.cancel_scope.cancel()
        if lost.is_set():  # the helper's loss is the news, the engine's exit its consequence
            return code, f"{tunnels.lost_how}; llama-server stopped ({describe_exit(code)})"
        return code, describe_exit(code)

    async def _back_off(self, m: Member, code: int | None, what: str, engine_log: EngineLog) -> bool:
        """After an engine exit: wait as the restart policy says (True), or fail the member (False)."""
        replica, rank = m.key
        m.exits.failed(trio.current_time())
        if m.exits.exhausted:
            n, window = m.exits.count, self.backoff.window_s
            engine_log.note(f"{what}; {n} exits within {window:g} s: not restarting")
            m.fail(
                f"{what}, {n} times within {window:g} s; not restarted until the assignment changes. "
                f"{w.LOG_TAIL_MARK}{engine_log.tail(TAIL_LINES)}"
            )
            return False
        delay = m.exits.delay()
        engine_log.note(f"{what}; restarting in {delay:g} s")
        log.warning("replica_exited", replica=replica, rank=rank, exit_status=code, restart_in_s=delay)
        m.set(
            w.RESTARTING,
            detail=f"{what}; restarting in {delay:g} s. {w.LOG_TAIL_MARK}{engine_log.tail(TAIL_LINES)}",
            pid=0,
            port=0,
            events_port=0,
            restarts=m.status.restarts + 1,
        )
        await trio.sleep(delay)
        return True

    async def _listen_host(self, m: Member) -> str:
        """Where rank 0's engine listens this start: the address the gateway reaches this node at
        now. Unknown only before the link's first connect (an adopted engine that exited early):
        then it waits rather than listen on every address."""
        if not self.address.current:
            m.set(
                w.FETCHING,
                detail="waiting for the link to the control plane: the engine listens on the address it reaches this "
                "node at",
            )
        return await self.address.wait_known()

    def _launch(self, m: Member, a: w.ReplicaAssignment, model_path: str, host: str) -> ReplicaLaunch:
        # Workers serve nothing, but every spec wants a port: a free one on loopback, never reported.
        m.port = pick_port(host, m.port)
        m.host = host
        publishes = a.cache_events and a.node_rank == 0 and spec_for(a.engine).cache_events
        m.events_port = pick_port(host, m.events_port) if publishes else 0
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
            events_port=m.events_port,
            parkable=a.parkable and spec_for(a.engine).park is not None,
        )

    async def _run_once(
        self, m: Member, a: w.ReplicaAssignment, command: Command, engine_log: EngineLog, beside: Beside | None = None
    ) -> int | None:
        """Run the engine once, until it exits (its status) or the member is cancelled (then stop
        it); `beside`: what runs beside it (`EngineWatch.watch`)."""
        shown = command.for_log()
        m.set(w.STARTING, pid=0, port=0, events_port=0)
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
        m.set(w.STARTING, pid=proc.pid)
        engine_log.note(f"pid {proc.pid}")
        self._record(m, a, proc.pid)
        await self.watch.watch(m, Child(proc), engine_log, beside)
        return proc.returncode

    def _open_log(self, m: Member) -> EngineLog:
        replica, rank = m.key
        return EngineLog(log_path(self.logs_dir, replica, rank), max_bytes=self.log_max_bytes, files=self.log_files)

    def _record(self, m: Member, a: w.ReplicaAssignment, pid: int) -> None:
        """Note the engine in STATE/run, so that the next agent adopts it should this one die."""
        record = Record.of_child(
            a,
            pid,
            rpc=replica_rpc.spans_rpc(a),
            port=m.port,
            events_port=m.events_port,
            host=m.host,
            gpus=m.gpus,
            fingerprint=m.fingerprint,
            boot_id=self.boot_id,
        )
        try:
            if record is not None:  # None: it is gone already, nothing to adopt
                self.records.write(record)
        except OSError as exc:
            # The engine runs all the same; only an agent that dies now would leave it unadopted.
            log.warning("replica_record_failed", replica=a.replica_id, rank=a.node_rank, reason=str(exc))


async def _stop_at_once(ready: Callable[[], None]) -> str:
    """Beside an adopted engine of a replica over llama.cpp's RPC: its tunnel died with the agent
    that started it (`agent.replica_rpc`), so it is stopped to start again."""
    return replica_rpc.ADOPTED_SAID
