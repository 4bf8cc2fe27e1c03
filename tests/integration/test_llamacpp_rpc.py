"""One llama.cpp model over two nodes through llama.cpp's RPC (issue 49), with the real
llama-server and ggml-rpc-server: two `Supervisor`s in this process stand in for the agents of
rank 0 (node-0, which serves) and of its helper (node-1, which lends its CPU), each with its
node's certificate of one test CA, on 127.0.0.1.

The helper runs ggml-rpc-server on 127.0.0.1 behind its tunnel; rank 0 reaches it through the
tunnel and starts llama-server with --rpc; a made GGUF whose greedy answer is known
(testlib.makegguf, cycle=True) answers a chat completion correctly, half its layers on the
helper and half on rank 0's CPU. Then the rpc-server is killed: the helper reports it (restarting, the exit in its
detail), rank 0 reports the lost helper, and both come back and answer again.

The parts a multi-node test through the gateway needs: `agent_pair` (the two supervisors and
the assignment), `chat`. Every wait is bounded; a failed one shows both sides' statuses and logs.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
from pathlib import Path

import attrs
import pytest
import trio

from agent.replica_rpc import RpcIdentity
from agent.replica_supervisor import Supervisor
from agent.weights import WeightsStore
from llmgw.llamarecipe import RPC_SERVER
from llmgw.pki.ca import new_ca
from llmgw.pki.files import issue_to_dir
from llmgw.wire import agent_link as w
from testlib.exposure import listening
from testlib.llama import llama_server
from testlib.makegguf import cycle_text, make_gguf
from testlib.ports import free_port
from testlib.waiting import await_true

pytestmark = pytest.mark.trio

KEY = "sk-rpc-replica-0123456789"
NODES = ("node-0", "node-1")
DEADLINE_S = 120.0  # a start: the model's tensors go over the tunnel to the helper
TOKENS = 8


@attrs.frozen(kw_only=True)
class AgentPair:
    serving: Supervisor
    helper: Supervisor
    assignment: w.ReplicaAssignment  # rank 0's; the helper's is the same at rank 1

    def of(self, rank: int) -> Supervisor:
        return self.serving if rank == 0 else self.helper

    def status(self, rank: int) -> w.ReplicaStatus | None:
        return next(iter(self.of(rank).statuses()), None)

    def report(self) -> str:
        lines = []
        for rank in (0, 1):
            sup = self.of(rank)
            lines.append(f"rank {rank}: {sup.statuses()!r}")
            lines.append(sup.tail(self.assignment.replica_id, 40))
        return "\n".join(lines)

    async def until(self, predicate, what: str, timeout: float = DEADLINE_S):
        changed = [self.serving.changed.next, self.helper.changed.next]
        return await await_true(predicate, what, changed=changed, timeout=timeout, report=self.report)


def agent_pair(root: Path, model: Path, *, host: str = "127.0.0.1") -> AgentPair:
    """Two agents' supervisors, each with its node's certificate (one CA), running the real
    llama.cpp from the tests' build; the assignment of a 2-node llama.cpp replica of `model`."""
    ca = new_ca(validity_days=3)
    engine = (llama_server(),)
    sups = []
    for node in NODES:
        files = issue_to_dir(ca, node, root / node / "pki", validity_days=3)
        sups.append(
            Supervisor(
                state_dir=root / node,
                weights=WeightsStore(root / node / "weights"),
                engine_command=lambda name: engine,
                listen_host=host,
                stop_timeout_s=5.0,
                health_interval_s=0.2,
                rpc=RpcIdentity.of(files),
            )
        )
    assignment = w.ReplicaAssignment(
        replica_id="m-1",
        model="m",
        engine="llamacpp",
        weights=w.WeightsSource(path=str(model)),
        api_key=KEY,
        nodes=NODES,
        node_rank=0,
        rank0_addr=host,
        dist_init_port=free_port(host),
        member_addrs=(host, host),
        args=("--threads", "1", "--parallel", "1"),
    )
    return AgentPair(serving=sups[0], helper=sups[1], assignment=assignment)


def chat(port: int, content: str = "Say something.", host: str = "127.0.0.1") -> tuple[int, dict]:
    conn = http.client.HTTPConnection(host, port, timeout=60)
    body = {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": TOKENS, "temperature": 0}
    try:
        conn.request(
            "POST",
            "/v1/chat/completions",
            json.dumps(body),
            {"content-type": "application/json", "authorization": f"Bearer {KEY}"},
        )
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"null")
    finally:
        conn.close()


def rss(pid: int, kind: str = "VmRSS") -> int:
    """A process's resident memory, bytes (/proc/PID/status: VmRSS, or RssAnon / RssFile)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{kind}:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {kind} for pid {pid}")


def in_state(pair: AgentPair, rank: int, *states: str):
    def check() -> w.ReplicaStatus | None:
        st = pair.status(rank)
        return st if st is not None and st.state in states else None

    return check


async def test_a_model_over_two_nodes_answers_and_a_lost_helper_is_reported(tmp_path: Path) -> None:
    # 8 layers of 512: 62 MB of F16 matrices, 4 layers on each node (llamacpp.rpc_layer_split).
    model = make_gguf(tmp_path / "m.gguf", n_layer=8, n_embd=512, n_head=8, n_head_kv=2, dtype="F16", cycle=True)
    assert (Path(llama_server()).parent / RPC_SERVER).is_file(), "the tests' llama.cpp has no ggml-rpc-server"
    pair = agent_pair(tmp_path, model)
    async with trio.open_nursery() as nursery:
        await nursery.start(pair.serving.serve)
        await nursery.start(pair.helper.serve)
        pair.serving.assign([pair.assignment])
        pair.helper.assign([attrs.evolve(pair.assignment, node_rank=1)])

        helper = await pair.until(in_state(pair, 1, w.READY), "the helper ready")
        ready = await pair.until(in_state(pair, 0, w.READY), "rank 0 ready")
        # The rpc-server listens on loopback alone; the tunnel on the node's address.
        rpc_ports = listening(helper.pid)
        assert rpc_ports and all(host == "127.0.0.1" for host, _ in rpc_ports), rpc_ports

        status, answer = await trio.to_thread.run_sync(chat, ready.port)
        assert status == 200, (answer, pair.report())
        assert answer["choices"][0]["message"]["content"] == cycle_text(TOKENS), (answer, pair.report())
        # Half the layers on each node: the helper's rpc-server holds its half in its own memory
        # (with every layer it held 78 MiB anonymous; 41 with half: its compute buffer is 18),
        # llama-server its half mapped from the file (44 MiB of file pages, 14 of them its
        # libraries; 14 with no layer of its own).
        size = model.stat().st_size
        assert rss(helper.pid, "RssAnon") < 0.8 * size, rss(helper.pid, "RssAnon")
        assert rss(ready.pid, "RssFile") > 0.4 * size, rss(ready.pid, "RssFile")
        assert "--tensor-split" in pair.serving.tail("m-1", 400)
        assert "Accepted client connection" in pair.helper.tail("m-1", 400)

        # The helper's rpc-server killed: the helper says so, rank 0 says which helper it lost.
        os.kill(helper.pid, signal.SIGKILL)
        lost = await pair.until(in_state(pair, 1, w.RESTARTING, w.FAILED), "the helper reports its exit")
        assert "killed by SIGKILL" in lost.detail, lost
        cut = await pair.until(
            lambda: (s := pair.status(0)) is not None and s.state in (w.RESTARTING, w.FAILED) and s.restarts >= 1 and s,
            "rank 0 reports the lost helper",
        )
        assert "the RPC connection to helper node node-1 at 127.0.0.1" in cut.detail, cut

        # Both come back where they were: the replica forms again and answers.
        await pair.until(in_state(pair, 1, w.READY), "the helper ready again")
        again = await pair.until(in_state(pair, 0, w.READY), "rank 0 ready again")
        status, answer = await trio.to_thread.run_sync(chat, again.port)
        assert status == 200 and answer["choices"][0]["message"]["content"] == cycle_text(TOKENS), (
            answer,
            pair.report(),
        )
        nursery.cancel_scope.cancel()
