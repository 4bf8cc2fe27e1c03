"""Placement by measured speed, end to end on one machine: a control plane and an agent in this
test's process over loopback TLS, the agent running the suite's real llama-server (testlib.llama;
these tests need it and fail without it). The agent measures llama.cpp once it is checked and
reports it; the control plane keeps it (the registry), gives it to placement (the node's view
for the scheduler), shows it in `llmgw ctl nodes` (the real CLI) and on the cluster page (a real
headless Chromium); `llmgw ctl nodes bench` has the node measure again and prints the new figures."""

from __future__ import annotations

import json
import re
from pathlib import Path

import attrs
import pytest
import trio

from agent.main import run_agent
from llmgw.ctl.client import AdminClient
from llmgw.server.app import ControlPlane
from llmgw.wire import agent_link as w
from testlib.browser import Chromium, chromium, no_console_errors, open_tab  # noqa: F401 - chromium: a fixture
from testlib.controlplane import local
from testlib.llama import llama_server
from testlib.proc import run_llmgw
from testlib.waiting import await_true

pytestmark = pytest.mark.trio

MEASURED_S = 120.0  # the agent's check of llama.cpp and one measurement, on a loaded 2-core machine
SPEED_LINE = re.compile(r"node-a: llama\.cpp cpu: (\d+) prompt tok/s, (\d+) gen tok/s")


async def ctl(*args: str) -> tuple[int, str, str]:
    done = await trio.to_thread.run_sync(lambda: run_llmgw("ctl", *args))
    return done.returncode, done.stdout, done.stderr


async def test_a_node_measures_llama_cpp_reports_it_and_measures_again_when_asked(
    tmp_path: Path,
    nursery: trio.Nursery,
    monkeypatch: pytest.MonkeyPatch,
    chromium: Chromium,  # noqa: F811 - the fixture
) -> None:
    cluster = local(tmp_path, monkeypatch, ())
    state = cluster.state
    # The tests' clusters do not measure by themselves (OFFLINE_ENGINES); this one, as by default, does.
    engines = cluster.config.engines
    assert not engines.llamacpp.measure_speed
    measuring = attrs.evolve(engines, llamacpp=attrs.evolve(engines.llamacpp, measure_speed=True))
    plane = ControlPlane.open(attrs.evolve(cluster.config, engines=measuring), state)
    await nursery.start(plane.serve)
    await nursery.start(run_agent, attrs.evolve(cluster.agent(tmp_path, "node-a"), llamacpp_bin=llama_server()))

    def measured() -> tuple[w.BackendSpeed, ...]:
        node = plane.registry.nodes.get("node-a")
        return node.speeds if node and node.speeds and node.speeds[0].state == w.SPEED_OK else ()

    (speed,) = await await_true(
        measured, "node-a's llama.cpp measured", changed=plane.changes.nodes.next, timeout=MEASURED_S
    )
    assert (speed.engine, speed.backend, speed.request) == ("llamacpp", "cpu", "")  # on its own, once checked
    assert speed.prompt_tps > 0 and speed.gen_tps > 0
    # Placement reads it: the node's view for the scheduler carries the generation speed.
    [view] = plane.replicas.node_views(plane.registry.clock.now())
    assert view.speeds == (("llamacpp", "cpu", speed.gen_tps),)

    code, out, err = await ctl("nodes", "--state-dir", str(state))
    assert code == 0, err
    shown = SPEED_LINE.search(out)
    assert shown and (int(shown[1]), int(shown[2])) == (round(speed.prompt_tps), round(speed.gen_tps)), out

    # Measured again when asked: a new request, answered by the node with new figures.
    code, out, err = await ctl("nodes", "bench", "node-a", "--wait", str(MEASURED_S), "--state-dir", str(state))
    assert code == 0, (out, err)
    assert SPEED_LINE.search(out), out
    (again,) = plane.registry.nodes["node-a"].speeds
    assert again.request.startswith("bench-") and again.state == w.SPEED_OK
    assert again.measured_at > speed.measured_at
    # Asking a node that is not there says so, and names the ones that are.
    code, out, err = await ctl("nodes", "bench", "node-z", "--state-dir", str(state))
    assert code != 0 and "no node 'node-z'" in err and "node-a" in err, err
    code, out, err = await ctl("nodes", "bench", "--json", "--wait", "0", "--state-dir", str(state))
    answer = json.loads(out)
    assert [n["node"] for n in answer["nodes"]] == ["node-a"] and answer["nodes"][0]["asked"]

    # The cluster page shows the figures under the node's llama.cpp.
    client = AdminClient.locate(server=None, credential=None, state_dir=str(state))
    async with open_tab(chromium) as tab:
        await tab.goto(client.url + plane.page.login_path())
        text = await tab.wait_for(
            "(() => { const e = document.querySelector('#nodes [data-speed=\"cpu\"]');"
            " return e && /gen tok\\/s/.test(e.textContent) ? e.textContent : null; })()",
            60.0,
        )
        assert re.fullmatch(r"cpu: \d+ prompt tok/s, \d+ gen tok/s(; measuring now)?", text), text
        no_console_errors(tab)
