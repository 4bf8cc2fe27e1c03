"""vLLM by default, end to end: a control plane with no [engines.vllm] but an index names the
pinned vLLM; real agents (their GPUs from recorded nvidia-smi answers) get it, or are not
asked, by vLLM's own rule. The vLLM is a stand-in built here as a wheel (a console script
`vllm` answering `--version` and, given VLLM_TARGET_DEVICE, `serve --help=all` with the help
of the vLLM llmgw's flags were written for), served from a PEP 503 index on loopback and
installed by the agent's own code with real pip into a real venv, then checked by running it.

pip sees only that index: the node's pip configuration is switched off for the test
(PIP_CONFIG_FILE=/dev/null and no PIP_* variables), as a node without one would run it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from agent.main import run_agent
from llmgw.config import (
    DEFAULT_VLLM_VERSION,
    AgentConfig,
    EngineSource,
    EnginesSection,
    VllmSource,
)
from llmgw.ctl import engines as engine_texts
from llmgw.ctl.tables import format_nodes
from llmgw.pki.files import issue_to_dir, node_paths
from llmgw.server.app import ControlPlane
from llmgw.wire import agent_link as w
from testlib.controlplane import make_state, serve_plane
from testlib.hardware import FIXTURES, NO_TOOL, nvidia_smi
from testlib.pyindex import serve_index, wheel

HELP = (FIXTURES / "help" / "vllm.txt").read_text()

STAND_IN = '''\
"""A stand-in for vLLM's command: what llmgw asks of it before offering it."""
import os
import sys
from pathlib import Path

VERSION = "{version}"


def main():
    args = sys.argv[1:]
    if args == ["--version"]:
        print(VERSION)
        return 0
    if args[:1] == ["serve"] and "--help=all" in args:
        device = os.environ.get("VLLM_TARGET_DEVICE", "")
        if not device:  # as vLLM on a node it cannot infer a device for
            print("RuntimeError: Failed to infer device type", file=sys.stderr)
            return 1
        (Path(__file__).parent / "help-device").write_text(device)
        sys.stdout.write((Path(__file__).parent / "help.txt").read_text())
        return 0
    print("stand-in vllm cannot " + " ".join(args), file=sys.stderr)
    return 2
'''


def stand_in(version: str, *, help_text: str = HELP, requires: tuple[str, ...] = ()) -> tuple[str, bytes]:
    files = {
        "vllm/__init__.py": f'__version__ = "{version}"\n',
        "vllm/cli.py": STAND_IN.format(version=version),
        "vllm/help.txt": help_text,
    }
    return wheel("vllm", version, files, requires=requires, scripts={"vllm": "vllm.cli:main"})


@pytest.fixture
def no_pip_config(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith("PIP_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)


async def start_plane(tmp_path: Path, nursery: trio.Nursery, engines: EnginesSection):
    state = tmp_path / "cp"
    ca = make_state(state, sans=["127.0.0.1"], days=3)
    plane, bound = await serve_plane(state, nursery, engines=engines, heartbeat_interval_s=0.2)
    return plane, bound, ca


async def start_agent(tmp_path: Path, nursery: trio.Nursery, plane_bound, ca, node: str, card: str | None) -> Path:
    node_dir = tmp_path / node
    issue_to_dir(ca, node, node_paths(node_dir).dir, validity_days=3)
    config = AgentConfig(
        server=f"wss://127.0.0.1:{plane_bound.agent_address[1]}",
        node_id=node,
        state_dir=str(node_dir),
        nvidia_smi=nvidia_smi(card) if card else NO_TOOL,
    )
    await nursery.start(run_agent, config)
    return node_dir


def engine(plane: ControlPlane, node: str, name: str) -> w.EngineStatus | None:
    n = plane.registry.nodes.get(node)
    return next((e for e in n.engines if e.name == name), None) if n else None


async def settled(plane: ControlPlane, node: str, name: str, seen: list, timeout: float = 120) -> w.EngineStatus:
    """Wait until the node reports `name` ok or failed; `seen` collects the states on the way."""
    with trio.fail_after(timeout):
        while True:
            e = engine(plane, node, name)
            if e is not None and (not seen or seen[-1] != (e.state, e.phase)):
                seen.append((e.state, e.phase))
            if e is not None and e.state in (w.ENGINE_OK, w.ENGINE_FAILED):
                return e
            await trio.sleep(0.05)


@pytest.mark.trio
async def test_vllm_is_installed_by_default_on_a_capable_node_and_not_asked_elsewhere(
    tmp_path: Path, nursery: trio.Nursery, no_pip_config: None
) -> None:
    index, url = await serve_index(nursery)
    index.add("vllm", *stand_in(DEFAULT_VLLM_VERSION))
    index.add("vllm", *stand_in("0.31.0"))  # pip must take the pinned one, not another
    engines = EnginesSection(llamacpp=EngineSource(enabled=False), vllm=VllmSource(index_url=url))
    plane, bound, ca = await start_plane(tmp_path, nursery, engines)
    gpu_node = await start_agent(tmp_path, nursery, bound, ca, "node-l4", "l4")
    await start_agent(tmp_path, nursery, bound, ca, "node-pascal", "gtx1080ti")
    await start_agent(tmp_path, nursery, bound, ca, "node-cpu", None)

    seen: list = []
    status = await settled(plane, "node-l4", "vllm", seen)
    assert status.ok and status.version == DEFAULT_VLLM_VERSION, status.detail
    # The install was reported while it ran, phase by phase, before it was offered.
    assert (w.ENGINE_INSTALLING, "install") in seen and seen[-1] == (w.ENGINE_OK, "")
    venv = (gpu_node / "engines" / "vllm" / "current").resolve()
    assert venv.name == DEFAULT_VLLM_VERSION
    said = subprocess.run([str(venv / "bin" / "vllm"), "--version"], capture_output=True, text=True, check=True)
    assert said.stdout.strip() == DEFAULT_VLLM_VERSION
    # Its help was checked, on the device it will run on here.
    site = next((venv / "lib").glob("python3*/site-packages/vllm"))
    assert (site / "help-device").read_text() == "cuda"
    assert f"/files/vllm-{DEFAULT_VLLM_VERSION}-py3-none-any.whl" in index.gets

    # The others were never asked: nothing installed, and the view says why.
    await trio.sleep(1.0)  # their engines are reported (sim) by now; vLLM would be installing
    views = {v["id"]: v for v in plane.views.node_views()}
    for node in ("node-pascal", "node-cpu"):
        assert engine(plane, node, "vllm") is None
        assert not (tmp_path / node / "engines" / "vllm").exists()
    pascal = engine_texts.notes(views["node-pascal"])
    assert (
        "vllm: ineligible (vLLM needs compute capability 7.5 or newer; NVIDIA GeForce GTX 1080 Ti (6.1) is older)"
        in pascal
    )
    cpu = engine_texts.notes(views["node-cpu"])
    assert "vllm: not applicable (no NVIDIA GPU; vLLM runs on NVIDIA GPUs, llama.cpp serves this node)" in cpu
    table = format_nodes(list(views.values()))
    assert "sim,vllm" in table.splitlines()[2]  # node-l4's row offers it

    # And the operator's command says the same.
    shown = await trio.to_thread.run_sync(
        lambda: subprocess.run(
            [sys.executable, "-m", "llmgw", "ctl", "nodes", "--state-dir", str(tmp_path / "cp")],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
            timeout=60,
        )
    )
    assert shown.returncode == 0, shown.stderr
    assert "node-cpu: vllm: not applicable (no NVIDIA GPU" in shown.stdout
    assert "node-pascal: vllm: ineligible (vLLM needs compute capability 7.5" in shown.stdout


@pytest.mark.trio
@pytest.mark.parametrize("case", ["missing-dependency", "help-lacks-flags"])
async def test_a_failing_install_says_why_and_is_not_offered(
    tmp_path: Path, nursery: trio.Nursery, no_pip_config: None, case: str
) -> None:
    index, url = await serve_index(nursery)
    if case == "missing-dependency":
        index.add("vllm", *stand_in("0.32.1", requires=("llmgw-no-such-dependency>=1",)))
        version = "0.32.1"
    else:
        cut = HELP.replace("--headless", "--no-head").replace("--nnodes", "--num-nodes")
        index.add("vllm", *stand_in("0.32.2", help_text=cut))
        version = "0.32.2"
    engines = EnginesSection(llamacpp=EngineSource(enabled=False), vllm=VllmSource(version=version, index_url=url))
    plane, bound, ca = await start_plane(tmp_path, nursery, engines)
    node_dir = await start_agent(tmp_path, nursery, bound, ca, "node-a", "h100")

    status = await settled(plane, "node-a", "vllm", [])
    assert not status.ok and status.state == w.ENGINE_FAILED
    if case == "missing-dependency":
        assert status.detail.startswith(f"pip could not install vllm=={version} from {url}: ERROR: ")
        assert "llmgw-no-such-dependency" in status.detail and "index_url under [engines.vllm]" in status.detail
    else:
        assert "does not document --headless, --nnodes, which llmgw gives vLLM" in status.detail
        assert "llmgw ctl engine-check vllm" in status.detail
    # Never offered, never current, and no half-made venv left behind.
    assert not (node_dir / "engines" / "vllm" / "current").exists()
    assert not (node_dir / "engines" / "vllm" / version).exists()
    [note] = [line for line in engine_texts.notes(plane.views.node_view("node-a")) if line.startswith("vllm")]
    assert note == f"vllm failed: {status.detail}"
