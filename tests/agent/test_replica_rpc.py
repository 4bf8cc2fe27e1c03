"""The members of a llama.cpp replica over RPC as the supervisor runs them (`agent.replica_rpc`),
with a stand-in ggml-rpc-server (a Python echo server taking its -H/-p) beside a stand-in
llama-server that is never to run: a helper is ready only once its rpc-server accepts, its tunnel
admits rank 0's node and reaches the rpc-server, an rpc-server that exits is reported and its
tunnel closes with it; rank 0 whose helper never answers reports it by name and starts no
llama-server; a node whose llama.cpp has no rpc-server, or an agent without TLS, says so.

Real processes and sockets on 127.0.0.1; every wait bounded, a failed one showing the statuses
and logs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from agent import replica_rpc
from agent.adoption import Record, RunRecords, fingerprint, proc_stat, read_boot_id
from agent.peers import peer_client_ssl_context
from agent.replica_logs import EngineLog, log_path
from agent.replica_rpc import RpcIdentity
from agent.replica_supervisor import Supervisor
from agent.rpctunnel import Helper, HelperUnreachable, TunnelClient
from agent.weights import WeightsStore
from llmgw.pki.ca import new_ca
from llmgw.pki.files import NodePaths, issue_to_dir, load_cert
from llmgw.wire import agent_link as w
from testlib.exposure import listening
from testlib.ports import free_port
from testlib.waiting import await_true

pytestmark = pytest.mark.trio

DEADLINE_S = 20.0
KEY = "sk-rpc-0123456789"

# Takes -H HOST -p PORT as ggml-rpc-server does, echoes each client's bytes, one client at a time.
STAND_IN_RPC = """\
import socket, sys
args = sys.argv[1:]
host, port = args[args.index("-H") + 1], int(args[args.index("-p") + 1])
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((host, port))
s.listen(8)
print("stand-in rpc-server on", host, port, flush=True)
while True:
    c, _ = s.accept()
    with c:
        while data := c.recv(65536):
            c.sendall(data)
"""


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, NodePaths]:
    ca = new_ca(validity_days=3)
    root = tmp_path_factory.mktemp("pki")
    return {n: issue_to_dir(ca, n, root / n, validity_days=3) for n in ("node-0", "node-1")}


def llama_dir(root: Path, *, rpc: bool = True) -> Path:
    """A llama.cpp directory: a llama-server that leaves a mark if it is ever run, and the stand-in rpc-server."""
    d = root / "llama"
    d.mkdir()
    server = d / "llama-server"
    server.write_text(f"#!/bin/sh\ntouch {root / 'llama-server-ran'}\nexit 3\n")
    server.chmod(0o755)
    if rpc:
        rpc_server = d / "ggml-rpc-server"
        rpc_server.write_text(f"#!{sys.executable}\n{STAND_IN_RPC}")
        rpc_server.chmod(0o755)
    return d


def supervisor(root: Path, node: str, files: NodePaths | None, llama: Path) -> Supervisor:
    return Supervisor(
        state_dir=root / node,
        weights=WeightsStore(root / node / "weights"),
        engine_command=lambda name: (str(llama / "llama-server"),),
        listen_host="127.0.0.1",
        stop_timeout_s=3.0,
        health_interval_s=0.1,
        rpc=RpcIdentity.of(files) if files is not None else None,
    )


def assignment(rank: int, port: int, **kw: object) -> w.ReplicaAssignment:
    fields: dict = dict(
        replica_id="m-1",
        model="m",
        engine="llamacpp",
        weights=w.WeightsSource(path="/nonexistent/m.gguf"),  # a helper fetches nothing
        api_key=KEY,
        nodes=("node-0", "node-1"),
        node_rank=rank,
        rank0_addr="127.0.0.1",
        dist_init_port=port,
        member_addrs=("127.0.0.1", "127.0.0.1"),
    )
    return w.ReplicaAssignment(**{**fields, **kw})


async def until(sup: Supervisor, state: str, what: str) -> w.ReplicaStatus:
    def check() -> w.ReplicaStatus | None:
        st = next(iter(sup.statuses()), None)
        return st if st is not None and st.state == state else None

    def report() -> str:
        return f"{sup.statuses()!r}\n{sup.tail('m-1', 30)}"

    return await await_true(check, what, changed=[sup.changed.next], timeout=DEADLINE_S, report=report)


async def test_a_helper_serves_its_rpc_server_to_rank_0_alone_and_reports_its_exit(
    tmp_path: Path, nodes: dict[str, NodePaths]
) -> None:
    port = free_port()
    sup = supervisor(tmp_path, "node-1", nodes["node-1"], llama_dir(tmp_path))
    serving = nodes["node-0"]
    helper = Helper(node="node-1", address="127.0.0.1", port=port)
    client = TunnelClient([helper], peer_client_ssl_context(serving.cert, serving.key), load_cert(serving.ca_cert))
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.serve)
        sup.assign([assignment(1, port)])
        ready = await until(sup, w.READY, "the helper ready")
        # Its rpc-server on loopback alone; the tunnel carries rank 0's bytes to it and back.
        assert [host for host, _ in listening(ready.pid)] == ["127.0.0.1"]
        (local,) = await nursery.start(client.serve)
        with trio.fail_after(DEADLINE_S):
            stream = await trio.open_tcp_stream("127.0.0.1", local)
            async with stream:
                await stream.send_all(b"\x0e" + bytes(32))
                got = b""
                while len(got) < 33:
                    got += await stream.receive_some(100)
        assert got == b"\x0e" + bytes(32)
        assert "ggml-rpc-server" in sup.tail("m-1", 50) and not (tmp_path / "llama-server-ran").exists()
        # The rpc-server killed: reported, and the tunnel closed with it (rank 0 finds nothing there).
        os.kill(ready.pid, signal.SIGKILL)
        gone = await until(sup, w.RESTARTING, "the helper reports its rpc-server's exit")
        assert "killed by SIGKILL" in gone.detail, gone
        with trio.fail_after(DEADLINE_S), pytest.raises(HelperUnreachable, match="connection refused"):
            await client.reach(helper)
        await until(sup, w.READY, "the helper ready again")
        with trio.fail_after(DEADLINE_S):
            await client.reach(helper)
        nursery.cancel_scope.cancel()


async def test_rank_0_whose_helper_never_answers_names_it_and_starts_nothing(
    tmp_path: Path, nodes: dict[str, NodePaths], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(replica_rpc, "HELPERS_WAIT_S", 1.0)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    sup = supervisor(tmp_path, "node-0", nodes["node-0"], llama_dir(tmp_path))
    port = free_port()
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.serve)
        sup.assign([assignment(0, port, weights=w.WeightsSource(path=str(model)))])
        said = await until(sup, w.RESTARTING, "rank 0 gives up on its helper for now")
        assert said.detail.startswith(
            f"helper nodes not reached within 1 s: helper node node-1 at 127.0.0.1:{port}: connection refused"
        ), said
        assert said.pid == 0 and not (tmp_path / "llama-server-ran").exists()
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("lacks", ["rpc-server", "tls"])
async def test_a_node_that_cannot_take_part_says_what_it_lacks(
    tmp_path: Path, nodes: dict[str, NodePaths], lacks: str
) -> None:
    llama = llama_dir(tmp_path, rpc=lacks != "rpc-server")
    sup = supervisor(tmp_path, "node-1", nodes["node-1"] if lacks != "tls" else None, llama)
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.serve)
        sup.assign([assignment(1, free_port())])
        failed = await until(sup, w.FAILED, "the helper fails")
        if lacks == "rpc-server":
            assert f"has no ggml-rpc-server beside {llama / 'llama-server'}" in failed.detail, failed
        else:
            assert "without its node's TLS files for llama.cpp's RPC" in failed.detail, failed
        nursery.cancel_scope.cancel()


async def test_an_adopted_rpc_member_is_stopped_and_started_afresh_with_this_agents_tunnel(
    tmp_path: Path, nodes: dict[str, NodePaths]
) -> None:
    """An agent that was killed left its helper's rpc-server running, without the tunnel that
    lived in that agent: the next one stops it at once, then starts its own."""
    llama = llama_dir(tmp_path)
    port = free_port()
    a = assignment(1, port)
    rpc_port = free_port()
    engine_log = EngineLog(log_path(tmp_path / "node-1" / "logs", "m-1", 1))
    orphan = subprocess.Popen(
        [str(llama / "ggml-rpc-server"), "-H", "127.0.0.1", "-p", str(rpc_port)],
        stdin=subprocess.DEVNULL,
        stdout=engine_log.fileno(),
        stderr=engine_log.fileno(),
        start_new_session=True,
    )
    engine_log.close()
    try:
        seen = proc_stat(orphan.pid)
        assert seen is not None
        RunRecords(tmp_path / "node-1" / "run").write(
            Record(
                replica_id="m-1",
                node_rank=1,
                model="m",
                engine="llamacpp",
                pid=orphan.pid,
                pgid=orphan.pid,
                start_time=seen.start_time,
                boot_id=read_boot_id(),
                port=rpc_port,
                host="127.0.0.1",
                fingerprint=fingerprint(a),
                rpc=True,
            )
        )
        sup = supervisor(tmp_path, "node-1", nodes["node-1"], llama)
        async with trio.open_nursery() as nursery:
            await nursery.start(sup.serve)
            sup.assign([a])
            again = await await_true(
                lambda: (st := next(iter(sup.statuses()), None))
                and st.state == w.READY
                and st.pid != orphan.pid
                and st,
                "the helper started afresh",
                changed=[sup.changed.next],
                timeout=DEADLINE_S,
                report=lambda: f"{sup.statuses()!r}\n{sup.tail('m-1', 30)}",
            )
            assert orphan.wait(10) == -signal.SIGTERM
            assert again.restarts == 1 and replica_rpc.ADOPTED_SAID in sup.tail("m-1", 50)
            nursery.cancel_scope.cancel()
    finally:
        if orphan.poll() is None:
            orphan.kill()
            orphan.wait()
