"""`llmgw ctl`, the real CLI in a process of its own, pointed at a relay (`llmgw.http.relay`, as a
gateway worker runs it on `http_listen`) in front of a control plane's private socket: it
works as against the control plane itself, and once the control plane is gone it says so,
naming the cause, at once."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
import trio

from llmgw import paths
from llmgw.config import ServerConfig, ServerSection
from llmgw.http.openai import error_body
from llmgw.http.relay import Relay
from llmgw.http.server import bound_address, serve_http
from llmgw.server.app import ControlPlane
from testlib.controlplane import OFFLINE_ENGINES, make_state
from testlib.proc import run_llmgw

pytestmark = pytest.mark.trio


async def test_ctl_nodes_through_the_relay_and_a_clear_503_once_the_control_plane_is_gone(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    state = tmp_path / "cp"
    make_state(state)
    server = ServerSection(state_dir=str(state), agent_listen="127.0.0.1:0", http_listen="127.0.0.1:0")
    plane = ControlPlane.open(ServerConfig(server=server, engines=OFFLINE_ENGINES), state)
    scope, stopped = trio.CancelScope(), trio.Event()

    async def run(*, task_status=trio.TASK_STATUS_IGNORED) -> None:
        try:
            with scope:
                await plane.serve(private_socket=True, task_status=task_status)
        finally:
            stopped.set()

    await nursery.start(run)
    await plane.store.saw_node("n1", "127.0.0.5")
    plane.registry.know("n1", address="127.0.0.5")
    relay = Relay(paths.admin_socket_path(state))
    listeners = await nursery.start(partial(serve_http, relay.handle, "127.0.0.1", 0, errors=error_body))
    host, port = bound_address(listeners)
    ctl = partial(
        run_llmgw,
        "ctl",
        "nodes",
        "--json",
        "--server",
        f"http://{host}:{port}",
        "--credential",
        str(paths.admin_token_path(state)),
    )

    result = await trio.to_thread.run_sync(ctl)
    assert result.returncode == 0, result.stderr
    assert [n["id"] for n in json.loads(result.stdout)] == ["n1"]

    scope.cancel()
    await stopped.wait()
    result = await trio.to_thread.run_sync(ctl)
    assert result.returncode != 0
    assert "the control plane is not answering on its private socket" in result.stderr, result.stderr
    assert "the gateway keeps serving /v1/" in result.stderr and "HTTP 503" in result.stderr
