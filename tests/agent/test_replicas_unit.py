"""The supervisor's decisions without engines: restart policy, plan, state table, log files, and
members that cannot start, on trio's MockClock."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import attrs
import pytest
import trio
import trio.testing

from agent.adoption import fingerprint
from agent.engines import Engines, EngineUnavailable
from agent.replica_logs import EngineLog, tail_files, tail_replica
from agent.replica_plan import RESTART_BACKOFF, TRANSITIONS, Plan, describe_exit, key_of, plan
from agent.replica_supervisor import Supervisor
from agent.weights import WeightsStore
from llmgw.backoff import Backoff, Failures
from llmgw.errors import UsageError
from llmgw.wakeup import Wakeup
from llmgw.wire import agent_link as w
from llmgw.wire.convert import decode, encode
from testlib.waiting import await_true


def assignment(rid: str = "m-1", **kw) -> w.ReplicaAssignment:
    fields = {"replica_id": rid, "model": "m", "engine": "sim", "api_key": "k-" + rid, "nodes": ("n1",)}
    return w.ReplicaAssignment(**{**fields, **kw})


# -- restart policy --------------------------------------------------------------------------


def exits_at(times: list[float], policy: Backoff = RESTART_BACKOFF) -> Failures:
    exits = Failures(policy)
    for t in times:
        exits.failed(t)
    return exits


def test_backoff_doubles_with_recent_exits_up_to_the_cap() -> None:
    policy = attrs.evolve(RESTART_BACKOFF, give_up_after=10)
    delays = [exits_at([float(i) for i in range(n)], policy).delay() for n in range(1, 10)]
    assert delays == [1, 2, 4, 8, 16, 32, 60, 60, 60]


def test_too_many_quick_exits_give_up_and_old_ones_are_forgotten() -> None:
    quick = [0.0, 10.0, 20.0, 30.0, 40.0]
    assert exits_at(quick).exhausted  # 5 within 10 min: the member fails
    assert not exits_at(quick[:4]).exhausted and exits_at(quick[:4]).delay() == 8
    # The same five exits spread over hours: each one is a first failure again.
    spread = exits_at([0.0, 3600.0, 7200.0, 10800.0, 14400.0])
    assert not spread.exhausted and spread.count == 1 and spread.delay() == RESTART_BACKOFF.first_s


def test_exit_descriptions() -> None:
    assert describe_exit(3) == "the engine exited with status 3"
    assert describe_exit(-9) == "the engine was killed by SIGKILL"
    assert describe_exit(None) == "the engine could not be started"


# -- plan ------------------------------------------------------------------------------------


def test_plan_keeps_identical_assignments_and_replaces_changed_ones() -> None:
    a, b, c = assignment("a-1"), assignment("b-1"), assignment("c-1")
    running = {key_of(a): fingerprint(a), key_of(b): fingerprint(b)}
    b2 = attrs.evolve(b, api_key="new")
    p = plan(running, [a, b2, c])
    assert p.start == (b2, c)
    assert p.stop == (key_of(b),)
    assert p.keep == (a,)
    assert plan(running, [a, b]) == Plan(keep=(a, b))
    assert plan(running, []).stop == (key_of(a), key_of(b))


def test_an_adopted_engine_is_kept_when_its_assignment_is_the_same_and_stopped_otherwise() -> None:
    # What an adopted member runs is known only by the fingerprint its record holds.
    a = assignment("a-1", args=("--x",), gpus=1, weights=w.WeightsSource(url="https://h/m.gguf", sha256="0" * 64))
    recorded = {key_of(a): fingerprint(a)}
    # The same assignment, even decoded from the wire by a control plane that came back: kept.
    again = decode(encode(w.DesiredState(generation=7, replicas=(a,))), w.ServerMessage).replicas
    assert plan(recorded, again) == Plan(keep=(a,))
    # Changed in any field (a new key, other args, another rank-0 address): stopped and started anew.
    for changed in (
        attrs.evolve(a, api_key="rotated"),
        attrs.evolve(a, args=()),
        attrs.evolve(a, rank0_addr="10.0.0.9"),
        attrs.evolve(a, weights=attrs.evolve(a.weights, sha256="1" * 64)),
    ):
        assert plan(recorded, [changed]) == Plan(start=(changed,), stop=(key_of(a),)), changed
    # No longer assigned: stopped; another rank of the same replica is another member.
    assert plan(recorded, []) == Plan(stop=(key_of(a),))
    other_rank = attrs.evolve(a, node_rank=1)
    assert plan(recorded, [other_rank]) == Plan(start=(other_rank,), stop=(key_of(a),))


def test_a_fingerprint_names_the_whole_assignment_and_ignores_fields_left_at_their_defaults() -> None:
    a = assignment()
    assert fingerprint(a) == fingerprint(assignment()) and len(fingerprint(a)) == 64
    assert fingerprint(a) != fingerprint(attrs.evolve(a, api_key="other"))
    assert fingerprint(a) != fingerprint(attrs.evolve(a, nodes=("n1", "n2")))
    assert "k-m-1" not in fingerprint(a)  # a digest, not the key
    # Only fields that differ from their defaults count, so a wire field added later with a
    # default does not change the fingerprint of what an older agent recorded.
    explicit = {"replica_id": "m-1", "model": "m", "engine": "sim", "api_key": "k-m-1", "nodes": ["n1"]}
    text = json.dumps(explicit, sort_keys=True, separators=(",", ":"))
    assert fingerprint(a) == hashlib.sha256(text.encode()).hexdigest()


def test_every_state_is_in_the_table_and_only_stopping_reaches_stopped() -> None:
    assert set(TRANSITIONS) == set(w.REPLICA_STATES)
    assert [s for s, nxt in TRANSITIONS.items() if w.STOPPED in nxt] == [w.STOPPING]
    assert all(w.STOPPING in nxt for s, nxt in TRANSITIONS.items() if s not in (w.STOPPING, w.STOPPED))


# -- log files -------------------------------------------------------------------------------


def test_logs_rotate_by_size_keep_n_files_and_tail_across_them(tmp_path: Path) -> None:
    path = tmp_path / "logs" / "m-1-r0.log"
    log = EngineLog(path, max_bytes=100, files=3)
    for i in range(100):
        log.write(f"line {i:03d}\n".encode())  # 9 bytes each: 12 lines pass 100 bytes
        if log.too_big():
            log.rotate()
    log.close()
    assert sorted(p.name for p in path.parent.iterdir()) == ["m-1-r0.log", "m-1-r0.log.1", "m-1-r0.log.2"]
    assert all(p.stat().st_size <= 108 for p in path.parent.iterdir())
    assert tail_files(path, 3).splitlines() == ["line 097", "line 098", "line 099"]
    # More lines than the current file holds come from the older files, in order.
    assert tail_files(path, 20).splitlines() == [f"line {i:03d}" for i in range(80, 100)]
    # Older than the kept files: gone.
    assert tail_files(path, 1000).splitlines()[0] == "line 072"


def test_log_files_are_the_agents_only_even_where_an_earlier_agent_left_them_open(tmp_path: Path) -> None:
    # Engines print what they were given (SGLang its whole configuration, key included).
    logs = tmp_path / "logs"
    logs.mkdir(mode=0o755)
    os.chmod(logs, 0o755)
    (logs / "m-1-r0.log").write_text("old\n")
    os.chmod(logs / "m-1-r0.log", 0o644)
    log = EngineLog(logs / "m-1-r0.log", max_bytes=1, files=2)
    log.write(b"more\n")
    log.rotate()
    log.close()
    fresh = EngineLog(logs / "n-1-r0.log")
    fresh.close()
    modes = {p.name: p.stat().st_mode & 0o777 for p in (logs, *logs.iterdir())}
    assert modes == {"logs": 0o700, "m-1-r0.log": 0o600, "m-1-r0.log.1": 0o600, "n-1-r0.log": 0o600}


def test_an_engine_writing_its_own_log_keeps_writing_at_the_start_of_the_rotated_file(tmp_path: Path) -> None:
    # The engine holds the file open with O_APPEND: after copy and truncate, its next line lands at
    # offset 0 of the emptied file (no hole of NUL bytes where the old end was), and nothing it
    # wrote before the rotation is lost.
    path = tmp_path / "m-1-r0.log"
    log = EngineLog(path, max_bytes=1000, files=2)
    script = "import sys\nfor i in range(200): print(f'engine line {i:03d}')\nsys.stdout.flush()\ninput()\n"
    script += "for i in range(200, 210): print(f'engine line {i:03d}')\n"
    engine = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=log.fileno(), stderr=log.fileno()
    )
    try:
        deadline = time.monotonic() + 20
        while path.stat().st_size < 200 * 16 and time.monotonic() < deadline:
            time.sleep(0.01)
        log.note("a line of the agent's")
        assert log.too_big()
        log.rotate()
        assert path.stat().st_size == 0
        engine.communicate(b"\n", timeout=20)
    finally:
        engine.kill()
        engine.wait()
    log.close()
    older = (tmp_path / "m-1-r0.log.1").read_text().splitlines()
    assert older[:200] == [f"engine line {i:03d}" for i in range(200)] and "a line of the agent's" in older[200]
    assert path.read_bytes() == b"".join(f"engine line {i:03d}\n".encode() for i in range(200, 210))


@pytest.mark.trio
async def test_rotation_runs_while_the_engine_runs(tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    path = tmp_path / "m-1-r0.log"
    log = EngineLog(path, max_bytes=50, files=2)
    async with trio.open_nursery() as nursery:
        await nursery.start(log.serve_rotation, 5.0)
        log.write(b"x" * 80 + b"\n")
        await trio.sleep(4.9)
        assert path.stat().st_size == 81  # not at the write: at the next check
        await trio.sleep(0.2)  # the check at 5 s has handed the copy to a thread
        deadline = time.monotonic() + 10
        while path.stat().st_size and time.monotonic() < deadline:
            await trio.sleep(0)  # runnable, so the clock stays put while the thread copies
        assert (tmp_path / "m-1-r0.log.1").read_bytes() == b"x" * 80 + b"\n"
        nursery.cancel_scope.cancel()
    log.close()


def test_tail_of_a_replica_refuses_names_that_leave_the_log_directory(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    EngineLog(logs / "m-1-r0.log").write(b"hello\n")
    EngineLog(logs / "m-1-r0-r0.log").write(b"another replica\n")
    assert tail_replica(logs, "m-1") == "hello"
    assert tail_replica(logs, "nothing-here") == ""
    for hostile in ("../secret", "m-1/../../x", "*", ""):
        with pytest.raises(UsageError):
            tail_replica(logs, hostile)


# -- members that cannot start (MockClock) ---------------------------------------------------


def supervisor(tmp_path: Path, engine_command, **kw) -> Supervisor:
    return Supervisor(
        state_dir=tmp_path,
        weights=WeightsStore(tmp_path / "weights"),
        engine_command=engine_command,
        listen_host="127.0.0.1",
        **kw,
    )


async def wait_state(sup: Supervisor, state: str | set[str], rid: str = "m-1") -> w.ReplicaStatus:
    states = {state} if isinstance(state, str) else state
    with trio.fail_after(20):
        while True:
            found = [s for s in sup.statuses() if s.replica_id == rid]
            if found and found[0].state in states:
                return found[0]
            await sup.wait_changed()


@pytest.mark.trio
async def test_an_engine_that_cannot_run_is_retried_with_backoff_then_failed(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    # Real time (starting a process uses a thread, which a MockClock would jump over), short delays.
    sup = supervisor(
        tmp_path,
        lambda name: ("/nonexistent/engine",),
        backoff=attrs.evolve(RESTART_BACKOFF, first_s=0.01, give_up_after=4, window_s=600),
    )
    seen: list[w.ReplicaStatus] = []
    reported = Wakeup()

    async def record(message: w.ReplicasChanged) -> bool:
        seen.extend(message.replicas)
        reported.fire()
        return True

    await nursery.start(sup.serve)
    await nursery.start(sup.serve_reports, record)
    sup.assign((assignment(),))
    failed = await wait_state(sup, w.FAILED)
    assert "could not be started, 4 times within 600 s" in failed.detail
    assert "cannot run /nonexistent/engine" in failed.detail  # the agent's own line in the engine log
    assert failed.restarts == 3
    await await_true(lambda: failed in seen, "the failure reported", changed=reported.next, timeout=10)
    assert [s.restarts for s in seen if s.state == w.RESTARTING] == [1, 2, 3]
    assert [s.detail.split(".")[0] for s in seen if s.state == w.RESTARTING] == [
        "the engine could not be started; restarting in 0",
        "the engine could not be started; restarting in 0",
        "the engine could not be started; restarting in 0",
    ]
    # Given again unchanged, a failed member stays failed; changed, it starts over.
    sup.assign((assignment(),))
    assert sup.statuses()[0].state == w.FAILED
    sup.assign((assignment(args=("--x",)),))
    assert sup.statuses()[0].state == w.FETCHING and sup.statuses()[0].restarts == 0


@pytest.mark.trio
async def test_an_engine_not_installed_waits_and_a_broken_one_is_failed_with_its_reason(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    engines = Engines()
    sup = supervisor(tmp_path, engines.command_for)
    await nursery.start(sup.serve)
    sup.assign((assignment(engine="llamacpp", weights=w.WeightsSource(path=str(tmp_path))),))
    waiting = await wait_state(sup, w.FETCHING)
    with trio.fail_after(60):
        while "not installed on this node yet" not in sup.statuses()[0].detail:
            await sup.wait_changed()
    engines.statuses["llamacpp"] = w.EngineStatus(
        name="llamacpp", version="b1", ok=False, detail="illegal instruction (needs AVX2)"
    )
    failed = await wait_state(sup, w.FAILED)
    assert failed.detail == "engine llamacpp does not run on this node: illegal instruction (needs AVX2)"
    assert waiting.pid == 0 and failed.pid == 0
    with pytest.raises(EngineUnavailable):
        engines.command_for("vllm")


@pytest.mark.trio
async def test_too_few_gpus_fail_with_the_count(tmp_path: Path, nursery: trio.Nursery) -> None:
    sup = supervisor(tmp_path, lambda name: ("/nonexistent",), gpus=lambda: (0, 1))
    await nursery.start(sup.serve)
    sup.assign((assignment("a-1", gpus=2),))
    await wait_state(sup, {w.STARTING, w.RESTARTING}, "a-1")  # it holds both GPUs (and keeps failing to start)
    sup.assign((assignment("a-1", gpus=2), assignment("b-1", gpus=1)))
    failed = await wait_state(sup, w.FAILED, "b-1")
    assert failed.detail == "needs 1 GPUs; 0 of this node's 2 are free"


@pytest.mark.trio
async def test_hostile_names_fail_the_member_and_write_nothing(tmp_path: Path, nursery: trio.Nursery) -> None:
    sup = supervisor(tmp_path / "state", lambda name: ("/nonexistent",))
    await nursery.start(sup.serve)
    sup.assign((assignment("../../evil"), assignment("m-1", model="../../etc/passwd")))
    evil = await wait_state(sup, w.FAILED, "../../evil")
    model = await wait_state(sup, w.FAILED, "m-1")
    assert "replica id '../../evil' is not a plain name" in evil.detail
    assert "model name '../../etc/passwd' is not a plain name" in model.detail
    assert list(tmp_path.iterdir()) == []  # not even the state directory
