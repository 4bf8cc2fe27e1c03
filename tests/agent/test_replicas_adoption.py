"""A control plane restart loses nothing: an in-process control plane places a sim replica on a
real agent; the control plane goes away and comes back on the same port; the agent kept the
engine running and the same replica is adopted, not restarted (same pid, restarts 0)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio
import trio.testing

from agent.main import run_agent
from llmgw.config import Model
from llmgw.server.app import ControlPlane
from llmgw.server.errors import UnknownReplica
from llmgw.wire import agent_link as w
from testlib.controlplane import local
from testlib.waiting import await_true


def reported(plane: ControlPlane) -> w.ReplicaStatus | None:
    node = plane.registry.nodes.get("node-a")
    return next(iter(node.replicas), None) if node and node.replicas else None


@pytest.mark.trio
async def test_a_control_plane_restart_adopts_the_running_replica(
    tmp_path: Path, nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = local(tmp_path, monkeypatch, (Model(name="chat", engine="sim", replicas=1),))
    config, state = cluster.config, cluster.state

    async def control_plane(*, task_status=trio.TASK_STATUS_IGNORED) -> None:
        plane = ControlPlane.open(config, state)
        async with trio.open_nursery() as inner:
            await inner.start(plane.serve)
            task_status.started((plane, inner.cancel_scope))

    plane, scope = await nursery.start(control_plane)
    agent_config = cluster.agent(tmp_path, "node-a")
    link = await nursery.start(run_agent, agent_config)
    ready = await await_true(lambda: (s := reported(plane)) and s.state == w.READY and s, "replica ready")
    assert ready.pid and ready.port and ready.restarts == 0

    first_desired = link.state.desired
    scope.cancel()  # the control plane goes away
    await await_true(lambda: not link.state.connected, "link down")
    os.kill(ready.pid, 0)  # the engine still runs

    plane, scope = await nursery.start(control_plane)
    sessions = link.state.sessions
    await await_true(lambda: link.state.sessions > sessions, "agent back")
    again = await await_true(lambda: (s := reported(plane)) and s.state == w.READY and s, "replica reported again")
    assert (again.replica_id, again.pid, again.port, again.restarts) == (
        ready.replica_id,
        ready.pid,
        ready.port,
        0,
    )
    # The new control plane's desired state has arrived, with the same assignment, and changed nothing.
    await await_true(lambda: link.state.desired is not first_desired, "a new desired state")
    assert link.state.desired.replicas == first_desired.replicas
    # A wrong restart would be decided as the agent takes the desired state, and reported over
    # the link at once: both in this process, so once every task here waits, it would be in.
    await trio.testing.wait_all_tasks_blocked()
    assert reported(plane) == again
    os.kill(ready.pid, 0)
    # `llmgw ctl logs`: the control plane asks the agent for the engine log's tail over the link.
    logs = await plane.operations.replica_logs(again.replica_id, 50)
    [member] = logs["members"]
    assert member["node"] == "node-a" and member["error"] == ""
    assert "sim" in member["text"] and len(member["text"].splitlines()) <= 50
    with pytest.raises(UnknownReplica) as info:  # the admin API answers it 404
        await plane.operations.replica_logs("nope-0", 10)
    assert "'nope-0'" in str(info.value) and again.replica_id in str(info.value)
    scope.cancel()
