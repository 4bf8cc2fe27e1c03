"""A replica parked by its engine (vLLM's sleep mode) on the agent: started able to park
(`parkable`: `--enable-sleep-mode` and VLLM_SERVER_DEV_MODE), it is parked when a desired state
says `parked` and woken when one no longer does, the same engine process throughout (nothing
restarts); an engine that cannot park serves on; a wake that fails has the engine started again;
an engine found asleep when the agent first sees it ready reports `parked`. The engine is the
stand-in for `vllm serve` (`testlib.standin_vllm`: no GPU here) as a real process on loopback."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio
import trio.testing

from agent.adoption import Record, RunRecords, fingerprint, proc_stat, read_boot_id
from agent.engine_proc import call_engine
from agent.replica_logs import EngineLog, log_path
from agent.replica_supervisor import Supervisor
from agent.weights import WeightsStore
from llmgw.wire import agent_link as w
from testlib import standin_vllm
from testlib.cluster import free_port
from testlib.proc import llmgw_env
from testlib.waiting import await_true

pytestmark = pytest.mark.trio


def supervisor(state_dir: Path, env: dict[str, str]) -> Supervisor:
    return Supervisor(
        state_dir=state_dir,
        weights=WeightsStore(state_dir / "weights"),
        # By the module itself, so that Pants gives the sandbox its file.
        engine_command=lambda name: (sys.executable, "-m", standin_vllm.__name__),
        env={**llmgw_env(), **env},
        listen_host="127.0.0.1",
        stop_timeout_s=5.0,
        health_interval_s=0.1,
    )


def assignment(weights: Path, *, parked: bool = False, parkable: bool = True) -> w.ReplicaAssignment:
    return w.ReplicaAssignment(
        replica_id="q-1",
        model="q",
        engine="vllm",
        weights=w.WeightsSource(path=str(weights)),
        api_key="sk-engine-key-0001",
        nodes=("n1",),
        parkable=parkable,
        parked=parked,
    )


async def state_is(sup: Supervisor, state: str, *, other_than: int = 0) -> w.ReplicaStatus:
    def check() -> w.ReplicaStatus | None:
        return next(
            (s for s in sup.statuses() if s.state == state and s.pid and s.pid != other_than),
            None,
        )

    return await await_true(
        check, f"the replica {state}", changed=[sup.changed.next], timeout=60, report=lambda: repr(sup.statuses())
    )


def events(path: Path) -> list[str]:
    if not path.exists():
        return []
    return [json.loads(line)["event"] for line in path.read_text().splitlines() if line.strip()]


async def test_parked_and_woken_by_the_desired_state_with_the_same_engine_process(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    weights = tmp_path / "model"
    weights.mkdir()
    args_file, events_file = tmp_path / "argv.json", tmp_path / "events.jsonl"
    sup = supervisor(
        tmp_path / "state",
        {"STANDIN_ARGS_FILE": str(args_file), "STANDIN_EVENTS_FILE": str(events_file), "STANDIN_WAKE_S": "0.3"},
    )
    await nursery.start(sup.serve)
    sup.assign((assignment(weights),))
    ready = await state_is(sup, w.READY)
    assert "--enable-sleep-mode" in json.loads(args_file.read_text())

    sup.assign((assignment(weights, parked=True),))
    parked = await state_is(sup, w.PARKED)
    assert (parked.pid, parked.port, parked.restarts) == (ready.pid, ready.port, 0)
    said = await call_engine("127.0.0.1", ready.port, "GET", "/is_sleeping", timeout_s=5)
    assert said is not None and json.loads(said[1]) == {"is_sleeping": True}

    sup.assign((assignment(weights, parked=False),))
    woken = await state_is(sup, w.READY)
    assert (woken.pid, woken.restarts) == (ready.pid, 0)
    assert [e for e in events(events_file) if e != "request"] == ["start", "sleep", "wake"]
    log = "\n".join(p.read_text() for p in (tmp_path / "state" / "logs").glob("*.log"))
    assert "parked in " in log and "woken in " in log

    # Without parkable (a changed assignment) the engine starts again without sleep mode.
    sup.assign((assignment(weights, parkable=False),))
    await state_is(sup, w.READY, other_than=ready.pid)
    assert "--enable-sleep-mode" not in json.loads(args_file.read_text())


async def test_a_park_that_fails_leaves_it_serving_and_a_wake_that_fails_starts_the_engine_again(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    weights = tmp_path / "model"
    weights.mkdir()
    events_file = tmp_path / "events.jsonl"
    sup = supervisor(tmp_path / "state", {"STANDIN_EVENTS_FILE": str(events_file), "STANDIN_FAIL": "/sleep"})
    await nursery.start(sup.serve)
    sup.assign((assignment(weights),))
    ready = await state_is(sup, w.READY)
    sup.assign((assignment(weights, parked=True),))
    await await_true(
        lambda: "could not park its model (status 500" in sup.statuses()[0].detail or None,
        "the failed park said",
        changed=[sup.changed.next],
        timeout=30,
        report=lambda: repr(sup.statuses()),
    )
    [status] = sup.statuses()
    assert (status.state, status.pid, status.restarts) == (w.READY, ready.pid, 0)  # it serves on
    assert "sleep" not in events(events_file)
    sup.assign((assignment(weights),))  # wanted awake again: nothing to do

    # Its wake fails: the engine is started again (a fresh one serves), not left parked.
    events_file.unlink()
    sup = supervisor(tmp_path / "state2", {"STANDIN_EVENTS_FILE": str(events_file), "STANDIN_FAIL": "/wake_up"})
    await nursery.start(sup.serve)
    sup.assign((assignment(weights, parked=True),))
    parked = await state_is(sup, w.PARKED)
    sup.assign((assignment(weights),))
    again = await state_is(sup, w.READY, other_than=parked.pid)
    assert again.restarts == 1
    assert "could not wake its model (status 500" in sup.tail("q-1", 100)
    assert [e for e in events(events_file) if e != "request"] == ["start", "sleep", "start"]


async def test_an_engine_found_parked_by_a_new_agent_reports_parked_and_is_woken(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    """An agent that dies leaves its engines running, parked ones too: the next one adopts them
    and says which are parked, so that nothing routes to one before it is woken."""
    weights = tmp_path / "model"
    weights.mkdir()
    state = tmp_path / "state"
    port = free_port()
    a = assignment(weights, parked=True)
    argv = [sys.executable, "-m", standin_vllm.__name__, "serve", str(weights), "--served-model-name", "q"]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--enable-sleep-mode"]
    engine_log = EngineLog(log_path(state / "logs", "q-1", 0))
    orphan = subprocess.Popen(
        argv,
        env={**llmgw_env(), "VLLM_SERVER_DEV_MODE": "1", "VLLM_API_KEY": a.api_key},
        stdin=subprocess.DEVNULL,
        stdout=engine_log.fileno(),
        stderr=engine_log.fileno(),
        start_new_session=True,
    )
    engine_log.close()
    try:
        seen = proc_stat(orphan.pid)
        assert seen is not None
        RunRecords(state / "run").write(
            Record(
                replica_id="q-1",
                node_rank=0,
                model="q",
                engine="vllm",
                pid=orphan.pid,
                pgid=orphan.pid,
                start_time=seen.start_time,
                boot_id=read_boot_id(),
                port=port,
                host="127.0.0.1",
                fingerprint=fingerprint(a),
                started_at=time.time(),
            )
        )
        with trio.fail_after(30):
            while (await call_engine("127.0.0.1", port, "POST", "/sleep?level=1", timeout_s=5) or (0,))[0] != 200:
                await trio.sleep(0.05)
        sup = supervisor(state, {})
        await nursery.start(sup.serve)
        [first] = sup.statuses()  # what the hello says: parked, not ready
        assert (first.state, first.pid, first.port) == (w.PARKED, orphan.pid, port)
        sup.assign((a,))  # the same assignment: kept, still parked
        await trio.testing.wait_all_tasks_blocked()
        assert sup.statuses()[0].state == w.PARKED
        sup.assign((assignment(weights),))  # a new leader wants it awake
        woken = await state_is(sup, w.READY)
        assert (woken.pid, woken.restarts) == (orphan.pid, 0)
    finally:
        if orphan.poll() is None:
            orphan.kill()
            orphan.wait()
