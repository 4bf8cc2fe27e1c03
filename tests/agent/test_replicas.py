"""The supervisor with real sim engines on loopback: start, health, restart after a kill, adopt
unchanged assignments, stop with SIGTERM, a two-node replica whose members fail together, and
an engine left running by an earlier agent adopted, probed and restarted.

Two `Supervisor`s stand in for two nodes. Every wait is bounded; a failed wait shows the
statuses and the engine log tails.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import signal
import subprocess
import time
from pathlib import Path

import attrs
import pytest
import trio
import trio.testing

from agent.adoption import Record, RunRecords, fingerprint, proc_stat, read_boot_id
from agent.node_address import NodeAddress
from agent.replica_logs import EngineLog, log_path
from agent.replica_plan import RESTART_BACKOFF
from agent.replica_supervisor import Supervisor
from agent.weights import WeightsStore
from llmgw.log import EventFormatter
from llmgw.selfexec import llmgw_command
from llmgw.wire import agent_link as w
from llmgw.wire.convert import decode, encode
from testlib.cluster import free_port
from testlib.exposure import cmdlines_holding, listening
from testlib.proc import llmgw_env
from testlib.waiting import await_true

pytestmark = pytest.mark.trio

DEADLINE_S = 30.0
API_KEY = "sk-replica-secret-1234"


def make_supervisor(state_dir: Path, **kw) -> Supervisor:
    options = {
        "engine_command": lambda name: llmgw_command(),
        "env": llmgw_env(),  # the engine is `python -m llmgw`: it needs this process's sys.path
        "listen_host": "127.0.0.1",
        "stop_timeout_s": 5.0,
        "health_interval_s": 0.1,
    }
    return Supervisor(state_dir=state_dir, weights=WeightsStore(state_dir / "weights"), **{**options, **kw})


def sim(rid: str = "m-1", **kw) -> w.ReplicaAssignment:
    fields = {"replica_id": rid, "model": "m", "engine": "sim", "api_key": API_KEY, "nodes": ("n1",)}
    return w.ReplicaAssignment(**{**fields, **kw})


def status(sup: Supervisor, rid: str = "m-1") -> w.ReplicaStatus | None:
    return next((s for s in sup.statuses() if s.replica_id == rid), None)


async def sup_reaches(sup: Supervisor, predicate, what: str, *others: Supervisor, poll_s: float | None = None):
    """Until `predicate(sup)` is truthy, which is returned: looked at whenever the statuses of `sup`
    or `others` change (and every `poll_s` where it reads the kernel, which announces nothing).
    A failed wait shows each one's statuses and engine log tails."""

    def report() -> str:
        lines = []
        for s in (sup, *others):
            lines.append(repr(s.statuses()))
            lines.extend(s.tail(st.replica_id, 30) for st in s.statuses())
        return "\n".join(lines)

    changed = [s.changed.next for s in (sup, *others)]
    return await await_true(
        lambda: predicate(sup), what, changed=changed, timeout=DEADLINE_S, poll_s=poll_s, report=report
    )


def in_state(state: str, rid: str = "m-1"):
    def check(sup: Supervisor) -> w.ReplicaStatus | None:
        st = status(sup, rid)
        return st if st is not None and st.state == state else None

    return check


def post(port: int, path: str, body: dict, key: str | None, host: str = "127.0.0.1") -> tuple[int, dict]:
    conn = http.client.HTTPConnection(host, port, timeout=10)
    headers = {"content-type": "application/json"}
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    try:
        conn.request("POST", path, json.dumps(body), headers)
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"null")
    finally:
        conn.close()


def gone(pid: int) -> bool:
    """No such process, or a zombie (killed; an orphan waits for init to reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


async def test_a_replica_starts_serves_with_its_key_restarts_after_a_kill_and_stops_with_sigterm(
    tmp_path: Path, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    sup = make_supervisor(tmp_path, backoff=attrs.evolve(RESTART_BACKOFF, first_s=0.2))
    seen: list[w.ReplicaStatus] = []

    async def record(message: w.ReplicasChanged) -> bool:
        seen.extend(message.replicas)
        return True

    await nursery.start(sup.serve)
    await nursery.start(sup.serve_reports, record)
    sup.assign((sim(),))
    ready = await sup_reaches(sup, in_state(w.READY), "ready")
    assert ready.port > 0 and ready.pid > 0 and ready.restarts == 0

    body = {"model": "m", "prompt": "hello", "max_tokens": 4}
    code, answer = await trio.to_thread.run_sync(post, ready.port, "/v1/completions", body, API_KEY)
    assert code == 200 and answer["choices"][0]["text"]
    code, answer = await trio.to_thread.run_sync(post, ready.port, "/v1/completions", body, None)
    assert code == 401

    # The same assignment again, even rebuilt from the wire (a control plane that came back): nothing restarts.
    sup.assign((sim(),))
    sup.assign(decode(encode(w.DesiredState(generation=2, replicas=(sim(),))), w.ServerMessage).replicas)
    assert status(sup) == ready

    os.kill(ready.pid, signal.SIGKILL)
    again = await sup_reaches(
        sup, lambda s: (st := status(s)) and st.state == w.READY and st.restarts == 1 and st, "ready again"
    )
    assert again.pid != ready.pid and gone(ready.pid)
    restarting = next(s for s in seen if s.state == w.RESTARTING)
    assert restarting.detail.startswith("the engine was killed by SIGKILL; restarting in 0.2 s.")
    assert "sim_serving" in restarting.detail  # the engine's own last lines
    assert restarting.pid == 0 and restarting.restarts == 1

    sup.assign(())
    await sup_reaches(sup, lambda s: s.statuses() == (), "stopped")
    assert gone(again.pid)
    assert any(s.state == w.STOPPING for s in seen)
    log = sup.tail("m-1", 10)
    assert "sim_stopping signal=SIGTERM" in log  # the engine heard SIGTERM, not SIGKILL
    assert "stopped: the engine exited with status 0, " in log

    # No secret in the agent's log (as its formatter renders it) or the engine's.
    formatter = EventFormatter("json")
    agent_log = "\n".join(formatter.format(r) for r in caplog.records)
    engine_logs = "".join(p.read_text() for p in (tmp_path / "logs").iterdir())
    assert API_KEY not in agent_log and API_KEY not in engine_logs
    key_file = str(tmp_path / "keys" / "m-1-r0" / "api-key")
    assert f'"files": ["{key_file}"]' in engine_logs  # the command is shown: its key file, not its key
    starting = next(r.llmgw_fields for r in caplog.records if r.getMessage() == "replica_starting")
    assert starting["files"] == [key_file] and "--api-key-file" in starting["argv"]
    assert not (tmp_path / "keys" / "m-1-r0").exists()  # removed with the engine


def mode(path: Path) -> int:
    return path.lstat().st_mode & 0o777


async def test_the_engine_listens_on_the_nodes_address_only_and_its_key_is_in_a_private_file(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    # 127.0.0.9 stands for the node's address on the link: the engine must not listen elsewhere.
    sup = make_supervisor(tmp_path, listen_host=NodeAddress("127.0.0.9"))
    await nursery.start(sup.serve)
    sup.assign((sim(),))
    ready = await sup_reaches(sup, in_state(w.READY), "ready")
    assert listening(ready.pid) == [("127.0.0.9", ready.port)]
    body = {"model": "m", "prompt": "hello", "max_tokens": 2}
    assert (await trio.to_thread.run_sync(post, ready.port, "/v1/completions", body, API_KEY, "127.0.0.9"))[0] == 200
    assert (await trio.to_thread.run_sync(post, ready.port, "/v1/completions", body, None, "127.0.0.9"))[0] == 401
    with pytest.raises(ConnectionRefusedError):  # the same port on another address of the machine
        await trio.to_thread.run_sync(post, ready.port, "/v1/completions", body, API_KEY, "127.0.0.1")

    # The key is in no process's argv, not in the engine's environment: in a file only root reads.
    assert cmdlines_holding(API_KEY) == []
    environ = Path(f"/proc/{ready.pid}/environ").read_bytes()
    assert API_KEY.encode() not in environ and b"LLMGW_SIM_API_KEY" not in environ
    key_file = tmp_path / "keys" / "m-1-r0" / "api-key"
    assert key_file.read_text() == API_KEY + "\n"
    assert (mode(tmp_path / "keys"), mode(key_file.parent), mode(key_file)) == (0o700, 0o700, 0o600)
    record = json.loads((tmp_path / "run" / "m-1-r0.json").read_text())
    assert (record["host"], record["port"]) == ("127.0.0.9", ready.port)  # what an adopting agent probes

    sup.assign(())
    await sup_reaches(sup, lambda s: s.statuses() == (), "stopped")
    assert not key_file.parent.exists() and gone(ready.pid)


async def test_an_engine_is_started_again_on_the_links_new_address_only_once_its_own_is_gone(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    address = NodeAddress("127.0.0.9")
    present = {"127.0.0.9": True}  # stands for the machine's addresses: 127.0.0.0/8 never leaves lo
    sup = make_supervisor(
        tmp_path, listen_host=address, address_present=lambda host: present.get(host, True), health_interval_s=0.1
    )
    await nursery.start(sup.serve)
    sup.assign((sim(),))
    ready = await sup_reaches(sup, in_state(w.READY), "ready")

    # The link comes back from another address while the engine's is still here: it is left alone.
    address.set("127.0.0.10")
    await trio.testing.wait_all_tasks_blocked()
    assert status(sup) == ready and listening(ready.pid) == [("127.0.0.9", ready.port)]

    # Its address leaves the machine: it is stopped and started again where the link now comes from.
    present["127.0.0.9"] = False
    address.set("127.0.0.11")
    again = await sup_reaches(
        sup, lambda s: (st := status(s)) and st.state == w.READY and st.restarts == 1 and st, "ready again"
    )
    assert listening(again.pid) == [("127.0.0.11", again.port)] and gone(ready.pid)
    assert "its address 127.0.0.9 is no longer one of this machine's" in sup.tail("m-1", 50)
    body = {"model": "m", "prompt": "hello", "max_tokens": 2}
    assert (await trio.to_thread.run_sync(post, again.port, "/v1/completions", body, API_KEY, "127.0.0.11"))[0] == 200


async def test_an_engine_that_stops_answering_after_ready_is_restarted(
    tmp_path: Path, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    # A real hang: the engine process is stopped (SIGSTOP), so it holds its port and answers nothing.
    caplog.set_level(logging.INFO)
    sup = make_supervisor(tmp_path, backoff=attrs.evolve(RESTART_BACKOFF, first_s=0.2), liveness=(0.2, 0.3, 3))
    sup.life.watch.stop_timeout_s = 1.0  # deaf to SIGTERM while stopped: killed after this
    await nursery.start(sup.serve)
    sup.assign((sim(),))
    ready = await sup_reaches(sup, in_state(w.READY), "ready")
    os.kill(ready.pid, signal.SIGSTOP)
    try:
        again = await sup_reaches(
            sup, lambda s: (st := status(s)) and st.state == w.READY and st.pid != ready.pid and st, "ready again"
        )
    finally:
        if not gone(ready.pid):
            os.kill(ready.pid, signal.SIGKILL)
    assert again.restarts == 1
    assert gone(ready.pid)
    assert "times in a row" in sup.tail("m-1") and "the engine is stuck" in sup.tail("m-1")
    events = [json.loads(EventFormatter("json").format(r)) for r in caplog.records]
    stuck = [e for e in events if e.get("event") == "replica_unresponsive"]
    assert stuck and stuck[0]["failures"] == 3 and stuck[0]["last"] == "no answer"


async def test_a_slow_answer_now_and_then_is_not_a_hang(tmp_path: Path, nursery: trio.Nursery) -> None:
    # A pause of 0.5 s costs at most two probes (0.3 s timeout, 0.2 s apart); the limit is four
    # in a row, so there is room for a slow test machine and nothing is restarted.
    sup = make_supervisor(tmp_path, liveness=(0.2, 0.3, 4))
    await nursery.start(sup.serve)
    sup.assign((sim(),))
    ready = await sup_reaches(sup, in_state(w.READY), "ready")
    os.kill(ready.pid, signal.SIGSTOP)
    await trio.sleep(0.5)  # the pause itself: a real process, stopped for real time
    os.kill(ready.pid, signal.SIGCONT)
    answered = sup.answered_probes("m-1")
    # Three probes answered after it (what a restart would have cut short), then nothing was restarted.
    await await_true(lambda: sup.answered_probes("m-1") >= answered + 3, "3 probes answered", changed=sup.probed.next)
    st = status(sup)
    assert st.state == w.READY and st.pid == ready.pid and st.restarts == 0


async def test_a_changed_assignment_restarts_its_engine(tmp_path: Path, nursery: trio.Nursery) -> None:
    sup = make_supervisor(tmp_path)
    await nursery.start(sup.serve)
    sup.assign((sim(), sim("other-1")))
    first = await sup_reaches(sup, in_state(w.READY), "ready")
    other = await sup_reaches(sup, in_state(w.READY, "other-1"), "other ready")
    sup.assign((sim(api_key="sk-rotated"), sim("other-1")))
    second = await sup_reaches(
        sup, lambda s: (st := status(s)) and st.state == w.READY and st.pid != first.pid and st, "new"
    )
    assert gone(first.pid)
    assert status(sup, "other-1") == other  # untouched
    code, _ = await trio.to_thread.run_sync(post, second.port, "/v1/models", {}, "sk-rotated")
    assert code == 405  # GET only; authorised, so the new key is the one in use


async def test_a_two_node_replica_is_ready_only_with_its_worker_and_fails_as_a_whole(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    backoff = attrs.evolve(RESTART_BACKOFF, first_s=0.2)
    node1 = make_supervisor(tmp_path / "n1", backoff=backoff)
    node2 = make_supervisor(tmp_path / "n2", backoff=backoff)
    await nursery.start(node1.serve)
    await nursery.start(node2.serve)
    base = sim(nodes=("n1", "n2"), rank0_addr="127.0.0.1", dist_init_port=free_port())
    node1.assign((base,))
    # Rank 0 listens (its health says 503 while it waits) but is not ready without its worker.
    waiting = await sup_reaches(node1, lambda s: (st := status(s)) and st.port and st, "rank 0 listening", node2)
    assert waiting.state == w.STARTING
    node2.assign((attrs.evolve(base, node_rank=1),))
    rank0 = await sup_reaches(node1, in_state(w.READY), "rank 0 ready", node2)
    worker = await sup_reaches(node2, in_state(w.READY), "worker running", node1)
    assert worker.port == 0 and worker.node_rank == 1

    os.kill(worker.pid, signal.SIGKILL)
    # Rank 0 loses its member and exits 3; the sim says why in its log, the status carries it.
    lost = await sup_reaches(
        node1, lambda s: (st := status(s)) and st.restarts >= 1 and st, "rank 0 restarting after the worker died", node2
    )
    assert lost.pid != rank0.pid
    log = node1.tail("m-1", 200)
    assert "worker_lost" in log and "the engine exited with status 3" in log
    # Both come back: the restarted worker joins the restarted rank 0.
    back = await sup_reaches(
        node1, lambda s: (st := status(s)) and st.state == w.READY and st.restarts >= 1 and st, "back", node2
    )
    assert (await sup_reaches(node2, in_state(w.READY), "worker back", node1)).restarts == 1
    assert back.port > 0


def shell_engine(script: str):
    """An engine command that runs `script` (the sim's arguments follow as $1..., unused)."""
    return lambda name: ("/bin/sh", "-c", script, "engine")


def pid_in(path: Path) -> int | None:
    """The pid a shell wrote to `path`, once it has written all of it (the file appears first)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    return int(text) if text.endswith("\n") and text.strip().isdigit() else None


async def test_an_engine_deaf_to_sigterm_is_killed_after_the_deadline_with_its_children(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    child = tmp_path / "child.pid"
    sup = make_supervisor(
        tmp_path,
        engine_command=shell_engine(f"trap '' TERM; sleep 600 & echo $! > {child}; echo up; wait"),
        stop_timeout_s=0.5,
    )
    await nursery.start(sup.serve)
    sup.assign((sim(),))
    started = lambda s: (st := status(s)) and st.pid and pid_in(child) and st  # noqa: E731
    starting = await sup_reaches(sup, started, "started", poll_s=0.05)  # the child's file: nothing announces it
    sleeper = pid_in(child)
    sup.assign(())
    await sup_reaches(sup, lambda s: s.statuses() == (), "stopped")
    assert gone(starting.pid)
    # The whole process group (the kernel's to say: looked at every 50 ms).
    await sup_reaches(sup, lambda s: gone(sleeper), "the engine's child killed too", poll_s=0.05)
    log = sup.tail("m-1", 5)
    assert "still running 0.5 s after SIGTERM: sending SIGKILL" in log
    assert "stopped: the engine was killed by SIGKILL" in log


async def test_what_an_exited_engine_left_behind_is_killed(tmp_path: Path, nursery: trio.Nursery) -> None:
    child = tmp_path / "child.pid"
    sup = make_supervisor(
        tmp_path,
        engine_command=shell_engine(f"sleep 600 & echo $! > {child}; echo 'CUDA out of memory'; exit 7"),
        backoff=attrs.evolve(RESTART_BACKOFF, give_up_after=1),
    )
    await nursery.start(sup.serve)
    sup.assign((sim(),))
    failed = await sup_reaches(sup, in_state(w.FAILED), "failed")
    assert "the engine exited with status 7, 1 times within 600 s" in failed.detail
    assert "CUDA out of memory" in failed.detail
    await sup_reaches(sup, lambda s: pid_in(child) and gone(pid_in(child)), "the engine's child killed", poll_s=0.05)


async def test_cancelling_the_supervisor_stops_every_engine(tmp_path: Path) -> None:
    sup = make_supervisor(tmp_path)
    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(sup.serve)
            sup.assign((sim("a-1"), sim("b-1")))
            a = await sup_reaches(sup, in_state(w.READY, "a-1"), "a ready")
            b = await sup_reaches(sup, in_state(w.READY, "b-1"), "b ready")
            nursery.cancel_scope.cancel()  # the agent stops
    assert gone(a.pid) and gone(b.pid)
    assert "sim_stopping signal=SIGTERM" in sup.tail("a-1") and "sim_stopping signal=SIGTERM" in sup.tail("b-1")


# -- an agent that starts next to an engine an earlier agent left running ---------------------


def sim_assignment() -> w.ReplicaAssignment:
    return w.ReplicaAssignment(replica_id="m-1", model="m", engine="sim", api_key=API_KEY, nodes=("n1",))


def start_orphan_sim(state_dir: Path, port: int) -> subprocess.Popen:
    """A sim started as an agent starts one (own session, output on its log file), and its record:
    what an agent killed with SIGKILL leaves behind."""
    engine_log = EngineLog(log_path(state_dir / "logs", "m-1", 0))
    argv = [*llmgw_command(), "engine", "sim", "--model", "m", "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(
        argv,
        env=llmgw_env({"LLMGW_SIM_API_KEY": API_KEY}),
        stdin=subprocess.DEVNULL,
        stdout=engine_log.fileno(),
        stderr=engine_log.fileno(),
        start_new_session=True,
    )
    engine_log.close()
    seen = proc_stat(proc.pid)
    assert seen is not None
    RunRecords(state_dir / "run").write(
        Record(
            replica_id="m-1",
            node_rank=0,
            model="m",
            engine="sim",
            pid=proc.pid,
            pgid=proc.pid,
            start_time=seen.start_time,
            boot_id=read_boot_id(),
            port=port,
            fingerprint=fingerprint(sim_assignment()),
            started_at=time.time(),
        )
    )
    return proc


def serves(port: int) -> bool:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except OSError:
        return False


async def test_an_adopted_engine_is_ready_in_the_first_report_probed_and_restarted_when_it_hangs(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    port = free_port()
    orphan = start_orphan_sim(tmp_path, port)
    try:
        with trio.fail_after(30):
            while not await trio.to_thread.run_sync(serves, port):
                await trio.sleep(0.05)
        sup = make_supervisor(tmp_path, backoff=attrs.evolve(RESTART_BACKOFF, first_s=0.2), liveness=(0.2, 0.3, 3))
        sup.life.watch.stop_timeout_s = 1.0
        await nursery.start(sup.serve)
        # Started, the supervisor has probed it: the hello would say ready, with its pid and port.
        [first] = sup.statuses()
        assert (first.state, first.pid, first.port, first.restarts) == (w.READY, orphan.pid, port, 0)
        sup.assign((sim_assignment(),))
        code, _ = await trio.to_thread.run_sync(post, port, "/v1/completions", {"model": "m", "prompt": "x"}, API_KEY)
        assert code == 200 and status(sup) == first

        # Liveness holds for it too: stopped (SIGSTOP), it is killed and a fresh engine is started
        # the ordinary way, a child of this supervisor, on the same port.
        os.kill(orphan.pid, signal.SIGSTOP)
        again = await sup_reaches(
            sup, lambda s: (st := status(s)) and st.state == w.READY and st.pid != orphan.pid and st, "a new engine"
        )
        assert orphan.wait(10) == -signal.SIGKILL  # deaf to SIGTERM while stopped
        assert (again.restarts, again.port) == (1, port)
        log = sup.tail("m-1", 200)
        assert "the engine is stuck" in log and f"the engine (pid {orphan.pid}, adopted) exited" in log
        [record] = RunRecords(tmp_path / "run").read()[0]
        assert (record.pid, record.port, record.fingerprint) == (again.pid, port, fingerprint(sim_assignment()))
    finally:
        if orphan.poll() is None:
            orphan.kill()
            orphan.wait()
