"""A day budget on the control plane's own gateway on its loop (`gateway_workers = 0`, the
in-process worker, which takes its grants in memory: `server/gateways/inprocess.py`), with a real
agent and a sim replica: a key's answers stop at its budget, passed by one answer at most, and
the refusal is a 429 `budget_exceeded` naming the budget."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trio

from agent.main import run_agent
from llmgw.config import Model
from llmgw.server.app import ControlPlane
from testlib.controlplane import local
from testlib.gateway import chat, request
from testlib.proc import run_llmgw
from testlib.waiting import await_true

BUDGET = 400
MAX_TOKENS = 16


async def ctl(*args: str) -> str:
    done = await trio.to_thread.run_sync(lambda: run_llmgw("ctl", *args))
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.trio
async def test_the_gateway_on_the_control_planes_loop_holds_a_day_budget(
    tmp_path: Path, nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = local(tmp_path, monkeypatch, (Model(name="chat", engine="sim", replicas=1),))
    config, state = cluster.config, cluster.state
    plane = ControlPlane.open(config, state)
    bound = await nursery.start(plane.serve)
    http_port = bound.http_address[1]
    token = json.loads(await ctl("keys", "create", "bob", "--json", "--state-dir", str(state)))["token"]
    await ctl("budgets", "set", "--key", "bob", "--period", "day", "--tokens", str(BUDGET), "--state-dir", str(state))
    await nursery.start(run_agent, cluster.agent(tmp_path, "node-a"))
    in_rotation = lambda: plane.gateway.router.endpoints.get("chat")  # noqa: E731
    await await_true(in_rotation, "the replica in the gateway's rotation", changed=plane.gateway.freed.next)

    used, largest, unavailable = 0, 0, 0
    for i in range(200):  # bounded: it ends at the budget
        status, headers, body = await trio.to_thread.run_sync(
            lambda i=i: request(
                http_port, "POST", "/v1/chat/completions", chat(f"ask {i}", max_tokens=MAX_TOKENS), token=token
            )
        )
        if status == 200:
            usage = json.loads(body)["usage"]
            tokens = usage["prompt_tokens"] + usage["completion_tokens"]
            used, largest = used + tokens, max(largest, tokens)
            continue
        error = json.loads(body)["error"]
        if error["code"] == "budget_unavailable":  # a leader's first seconds: it hands out nothing yet
            unavailable += 1
            await trio.sleep(int(headers["retry-after"]))
            continue
        assert (status, error["code"], error["param"]) == (429, "budget_exceeded", "key:bob::day"), body
        break
    else:
        raise AssertionError(f"no budget_exceeded after 200 requests; {used} tokens used")
    assert BUDGET - largest <= used <= BUDGET + largest, (used, largest)
    assert unavailable <= 10, unavailable
