"""A replica whose model asks for KV-cache events (the catalog's cache_events): the agent gives
vLLM a port of its own for them (`--kv-events-config`), reports it once the replica is ready,
and the gateway's subscriber reads what the engine publishes there over a real socket. The engine
is a stand-in for `vllm serve` (`testlib.standin_vllm`: no GPU here) publishing with real libzmq.
Without cache_events there is no port and no flag."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import trio

from agent.replica_supervisor import Supervisor
from agent.weights import WeightsStore
from llmgw.gateway import kvevents as kv
from llmgw.wire import agent_link as w
from testlib import standin_vllm
from testlib.proc import llmgw_env
from testlib.waiting import await_true

pytestmark = pytest.mark.trio


def supervisor(state_dir: Path, args_file: Path) -> Supervisor:
    return Supervisor(
        state_dir=state_dir,
        weights=WeightsStore(state_dir / "weights"),
        # By the module itself, so that Pants gives the sandbox its file.
        engine_command=lambda name: (sys.executable, "-m", standin_vllm.__name__),
        env={**llmgw_env(), "STANDIN_ARGS_FILE": str(args_file)},
        listen_host="127.0.0.1",
        stop_timeout_s=5.0,
        health_interval_s=0.1,
    )


def assignment(weights: Path, *, cache_events: bool) -> w.ReplicaAssignment:
    return w.ReplicaAssignment(
        replica_id="q-1",
        model="q",
        engine="vllm",
        weights=w.WeightsSource(path=str(weights)),
        api_key="sk-engine-key-0001",
        nodes=("n1",),
        cache_events=cache_events,
    )


async def ready(sup: Supervisor) -> w.ReplicaStatus:
    def check() -> w.ReplicaStatus | None:
        return next((s for s in sup.statuses() if s.replica_id == "q-1" and s.state == w.READY), None)

    return await await_true(
        check, "the replica ready", changed=[sup.changed.next], timeout=60, report=lambda: repr(sup.statuses())
    )


async def test_the_engine_publishes_on_the_port_the_agent_reports_and_a_subscriber_reads_it(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    weights = tmp_path / "model"
    weights.mkdir()
    args_file = tmp_path / "argv.json"
    sup = supervisor(tmp_path / "state", args_file)
    await nursery.start(sup.serve)
    sup.assign((assignment(weights, cache_events=True),))
    status = await ready(sup)
    assert status.events_port > 0 and status.events_port != status.port
    argv = json.loads(args_file.read_text())
    config = json.loads(argv[argv.index("--kv-events-config") + 1])
    assert config == {
        "publisher": "zmq",
        "endpoint": f"tcp://*:{status.events_port}",
        "topic": "kv-events",
        "enable_kv_cache_events": True,
    }

    got: list[tuple[int, list[kv.Event]]] = []
    with trio.fail_after(30):
        async with await trio.open_tcp_stream("127.0.0.1", status.events_port) as stream:
            sub = kv.Subscription(stream)
            await sub.open()
            async for frames in sub.messages():
                seq, payload = kv.batch_of(frames)
                got.append((seq, await kv.decode_batch_async(payload)))
                if len(got) == 3:
                    break
    seqs = [seq for seq, _ in got]
    assert seqs == list(range(seqs[0], seqs[0] + 3))  # in order, none missed
    assert all(isinstance(e, kv.Stored) and e.block_size == 16 for _, events in got for e in events)

    # Turned off: started again (a changed assignment), without the port or the flag.
    sup.assign((assignment(weights, cache_events=False),))

    again = await await_true(
        lambda: next(
            (s for s in sup.statuses() if s.replica_id == "q-1" and s.state == w.READY and s.pid != status.pid), None
        ),
        "the replica ready again",
        changed=[sup.changed.next],
        timeout=60,
        report=lambda: repr(sup.statuses()),
    )
    assert again.events_port == 0
    assert "--kv-events-config" not in json.loads(args_file.read_text())
