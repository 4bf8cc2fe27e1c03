"""The gateway inside a real control plane: an in-process control plane places a sim replica on
a real agent; the replica is served through the gateway route as soon as its rank 0 reports
ready; keys are made and revoked with `llmgw ctl keys`; cordon-and-drain marks it draining."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest
import trio

from agent.main import run_agent
from llmgw.config import Model
from llmgw.server.app import ControlPlane
from llmgw.wire import agent_link as w
from testlib.controlplane import local
from testlib.gateway import chat, request
from testlib.proc import run_llmgw
from testlib.waiting import await_true


async def ctl(*args: str) -> str:
    done = await trio.to_thread.run_sync(lambda: run_llmgw("ctl", *args))
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.trio
async def test_a_placed_sim_replica_is_served_through_the_gateway(
    tmp_path: Path, nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = local(tmp_path, monkeypatch, (Model(name="chat", engine="sim", replicas=1),))
    config, state = cluster.config, cluster.state
    plane = ControlPlane.open(config, state)
    plane.gateway.options = attrs.evolve(plane.gateway.options, queue_timeout_s=0.5)
    bound = await nursery.start(plane.serve)
    http_port = bound.http_address[1]

    async def call(body, token):
        return await trio.to_thread.run_sync(
            lambda: request(http_port, "POST", "/v1/chat/completions", body, token=token)
        )

    created = json.loads(await ctl("keys", "create", "alice", "--models", "chat", "--json", "--state-dir", str(state)))
    token = created["token"]
    status, headers, body = await call(chat(), token)
    assert status == 503 and headers["retry-after"]  # nothing placed yet: queued, then refused
    assert plane.endpoints.gateway_rotation().models == {"chat"}

    await nursery.start(run_agent, cluster.agent(tmp_path, "node-a"))
    in_rotation = lambda: plane.gateway.router.endpoints.get("chat")  # noqa: E731
    await await_true(in_rotation, "the replica in the gateway's rotation", changed=plane.gateway.freed.next)
    [ep] = plane.gateway.router.endpoints["chat"]
    [view] = plane.views.replica_views()
    assert (ep.replica_id, ep.host, ep.port, ep.draining) == (view["replica"], "127.0.0.1", view["port"], False)
    assert view["state"] == w.READY

    status, headers, body = await call(chat(stream=True), token)
    assert status == 200 and body.endswith(b"data: [DONE]\n\n")
    assert headers["x-llmgw-replica"] == ep.replica_id
    health = await trio.to_thread.run_sync(lambda: request(http_port, "GET", "/health"))
    assert health[0] == 200 and json.loads(health[2])["ready"] == {"chat": 1}
    metrics = await trio.to_thread.run_sync(lambda: request(http_port, "GET", "/metrics"))
    assert b'llmgw_gateway_requests_total{model="chat",status="200"} 1' in metrics[2]

    listing = await ctl("keys", "list", "--state-dir", str(state))
    assert "alice" in listing and "valid" in listing
    assert "revoked API key 'alice'" in await ctl("keys", "revoke", "alice", "--state-dir", str(state))
    assert (await call(chat(), token))[0] == 401

    # A drain marks the replica draining at once (it stays the fallback while it is the only one).
    await plane.operations.start_drain("node-a", force=False)
    draining = lambda: plane.gateway.router.endpoints["chat"][0].draining  # noqa: E731
    await await_true(draining, "draining in rotation", changed=plane.gateway.freed.next)
