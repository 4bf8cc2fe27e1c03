"""llama.cpp from the control plane's release, on a real cluster on loopback: `llmgw server` with
`[release] dir` and no `[engines.llamacpp]` at all, and `llmgw agent run` with no llamacpp_bin.

The release directory holds the release's own llama.cpp archive for this machine's architecture
(the portable build `./pants test` made: every CPU variant as a library; testlib.llamarelease). The agent fetches it from the control plane's agent port, checks its
sha256, unpacks it, checks `--version` and the help, reports the CPU backend it loads, and serves
a GGUF model with it; `ctl nodes` counts the node's replicas down to 0 through a drain, as the docs
tell an operator to follow it; the cluster page shows the backend. The control plane fetches no
source to build from (no node needs one), so no network is used.

A node whose architecture the release does not cover, and which has no compiler, joins all the
same: its llama.cpp is unavailable, with the packages to install. And a node declaring a fabric
without sminfo has `llmgw agent run` install infiniband-diags with the package manager on its PATH.
"""

from __future__ import annotations

import http.client
import json
import os
import platform
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from agent.install.installer import llama_cpu_backend
from llmgw import pins
from llmgw.releasefiles import ARCHES, llama_file_name
from testlib.browser import Chromium, open_tab
from testlib.cluster import Cluster, measure_speed_off, wait_until
from testlib.hardware import ib_root, sminfo
from testlib.llama import llama_server
from testlib.llamarelease import release_dir
from testlib.tinygguf import write_tiny_llama

ARCH = ARCHES[platform.machine()]
OTHER_ARCH = "arm64" if ARCH == "amd64" else "amd64"
ARCHIVE = llama_file_name(pins.LLAMACPP_VERSION, ARCH)
INSTALL_S = 120.0  # fetch, unpack and the checks, on a loaded 2-core machine
READY_S = 60.0  # a llama.cpp replica: placement, its start and the model's load


@pytest.fixture
def clusters(tmp_path: Path) -> Iterator[list[Cluster]]:
    made: list[Cluster] = []
    try:
        yield made
    finally:
        for c in made:
            c.close()


def release_cluster(root: Path, clusters: list[Cluster], engines_toml: str, arches=(ARCH,)) -> Cluster:
    release = release_dir(root / "release", arches)
    # Not measured by itself (no test here looks at speeds): in `engines_toml`'s [engines.llamacpp] if any.
    cluster = Cluster(root, engines_toml=measure_speed_off(f'[release]\ndir = "{release}"\n' + engines_toml))
    clusters.append(cluster)
    cluster.init_ca()
    cluster.start_server()
    return cluster


def llama_of(node: dict[str, Any]) -> dict[str, Any] | None:
    return next((e for e in node["engines"] if e["name"] == "llamacpp"), None)


def settled_llama(node: dict[str, Any] | None) -> dict[str, Any] | None:
    """The node's llama.cpp once its install has an outcome (joined, not installing)."""
    if node is None or node["state"] != "joined":
        return None
    llama = llama_of(node)
    return llama if llama is not None and llama["state"] != "installing" else None


def wait_llama(cluster: Cluster, node_id: str) -> dict[str, Any]:
    return wait_until(
        f"{node_id} to report llama.cpp installed or not",
        lambda: settled_llama((cluster.nodes() or {}).get(node_id)),
        procs=cluster.latest(),
        alive=[cluster.server],
        timeout=INSTALL_S,
        last_seen=lambda: cluster.last_nodes,
    )


def table_row(cluster: Cluster, node_id: str) -> str:
    done = cluster.llmgw("ctl", "nodes", "--state-dir", str(cluster.state))
    rows = [line for line in done.stdout.splitlines() if line.split()[:1] == [node_id]]
    assert len(rows) == 1, f"`ctl nodes` printed no one row for {node_id}:\n{done.stdout}\n{done.stderr}"
    return rows[0]


def replicas_cell(cluster: Cluster, node_id: str) -> str:
    """The REPLICAS cell of the node's row in `ctl nodes`, as an operator reads it."""
    done = cluster.llmgw("ctl", "nodes", "--state-dir", str(cluster.state))
    out = done.stdout.splitlines()
    start = out[0].index("REPLICAS")
    end = out[0].index("ADDRESS")
    rows = [line for line in out[1:] if line.split()[:1] == [node_id]]
    assert len(rows) == 1, f"`ctl nodes` printed no one row for {node_id}:\n{done.stdout}\n{done.stderr}"
    return rows[0][start:end].strip()


def chat(node_address: str, port: int, key: str) -> dict[str, Any]:
    conn = http.client.HTTPConnection(node_address, port, timeout=30)
    try:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
        conn.request(
            "POST",
            "/v1/chat/completions",
            body=json.dumps(body),
            headers={"content-type": "application/json", "authorization": f"Bearer {key}"},
        )
        response = conn.getresponse()
        data = json.loads(response.read() or b"{}")
        assert response.status == 200, data
        return data
    finally:
        conn.close()


async def page_shows_the_backend(cluster: Cluster, node_id: str, backend: str) -> str:
    url = cluster.llmgw("ctl", "page", "--state-dir", str(cluster.state)).stdout.split()[0]
    browser = Chromium(cluster.root / "chromium")
    try:
        async with open_tab(browser) as tab:
            await tab.goto(url)
            await tab.wait_for(f"document.querySelector('#node-{node_id} [data-cpu-backend=\"{backend}\"]')", 30)
            text = await tab.evaluate(f"document.querySelector('#node-{node_id} [data-engine=llamacpp]').textContent")
            assert tab.errors == [], tab.errors
            return text
    finally:
        browser.close()


def test_the_default_llamacpp_is_the_releases_archive_fetched_checked_and_serving(
    tmp_path: Path, clusters: list[Cluster]
) -> None:
    cluster = release_cluster(tmp_path, clusters, "")  # no [engines.llamacpp]: the default
    cluster.add_node("node-a")
    cluster.start_agent("node-a")

    llama = wait_llama(cluster, "node-a")
    assert llama["ok"], llama["detail"]
    assert (llama["version"], llama["state"]) == (pins.LLAMACPP_VERSION, "ok")
    # The release's build carries every CPU variant; the node names the one llama.cpp picks here,
    # as llama.cpp itself would (each backend's score), and it is no baseline on this machine.
    backend = trio.run(llama_cpu_backend, llama_server())
    assert backend not in ("", "built-in", "none", "x64"), backend
    assert (llama["cpu_backend"], llama["cpu_note"]) == (backend, "")

    # Fetched from the control plane's release, over the agent port, once.
    served = [e for e in cluster.server.events("release_served") if e["name"] == ARCHIVE]
    assert len(served) == 1 and served[0]["sha256"] == (tmp_path / "release" / "SHA256SUMS").read_text().split()[0]
    # Installed in the release's layout, switched in as the version in use, nothing built.
    node_dir = cluster.nodes_files["node-a"].state_dir
    current = node_dir / "engines" / "llamacpp" / "current"
    assert current.resolve().name == pins.LLAMACPP_VERSION
    top = ARCHIVE.removesuffix(".tar.gz")
    shipped = {p.name for p in (current / top).iterdir()}
    assert {"LICENSE", "llama-server", f"libggml-cpu-{backend}.so", "libggml-cpu-x64.so"} <= shipped
    agent = cluster.agents["node-a"]
    assert agent.events("engine_build_started") == [] and agent.events("engine_cpu_backend")[0]["cpu_backend"] == (
        backend
    )
    # No node needs llama.cpp's source: the control plane fetched none (this test uses no network).
    assert cluster.server.events("mirror_fetched") == cluster.server.events("mirror_fetch_failed") == []
    row = table_row(cluster, "node-a")
    assert f"llamacpp[{backend}],sim" in row and replicas_cell(cluster, "node-a") == "0"  # none yet

    # llama.cpp from the release serves a GGUF model.
    model = write_tiny_llama(tmp_path / "tiny.gguf")
    cluster.set_catalog(f'[[models]]\nname = "tiny"\nengine = "llamacpp"\nsource = {{ path = "{model}" }}\n')
    cluster.llmgw("ctl", "reload", "--state-dir", str(cluster.state))
    [replica] = cluster.wait_replicas(
        "the llama.cpp replica to be ready",
        lambda rs: len(rs) == 1 and rs[0]["state"] == "ready" and bool(rs[0]["port"]),
        timeout=READY_S,
    )
    answer = chat("127.0.0.1", replica["port"], cluster.engine_key(replica["replica"]))
    assert answer["choices"][0]["message"]["role"] == "assistant"
    assert replicas_cell(cluster, "node-a") == f"1: {replica['replica']}"

    # The page shows the backend under the node's engines.
    text = trio.run(page_shows_the_backend, cluster, "node-a", backend)
    assert f"llamacpp {pins.LLAMACPP_VERSION} (CPU backend: {backend})" in text

    # The drain as docs/node-onboarding.md tells it: drain, then `ctl nodes` until it holds none.
    # One node: nowhere to move the replica, so --force stops it.
    cluster.llmgw("ctl", "drain", "node-a", "--force", "--state-dir", str(cluster.state))
    wait_until(
        "node-a's REPLICAS to read 0",
        lambda: replicas_cell(cluster, "node-a") == "0",
        procs=cluster.latest(),
        timeout=READY_S,
        last_seen=lambda: table_row(cluster, "node-a"),
    )
    assert "cordoned" in table_row(cluster, "node-a")


def test_a_node_the_release_does_not_cover_and_without_a_compiler_joins_with_llamacpp_unavailable(
    tmp_path: Path, clusters: list[Cluster]
) -> None:
    # The release covers the other architecture only; the source to build from is named (here on a
    # port nothing serves: the node fails before it downloads anything) and so is `release`.
    source = f'{{ url = "http://127.0.0.1:9/llama.tar.gz", sha256 = "{"0" * 64}" }}'
    engines = f"[engines.llamacpp]\nrelease = true\nbuild = {source}\n"
    cluster = release_cluster(tmp_path, clusters, engines, arches=(OTHER_ARCH,))
    cluster.add_node("node-a")
    # The agent's PATH has the basics of a node (sh, nice) and no compiler, cmake or make.
    bare = tmp_path / "bare-bin"
    bare.mkdir()
    for tool in ("sh", "nice", "uname"):
        os.symlink(shutil.which(tool), bare / tool)
    cluster.start_agent("node-a", {"PATH": str(bare)})

    llama = wait_llama(cluster, "node-a")
    assert not llama["ok"] and llama["state"] == "unavailable"
    assert llama["detail"].startswith("this node cannot build llama.cpp: missing on the agent's PATH")
    assert "a C++ compiler" in llama["detail"] and "cmake" in llama["detail"]
    assert "apt-get install build-essential cmake" in llama["detail"]  # this machine is Debian
    nodes = cluster.nodes()
    assert nodes["node-a"]["state"] == "joined"  # not held back: sim is offered, the node serves
    assert any(e["name"] == "sim" and e["ok"] for e in nodes["node-a"]["engines"])
    out = cluster.llmgw("ctl", "nodes", "--state-dir", str(cluster.state)).stdout
    assert "llamacpp(unavailable),sim" in out
    assert f"node-a: llamacpp: unavailable: {llama['detail']}" in out.splitlines()
    # Nothing of the other architecture was fetched for this node.
    assert cluster.server.events("release_served") == []


FAKE_APT = """#!/bin/sh
# Records each call; `install` puts the recorded fabric's sminfo where agent.toml says it is.
echo "$*" >> {calls}
case "$1" in install) mkdir -p {sbin} && cp {sminfo} {sbin}/sminfo && chmod 755 {sbin}/sminfo ;; esac
"""


def test_agent_run_installs_infiniband_diags_for_a_declared_fabric_with_the_package_manager_on_its_path(
    tmp_path: Path, clusters: list[Cluster]
) -> None:
    cluster = Cluster(tmp_path)
    clusters.append(cluster)
    cluster.init_ca()
    cluster.start_server()
    sbin, calls = tmp_path / "sbin", tmp_path / "apt.calls"
    tools = tmp_path / "tools"
    tools.mkdir()
    for manager in ("apt-get", "dnf"):  # whichever family this machine is
        (tools / manager).write_text(FAKE_APT.format(calls=calls, sbin=sbin, sminfo=sminfo("one-fabric")))
        (tools / manager).chmod(0o755)
    cluster.add_node(
        "node-a",
        f'ib_root = "{ib_root("one-fabric")}"\nsminfo = "{sbin / "sminfo"}"\n'
        'fabrics = [{name = "ib-a", adapters = ["mlx5_0", "mlx5_1"]}]\n',
    )
    cluster.start_agent("node-a", {"PATH": f"{tools}{os.pathsep}{os.environ.get('PATH', '')}"})

    # sminfo installed, the declared fabric is identified by its subnet manager, and the node joins on it.
    node = cluster.wait_nodes(
        "node-a on ib-a",
        lambda ns: "node-a" in ns and ns["node-a"]["state"] == "joined" and bool(ns["node-a"]["fabrics"]),
    )["node-a"]
    assert [f["name"] for f in node["fabrics"]] == ["ib-a"] and node["fabric_problems"] == []
    assert calls.read_text().splitlines()[0].startswith("install -y ")
    assert "infiniband-diags" in calls.read_text().splitlines()[0]
    [said] = cluster.agents["node-a"].events("infiniband_diags")
    assert said["status"] == "installed" and str(sbin / "sminfo") in said["detail"]
