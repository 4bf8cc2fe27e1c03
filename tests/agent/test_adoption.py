"""Run records and adoption: the record format, which records are adopted (a pure judgement),
and the supervisor's decisions about adopted engines, with `sleep` processes standing in for
engines (real processes, since adoption is about real pids; no llmgw engine is started here)."""

from __future__ import annotations

import json
import logging
import os
import signal
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
import trio
import trio.testing

from agent.adoption import (
    RECORD_VERSION,
    Adopted,
    ProcStat,
    Record,
    RunRecords,
    adopt,
    adopt_all,
    fingerprint,
    judge,
    proc_stat,
    read_boot_id,
)
from agent.replica_plan import RESTART_BACKOFF
from agent.replica_supervisor import Supervisor
from agent.weights import WeightsStore
from llmgw.wire import agent_link as w
from testlib.waiting import await_true

BOOT = "3f1c-boot"
DEADLINE_S = 20.0


def assignment(rid: str = "m-1", **kw) -> w.ReplicaAssignment:
    # A worker (rank 1) of a two-node replica: running is ready, no /health to ask.
    fields = {
        "replica_id": rid,
        "model": "m",
        "engine": "sim",
        "api_key": "k-" + rid,
        "nodes": ("n0", "n1"),
        "node_rank": 1,
        "rank0_addr": "127.0.0.1",
        "dist_init_port": 41000,
    }
    return w.ReplicaAssignment(**{**fields, **kw})


def record(**kw) -> Record:
    fields = {
        "replica_id": "m-1",
        "node_rank": 1,
        "model": "m",
        "engine": "sim",
        "pid": 4242,
        "pgid": 4242,
        "start_time": 1000,
        "boot_id": BOOT,
        "port": 41234,
        "gpus": (0, 1),
        "fingerprint": fingerprint(assignment()),
        "started_at": 1.7e9,
    }
    return Record(**{**fields, **kw})


# -- the record ------------------------------------------------------------------------------


def test_a_record_is_written_whole_for_its_owner_only_and_read_back(tmp_path: Path) -> None:
    records = RunRecords(tmp_path / "run")
    r = record()
    records.write(r)
    path = tmp_path / "run" / "m-1-r1.json"
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["m-1-r1.json"]  # no temporary file left
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "run").stat().st_mode) == 0o700
    on_disk = json.loads(path.read_text())
    assert on_disk["version"] == RECORD_VERSION and on_disk["pid"] == 4242 and on_disk["gpus"] == [0, 1]
    assert "k-m-1" not in path.read_text()  # the API key is only in the fingerprint's digest
    assert records.read() == ([r], [])
    records.write(attrs.evolve(r, port=5, events_port=6))  # replaced whole
    assert records.read()[0] == [attrs.evolve(r, port=5, events_port=6)]
    records.remove("m-1", 1)
    assert records.read() == ([], [])
    records.remove("m-1", 1)  # twice is fine


def test_records_that_cannot_be_trusted_are_removed_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    run = tmp_path / "run"
    records = RunRecords(run)
    records.write(record(replica_id="a-1", node_rank=0))
    (run / "a-1-r0.json").rename(run / "b-1-r0.json")  # a record under another member's name
    (run / "garbage-r0.json").write_text("{not json")
    (run / "extra-r0.json").write_text(json.dumps({**json.loads(json.dumps(attrs.asdict(record()))), "x": 1}))
    (run / "old-r0.json").write_text(json.dumps({**attrs.asdict(record(replica_id="old", node_rank=0)), "version": 99}))
    (run / ".m-1-r1.json.tmp").write_text("{")  # an agent killed while writing
    (run / "README").write_text("not a record")
    assert adopt_all(records, boot_id=BOOT) == []
    assert sorted(p.name for p in run.iterdir()) == ["README"]
    reasons = {
        r.llmgw_fields["path"].rsplit("/", 1)[1]: r.llmgw_fields["reason"]
        for r in caplog.records
        if r.getMessage() == "replica_record_unreadable"
    }
    assert reasons["b-1-r0.json"] == "its name does not match its replica"
    assert reasons["garbage-r0.json"].startswith("unreadable")
    assert reasons["extra-r0.json"].startswith("unreadable")
    assert reasons["old-r0.json"] == f"record version 99, this agent reads {RECORD_VERSION}"
    assert reasons[".m-1-r1.json.tmp"] == "an unfinished write"


# -- which records are adopted (pure) --------------------------------------------------------


def test_only_the_very_process_a_record_names_is_adopted() -> None:
    r = record()
    same = ProcStat(state="S", pgrp=4242, start_time=1000)
    assert judge(r, boot_id=BOOT, seen=same) is None
    assert judge(r, boot_id=BOOT, seen=attrs.evolve(same, state="R")) is None
    assert judge(r, boot_id=BOOT, seen=None) == "pid 4242 is gone"
    assert judge(r, boot_id=BOOT, seen=attrs.evolve(same, state="Z")) == "pid 4242 has exited"
    reused = judge(r, boot_id=BOOT, seen=attrs.evolve(same, start_time=2000))
    assert reused == "pid 4242 is another process now (started at tick 2000, the engine at 1000); it is left alone"
    assert "process group 7" in (judge(r, boot_id=BOOT, seen=attrs.evolve(same, pgrp=7)) or "")
    assert judge(r, boot_id="another-boot", seen=same) == "the machine has restarted since it was written"
    assert judge(r, boot_id="", seen=same) == "the machine has restarted since it was written"


def test_proc_stat_reads_past_a_command_name_with_spaces_and_parentheses(tmp_path: Path) -> None:
    (tmp_path / "77").mkdir()
    rest = " ".join(str(n) for n in range(4, 53))  # fields 4..52: ppid=4, pgrp=5, ..., starttime=22
    (tmp_path / "77" / "stat").write_text(f"77 (vllm (worker) 1) S {rest}\n")
    assert proc_stat(77, tmp_path) == ProcStat(state="S", pgrp=5, start_time=22)
    assert proc_stat(78, tmp_path) is None
    me = proc_stat(os.getpid())
    assert me is not None and me.pgrp == os.getpgrp() and me.start_time > 0


# -- adopting a real process -----------------------------------------------------------------


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen]:
    """A process in its own session, as an engine is; not reaped by us until the test ends."""
    proc = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def record_of(proc: subprocess.Popen, **kw) -> Record:
    seen = proc_stat(proc.pid)
    assert seen is not None
    return record(pid=proc.pid, pgid=proc.pid, start_time=seen.start_time, boot_id=read_boot_id(), **kw)


def exited(pid: int) -> bool:
    seen = proc_stat(pid)
    return seen is None or seen.state == "Z"


@pytest.mark.trio
@pytest.mark.parametrize("use_pidfd", [True, False], ids=["pidfd", "proc-poll"])
async def test_an_adopted_process_exit_is_seen_by_every_waiter(sleeper: subprocess.Popen, use_pidfd: bool) -> None:
    engine = adopt(record_of(sleeper), boot_id=read_boot_id(), use_pidfd=use_pidfd, poll_s=0.05)
    assert isinstance(engine, Adopted), engine
    assert engine.watched_by == ("pidfd" if use_pidfd else "/proc")
    woke: list[int] = []

    async def waiter(n: int) -> None:
        await engine.wait()
        woke.append(n)

    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter, 1)
            nursery.start_soon(waiter, 2)
            await trio.testing.wait_all_tasks_blocked()  # both waiting: neither returned for a live engine
            assert woke == [] and not engine.exited
            os.kill(sleeper.pid, signal.SIGKILL)  # a zombie of ours until reaped: exited all the same
    assert sorted(woke) == [1, 2] and engine.exited and engine.returncode is None
    await engine.wait()  # at once, now
    engine.close()


def test_a_pid_reused_by_another_process_is_not_adopted(sleeper: subprocess.Popen) -> None:
    r = record_of(sleeper)
    assert adopt(attrs.evolve(r, start_time=r.start_time - 1), boot_id=read_boot_id()) == (
        f"pid {sleeper.pid} is another process now (started at tick {r.start_time}, the engine at "
        f"{r.start_time - 1}); it is left alone"
    )
    assert sleeper.poll() is None


# -- the supervisor's decisions about adopted engines ----------------------------------------


def supervisor(state_dir: Path, **kw) -> Supervisor:
    return Supervisor(
        state_dir=state_dir,
        weights=WeightsStore(state_dir / "weights"),
        engine_command=lambda name: ("/nonexistent/engine",),
        listen_host="127.0.0.1",
        stop_timeout_s=5.0,
        **kw,
    )


async def sup_reaches(sup: Supervisor, predicate, what: str, *, poll_s: float | None = None):
    """Until `predicate(sup)`: looked at whenever the supervisor's statuses change (and every
    `poll_s` where what is awaited is a log line, which announces nothing)."""
    return await await_true(lambda: predicate(sup), what, changed=sup.changed.next, timeout=DEADLINE_S, poll_s=poll_s)


@pytest.mark.trio
async def test_records_of_gone_or_other_processes_are_dropped_and_nobody_is_signalled(
    tmp_path: Path, sleeper: subprocess.Popen, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    done = subprocess.Popen(["true"])
    done.wait()
    records = RunRecords(tmp_path / "run")
    reused = record_of(sleeper, replica_id="a-1")
    records.write(attrs.evolve(reused, start_time=reused.start_time + 5))  # the pid is someone else's now
    records.write(record(replica_id="b-1", pid=done.pid, pgid=done.pid, boot_id=read_boot_id()))
    sup = supervisor(tmp_path)
    await nursery.start(sup.serve)
    assert sup.statuses() == ()
    assert records.read() == ([], [])
    changed = sup.changed.next()
    sup.assign(())  # a desired state with nothing: there is nothing to stop either
    await trio.testing.wait_all_tasks_blocked()  # whatever the supervisor does about it, done
    assert not changed.is_set() and sup.statuses() == ()  # no member was stopped
    assert sleeper.poll() is None  # not signalled
    stale = {
        r.llmgw_fields["replica"]: r.llmgw_fields["reason"]
        for r in caplog.records
        if r.getMessage() == "replica_record_stale"
    }
    assert stale["a-1"].startswith(f"pid {sleeper.pid} is another process now")
    assert stale["b-1"] == f"pid {done.pid} is gone"


@pytest.mark.trio
@pytest.mark.parametrize("use_pidfd", [True, False], ids=["pidfd", "proc-poll"])
async def test_an_adopted_member_runs_on_until_a_desired_state_then_is_kept_or_stopped(
    tmp_path: Path, sleeper: subprocess.Popen, nursery: trio.Nursery, use_pidfd: bool
) -> None:
    a = assignment()
    RunRecords(tmp_path / "run").write(record_of(sleeper, fingerprint=fingerprint(a)))
    sup = supervisor(tmp_path, use_pidfd=use_pidfd)
    await nursery.start(sup.serve)
    [st] = sup.statuses()
    assert (st.replica_id, st.node_rank, st.state, st.pid, st.restarts) == ("m-1", 1, w.READY, sleeper.pid, 0)
    # The same assignment arrives: kept, nothing signalled, the record stays.
    changed = sup.changed.next()
    sup.assign((a,))
    await trio.testing.wait_all_tasks_blocked()  # whatever the supervisor does about it, done
    assert not changed.is_set() and sup.statuses() == (st,) and sleeper.poll() is None
    assert [r.pid for r in RunRecords(tmp_path / "run").read()[0]] == [sleeper.pid]
    assert f"adopted pid {sleeper.pid} (port 41234)" in sup.tail("m-1")
    # No longer assigned: stopped as any member is (SIGTERM to its group), its record removed.
    sup.assign(())
    await sup_reaches(sup, lambda s: s.statuses() == (), "stopped")
    assert sleeper.wait(DEADLINE_S) == -signal.SIGTERM
    assert RunRecords(tmp_path / "run").read() == ([], [])
    assert f"stopped: the engine (pid {sleeper.pid}, adopted) exited; its exit status went to its parent" in sup.tail(
        "m-1"
    )


@pytest.mark.trio
async def test_an_adopted_member_assigned_differently_is_stopped_before_its_successor_starts(
    tmp_path: Path, sleeper: subprocess.Popen, nursery: trio.Nursery
) -> None:
    a = assignment()
    RunRecords(tmp_path / "run").write(record_of(sleeper, fingerprint=fingerprint(a), gpus=(0,)))
    sup = supervisor(tmp_path, gpus=lambda: (0,))
    await nursery.start(sup.serve)
    changed = attrs.evolve(a, args=("--other",), gpus=1)
    sup.assign((changed,))
    # The successor waits for the adopted engine to be gone (its port, its GPU, its log), then
    # starts the ordinary way (here an engine that does not exist: it fails to start).
    successor = await sup_reaches(
        sup, lambda s: (x := s.statuses()) and x[0].state in (w.RESTARTING, w.FAILED) and x[0], "successor started"
    )
    assert sleeper.poll() == -signal.SIGTERM
    assert successor.pid == 0 and "cannot run /nonexistent/engine" in sup.tail("m-1")


@pytest.mark.trio
async def test_an_adopted_worker_that_exits_before_any_desired_state_waits_for_its_assignment(
    tmp_path: Path, sleeper: subprocess.Popen, nursery: trio.Nursery
) -> None:
    a = assignment()
    RunRecords(tmp_path / "run").write(record_of(sleeper, fingerprint=fingerprint(a)))
    sup = supervisor(tmp_path, backoff=attrs.evolve(RESTART_BACKOFF, first_s=0))  # the delay at once: waited for below
    await nursery.start(sup.serve)
    os.kill(sleeper.pid, signal.SIGKILL)
    restarting = await sup_reaches(
        sup, lambda s: (x := s.statuses()) and x[0].state == w.RESTARTING and x[0], "exit seen"
    )
    assert restarting.restarts == 1 and restarting.pid == 0
    assert restarting.detail.startswith(f"the engine (pid {sleeper.pid}, adopted) exited; its exit status went to")
    changed = sup.changed.next()
    await trio.testing.wait_all_tasks_blocked()  # past the restart delay, every task waiting again
    assert not changed.is_set()  # nothing started without the assignment
    assert sup.statuses()[0].state == w.RESTARTING and "starting sim" not in sup.tail("m-1")
    sup.assign((a,))
    started = lambda s: "cannot run /nonexistent/engine" in s.tail("m-1")  # noqa: E731
    await sup_reaches(sup, started, "a fresh start, the ordinary way", poll_s=0.05)
