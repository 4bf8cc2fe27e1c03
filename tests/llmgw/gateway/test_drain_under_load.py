"""`llmgw ctl drain` of a real node under load through the gateway: zero failed requests.

An in-process control plane with its gateway, two real agents (127.0.0.1 and 127.0.0.2) running
real sim engines; bounded load from four clients while the node holding the replicas is drained
the way `ctl drain` does it (each replacement ready before its original stops)."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from agent.main import run_agent
from llmgw.config import Model
from llmgw.server.app import ControlPlane
from llmgw.wakeup import Wakeup
from testlib.controlplane import local
from testlib.gateway import chat, request
from testlib.waiting import await_true

pytestmark = pytest.mark.trio

MAX_REQUESTS = 2000  # the load is bounded in count as well as in time
DRAIN_TIMEOUT_S = 60


async def test_draining_a_node_under_load_fails_no_request(
    tmp_path: Path, nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = local(tmp_path, monkeypatch, (Model(name="chat", engine="sim", replicas=2),))
    plane = ControlPlane.open(cluster.config, cluster.state)
    bound = await nursery.start(plane.serve)
    _, token = await plane.keys.create("load")
    for i, node_id in enumerate(("node-a", "node-b")):
        await nursery.start(run_agent, cluster.agent(tmp_path, node_id, source_address=f"127.0.0.{i + 1}"))
    in_rotation = lambda: len(plane.gateway.router.endpoints.get("chat", ())) == 2  # noqa: E731
    await await_true(
        in_rotation, "two replicas in rotation", changed=plane.gateway.freed.next
    )  # fired as it applies one
    victim = plane.replicas.placed["chat-0"].placement.nodes[0]

    results: list[int] = []
    answered = Wakeup()
    stop = trio.Event()

    async def client() -> None:
        while not stop.is_set() and len(results) < MAX_REQUESTS:
            status, _, _ = await trio.to_thread.run_sync(
                lambda: request(bound.http_address[1], "POST", "/v1/chat/completions", chat(), token=token)
            )
            results.append(status)
            answered.fire()

    async with trio.open_nursery() as load:
        for _ in range(4):
            load.start_soon(client)
        await await_true(lambda: len(results) >= 20, "load running", changed=answered.next)
        progress = await plane.operations.start_drain(victim, force=False)
        with trio.fail_after(DRAIN_TIMEOUT_S):
            await progress.finished.wait()
        before = len(results)
        await await_true(lambda: len(results) >= before + 20, "load after the drain", changed=answered.next)
        stop.set()

    assert progress.error is None and progress.moved == progress.total >= 1
    assert not any(victim in s.placement.nodes for s in plane.replicas.placed.values())
    failed = [s for s in results if s != 200]
    assert failed == [], f"{len(failed)} of {len(results)} requests failed: {sorted(set(failed))}"
