"""A background loop that fails after start costs that loop only: an in-process control plane and
a real agent (real sockets, a real sim engine) keep serving HTTP, the agent link and the replica
while the plane's mirror fill or the agent's engine loop fails; each failure is logged with its
traceback, the loop runs again, and once the fault is gone it finishes its work. A drain hit by
an unexpected exception reports it in `/admin/v1/nodes`, and can be run again."""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import signal
from pathlib import Path

import attrs
import pytest
import trio

from agent.main import run_agent
from llmgw.backoff import Backoff
from llmgw.config import EngineArchive, EngineSource, EnginesSection, Model
from llmgw.ctl.client import AdminClient
from llmgw.server.app import ControlPlane, serve_control_plane
from llmgw.wire import agent_link as w
from testlib.controlplane import local
from testlib.fileserver import serve_files
from testlib.gateway import request
from testlib.waiting import await_true

pytestmark = pytest.mark.trio

FAST = Backoff(first_s=0.2, max_s=1.0, healthy_s=60.0)


def failed(caplog: pytest.LogCaptureFixture, task: str) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.getMessage() == "background_task_failed" and r.llmgw_fields["task"] == task  # type: ignore[attr-defined]
    ]


async def get(port: int, path: str, token: str = "") -> tuple[int, bytes]:
    status, _, body = await trio.to_thread.run_sync(lambda: request(port, "GET", path, token=token))
    return status, body


async def test_a_failing_mirror_fill_or_engine_loop_costs_that_loop_only(
    tmp_path: Path, nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO")
    files, base = await serve_files(nursery)
    archive = os.urandom(10_000)  # not a real archive: the agent's install fails, as an LlmgwError
    digest = hashlib.sha256(archive).hexdigest()
    files.content["/llama.tgz"] = archive
    cluster = local(tmp_path, monkeypatch, (Model(name="chat", engine="sim", replicas=1),))
    engines = EnginesSection(
        llamacpp=EngineSource(
            version="b1",
            archives=(EngineArchive(arch=platform.machine(), url=f"{base}/llama.tgz", sha256=digest, binary="bin/x"),),
        )
    )
    plane = ControlPlane.open(attrs.evolve(cluster.config, engines=engines), cluster.state)
    plane.background.backoff = FAST
    # The faults, real ones: a directory where the mirror's copy of the archive goes (reading it
    # to check its hash fails), and a file where the agent keeps its engines (installing fails).
    blocker = cluster.state / "artifacts" / digest
    blocker.mkdir(parents=True)
    node = cluster.agent(tmp_path, "node-a")
    engines_dir = Path(node.state_dir) / "engines"
    engines_dir.write_text("not a directory")

    bound = await nursery.start(plane.serve)
    port = bound.http_address[1]
    link = await nursery.start(run_agent, node)
    await await_true(lambda: len(failed(caplog, "mirror")) >= 2, "the mirror fill failing twice")
    [view] = await await_true(
        lambda: [v for v in plane.views.replica_views() if v["state"] == w.READY], "the replica ready", timeout=60
    )
    seen = len(failed(caplog, "engines"))
    await await_true(lambda: len(failed(caplog, "engines")) > max(seen, 1), "the engine loop failing again", timeout=60)

    # Each failure is logged with its traceback, and the loop was started again.
    mirror = failed(caplog, "mirror")[0]
    assert isinstance(mirror.exc_info[1], IsADirectoryError)
    engine = failed(caplog, "engines")[0]
    assert isinstance(engine.exc_info[1], NotADirectoryError) and engine.llmgw_fields["node"] == "node-a"
    assert plane.background.restarts["mirror"] >= 1
    # Meanwhile the process serves: HTTP, the agent link (the same session all along), the replica.
    assert (await get(port, "/health"))[0] == 200
    assert link.state.connected and link.state.sessions == 1
    agent_link = plane.registry.nodes["node-a"].link
    assert agent_link is not None and agent_link.connected
    [again] = [v for v in plane.views.replica_views() if v["replica"] == view["replica"]]
    assert again["state"] == w.READY and again["pids"] == view["pids"]

    # The faults removed, the loops run again and finish their work.
    blocker.rmdir()
    engines_dir.unlink()
    await await_true(lambda: digest in plane.agent_port.artifacts.available(), "the archive mirrored")
    await await_true(
        lambda: any(e.name == "llamacpp" and e.version == "b1" for e in plane.registry.nodes["node-a"].engines),
        "the agent's engine loop reporting llama.cpp",
        timeout=60,
    )
    [llamacpp] = [e for e in plane.registry.nodes["node-a"].engines if e.name == "llamacpp"]
    assert not llamacpp.ok and llamacpp.detail  # its own error: the archive is not one
    assert link.state.sessions == 1 and plane.registry.nodes["node-a"].link is agent_link
    assert (await get(port, "/health"))[0] == 200


async def test_a_drain_hit_by_a_bug_reports_it_and_can_be_run_again(
    tmp_path: Path, nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cluster = local(tmp_path, monkeypatch, (Model(name="chat", engine="sim", replicas=1),))
    plane = ControlPlane.open(cluster.config, cluster.state)
    bound = await nursery.start(plane.serve)
    port = bound.http_address[1]
    await nursery.start(run_agent, cluster.agent(tmp_path, "node-a"))
    await await_true(
        lambda: any(v["state"] == w.READY for v in plane.views.replica_views()), "the replica ready", timeout=60
    )
    client = AdminClient.locate(server=None, credential=None, state_dir=str(cluster.state))

    def place_replacement(replica_id: str, now: float):
        raise KeyError(replica_id)  # the one injected fault: a bug in placement

    real = plane.replicas.place_replacement
    plane.replicas.place_replacement = place_replacement
    started = await trio.to_thread.run_sync(lambda: client.request("POST", "/admin/v1/nodes/node-a/drain"))
    assert set(started["drain"]) == {"node", "total", "moved", "current", "done", "error"}
    drain = await await_true(
        lambda: plane.drains["node-a"].error and plane.drains["node-a"], "the drain to stop with its error"
    )
    [node] = await trio.to_thread.run_sync(client.nodes)
    error = node["drain"]["error"]
    assert error.startswith("internal error while draining node-a: KeyError('chat-0')")
    assert "the log has the traceback" in error and "run `llmgw ctl drain node-a` again" in error
    assert node["drain"]["done"] is False and node["draining"] is True
    [record] = [r for r in caplog.records if r.getMessage() == "drain_failed"]
    assert isinstance(record.exc_info[1], KeyError)
    assert (await get(port, "/health"))[0] == 200  # the control plane serves on

    # Fixed, the same command again: with --force (one node: no room elsewhere) it completes.
    plane.replicas.place_replacement = real
    again = await trio.to_thread.run_sync(lambda: client.request("POST", "/admin/v1/nodes/node-a/drain?force=1"))
    assert again["drain"]["error"] is None
    await await_true(lambda: plane.drains["node-a"].done, "the drain run again")
    assert plane.drains["node-a"] is not drain and plane.registry.nodes["node-a"].cordoned


async def test_sighup_reloads_as_soon_as_the_control_plane_is_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO")
    cluster = local(tmp_path, monkeypatch, ())
    config_path = tmp_path / "server.toml"
    config_path.write_text(
        f'[server]\nstate_dir = "{cluster.state}"\nagent_listen = "127.0.0.1:0"\nhttp_listen = "127.0.0.1:0"\n'
        '[[models]]\nname = "chat"\nengine = "sim"\n'
    )
    # Were the receiver installed only after `started`, this handler would get the signal
    # instead (without it, SIGHUP's default action would end the test run).
    stray: list[int] = []
    previous = signal.signal(signal.SIGHUP, lambda signum, frame: stray.append(signum))
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_control_plane, cluster.config, cluster.state, config_path)
            os.kill(os.getpid(), signal.SIGHUP)
            await await_true(
                lambda: any(r.getMessage() == "config_reloaded" for r in caplog.records), "the reload", timeout=10
            )
            nursery.cancel_scope.cancel()
    finally:
        signal.signal(signal.SIGHUP, previous)
    assert stray == []
