"""A replica member's engine while it runs, watched until it exits, and stopped: how
`agent.replica_life` runs each engine it starts (or adopts), for every member of one supervisor.

Rank 0 is ready when `GET /health` answers 200; a worker when it runs. A rank 0 that stops
answering /health while it runs is stopped, to be started again as if it had exited
(`LIVENESS_*`: a hung engine is not left holding its replica). An engine whose listening address
has left the machine (the link came back from another) is stopped to be started again there.

An engine that can park its model (`EngineSpec.park`: vLLM's sleep mode) is parked and woken by
rank 0's watch as the control plane asks (`Member.park_wanted`): `parked` once its engine says
so, `ready` again once woken. A park that fails leaves it serving (and is tried again); a wake
that fails has the engine stopped and started again, which serves as surely. An engine found
parked when it is first seen ready (adopted from an earlier agent) reports `parked`.

Cancelling the watch is the stop: SIGTERM to the engine's process group, a deadline, then
SIGKILL, in shielded and bounded cleanup. However the watch ends, nothing of the engine's process
group is left, and its run record and key file are gone. The process plumbing (process group
signals, health probe) is `agent.engine_proc`.
"""

from __future__ import annotations

import json
import math
import signal
from collections.abc import Awaitable, Callable

import trio

from agent.adoption import RunRecords
from agent.engine_proc import HEALTH_TIMEOUT_S, EngineProcess, call_engine, probe_health, probe_host, signal_group
from agent.key_files import KeyFiles
from agent.node_address import NodeAddress
from agent.replica_logs import EngineLog
from agent.replica_member import Member
from agent.replica_plan import describe_end
from llmgw.engines import SPECS
from llmgw.engines.spec import Park
from llmgw.log import get_logger
from llmgw.wakeup import Wakeup
from llmgw.wire import agent_link as w

log = get_logger("llmgw.agent.replicas")

STOP_TIMEOUT_S = 10.0  # SIGTERM to SIGKILL
KILL_WAIT_S = 5.0  # after SIGKILL, before giving up on reaping
HEALTH_INTERVAL_S = 0.5
FIRST_HEALTH_INTERVAL_S = 0.05  # a starting engine is asked this soon again at first, doubling to HEALTH_INTERVAL_S
# Once ready, rank 0's /health is asked again every LIVENESS_INTERVAL_S; LIVENESS_FAILURES
# answers in a row that are not 200 within LIVENESS_TIMEOUT_S mean the engine is stuck (alive,
# not serving): it is stopped and started again like an engine that exited. Generous, so that
# an engine busy under load is never taken for a stuck one: about a minute to notice.
LIVENESS_INTERVAL_S = 10.0
LIVENESS_TIMEOUT_S = 10.0
LIVENESS_FAILURES = 3
# How long an engine may take to park or wake its model (vLLM copies the weights to host memory
# and back: seconds for a large model), and how soon a park that failed is tried again.
PARK_TIMEOUT_S = 120.0
PARK_RETRY_S = 30.0


# What runs beside an engine while it runs (`EngineWatch.watch`): given `ready`, it returns only
# to have the engine stopped, saying why.
Beside = Callable[[Callable[[], None]], Awaitable[str]]


class _Probes:
    """The scopes of an engine's checks, cancelled together (`stop`), those begun after too."""

    def __init__(self) -> None:
        self._scopes: list[trio.CancelScope] = []
        self._stopped = False

    def scope(self) -> trio.CancelScope:
        scope = trio.CancelScope()
        if self._stopped:
            scope.cancel()
        self._scopes.append(scope)
        return scope

    def cancel(self) -> None:
        self._stopped = True
        for scope in self._scopes:
            scope.cancel()


class EngineWatch:
    """How the engines of one supervisor's members are watched and stopped: the timings, the
    node's address, and the run records and key files an engine leaves while it runs."""

    def __init__(
        self,
        *,
        records: RunRecords,
        keys: KeyFiles,
        address: NodeAddress,
        address_present: Callable[[str], bool],
        stop_timeout_s: float,
        health_interval_s: float,
        liveness: tuple[float, float, int],
        log_check_s: float,
    ) -> None:
        self.records = records
        self.keys = keys
        self.address = address
        self.address_present = address_present
        self.stop_timeout_s = stop_timeout_s
        self.health_interval_s = health_interval_s
        self.liveness_interval_s, self.liveness_timeout_s, self.liveness_failures = liveness
        self.log_check_s = log_check_s
        self.probed = Wakeup()  # a ready engine's liveness was probed (`Member.answered`)

    async def watch(
        self, m: Member, engine: EngineProcess, engine_log: EngineLog, beside: Beside | None = None
    ) -> None:
        """Until the engine exits; cancelled, it stops the engine first (shielded, bounded). Either
        way nothing of its process group is left and its run record is gone.

        `beside(ready)` runs while the engine does (a llama.cpp RPC member's tunnel,
        `agent.replica_rpc`): a worker is ready when it calls `ready()` rather than at once, and
        when it returns, what it says is why the engine is stopped (to be started again)."""
        replica, rank = m.key
        probes = _Probes()  # the engine's own checks, ended when `beside` stops it

        async def probing(check: Callable[..., Awaitable[None]], *args: object) -> None:
            with probes.scope():
                await check(*args)

        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(engine_log.serve_rotation, self.log_check_s)
                if rank == 0:
                    nursery.start_soon(probing, self._watch_health, m, probe_host(m.host), m.port, engine, engine_log)
                    nursery.start_soon(probing, self._watch_address, m, engine, engine_log)
                elif beside is None:
                    m.set(w.READY)
                    m.observed.set()
                if beside is not None:
                    nursery.start_soon(self._watch_beside, m, beside, probes, engine, engine_log)
                await engine.wait()
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(self.stop_timeout_s + KILL_WAIT_S):
                if not engine.exited:
                    m.set(w.STOPPING)
                    await self._terminate(m, engine, engine_log)
                signal_group(engine.pgid, signal.SIGKILL)  # whatever it left behind in its group
            if not engine.exited:  # the bounded cleanup ran out: leave nothing running
                signal_group(engine.pgid, signal.SIGKILL)
            self.records.remove(replica, rank)
            self.keys.remove(replica, rank)

    async def _watch_beside(
        self, m: Member, beside: Beside, probes: _Probes, engine: EngineProcess, engine_log: EngineLog
    ) -> None:
        def ready() -> None:
            m.set(w.READY)
            m.observed.set()

        said = await beside(ready)
        probes.cancel()  # no probe may call it ready while it stops
        engine_log.note(said)
        replica, rank = m.key
        log.warning("replica_companion_ended", replica=replica, rank=rank, said=said)
        m.set(w.RESTARTING, detail=said)
        await self._terminate(m, engine, engine_log)

    async def _terminate(self, m: Member, engine: EngineProcess, engine_log: EngineLog) -> None:
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

    async def _watch_address(self, m: Member, engine: EngineProcess, engine_log: EngineLog) -> None:
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
            m.set(w.RESTARTING, detail=said)
            await self._terminate(m, engine, engine_log)
            return

    async def _watch_health(
        self, m: Member, host: str, port: int, engine: EngineProcess, engine_log: EngineLog
    ) -> None:
        """Ready once `GET /health` answers 200; then, while it runs, stopped if it stops answering.
        Asked every 50 ms at first, doubling to `health_interval_s`: a small model loads in a
        tenth of a second, and a request held for a model on demand waits for this answer."""
        interval = min(FIRST_HEALTH_INTERVAL_S, self.health_interval_s)
        park = _park_of(m)
        while True:
            status = await probe_health(host, port)
            if status == 200:
                parked = park is not None and await _parked_now(park, host, port, _bearer(m))
                m.set(w.PARKED if parked else w.READY, port=port, events_port=m.events_port)
                m.observed.set()
                break
            m.observed.set()
            if status is not None:
                m.set(w.STARTING, port=port)  # it listens, it does not serve yet
            await trio.sleep(interval)
            interval = min(2 * interval, self.health_interval_s)
        said = ""

        async def until(check: Callable[[], Awaitable[str]], done: trio.CancelScope) -> None:
            nonlocal said
            said = await check()
            done.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(until, lambda: self._liveness(m, host, port, engine_log), nursery.cancel_scope)
            if park is not None:
                nursery.start_soon(
                    until, lambda: self._keep_parked(m, park, host, port, engine_log), nursery.cancel_scope
                )
        m.set(w.RESTARTING, detail=said)
        await self._terminate(m, engine, engine_log)

    async def _liveness(self, m: Member, host: str, port: int, engine_log: EngineLog) -> str:
        """Until /health has failed `liveness_failures` times in a row: what to say of it."""
        failures = 0
        status = None
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
        return said

    async def _keep_parked(self, m: Member, park: Park, host: str, port: int, engine_log: EngineLog) -> str:
        """Park or wake the engine whenever the control plane's wish and its state differ, until a
        wake fails: what to say of it (the engine is then started again)."""
        replica, rank = m.key
        retry = math.inf
        while True:
            changed = m.park_changed.next()
            want = m.park_wanted
            if want != (m.status.state == w.PARKED):
                started = trio.current_time()
                answer = await call_engine(
                    host, port, "POST", park.sleep if want else park.wake, timeout_s=PARK_TIMEOUT_S, bearer=_bearer(m)
                )
                took = trio.current_time() - started
                if answer is not None and answer[0] == 200:
                    m.set(w.PARKED if want else w.READY, detail="")
                    engine_log.note(f"{'parked' if want else 'woken'} in {took:.2f} s")
                    log.info(
                        "replica_parked" if want else "replica_woken", replica=replica, rank=rank, took_s=round(took, 3)
                    )
                    retry = math.inf
                    continue  # the wish may have changed meanwhile
                why = _failure(answer, took)
                if not want:
                    said = f"could not wake its model ({why}): stopping the engine to start it again"
                    engine_log.note(said)
                    log.warning("replica_wake_failed", replica=replica, rank=rank, reason=why)
                    return said
                said = f"could not park its model ({why}); it serves on, tried again in {PARK_RETRY_S:g} s"
                engine_log.note(said)
                log.warning("replica_park_failed", replica=replica, rank=rank, reason=why)
                m.set(w.READY, detail=said)
                retry = PARK_RETRY_S
            with trio.move_on_after(retry):
                await changed.wait()


def _park_of(m: Member) -> Park | None:
    """How the member's engine parks, if it was started able to (an adopted one before its
    assignment is confirmed: if its engine can at all; an engine not in sleep mode says it is not
    parked)."""
    spec = SPECS.get(m.engine)
    park = spec.park if spec is not None else None
    if park is None or (m.assignment is not None and not m.assignment.parkable):
        return None
    return park


def _bearer(m: Member) -> str:
    return m.assignment.api_key if m.assignment is not None else ""


async def _parked_now(park: Park, host: str, port: int, bearer: str) -> bool:
    """Whether the engine says its model is parked (False when it does not answer so)."""
    answer = await call_engine(host, port, "GET", park.state, timeout_s=HEALTH_TIMEOUT_S, bearer=bearer)
    if answer is None or answer[0] != 200:
        return False
    try:
        said = json.loads(answer[1])
    except ValueError:
        return False
    return isinstance(said, dict) and said.get(park.state_key) is True


def _failure(answer: tuple[int, bytes] | None, took: float) -> str:
    if answer is None:
        return f"no answer within {took:.0f} s"
    text = answer[1][:200].decode("utf-8", "replace").strip()
    return f"status {answer[0]}" + (f": {text}" if text else "")
