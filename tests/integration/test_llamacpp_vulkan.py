"""llama.cpp's Vulkan build from the control plane's release, on a real cluster on loopback, run on
Mesa's software Vulkan device (lavapipe, from Debian's mesa-vulkan-drivers).

The release directory holds this machine's CPU archive and its Vulkan archive (the CPU build's
files and libggml-vulkan.so, as `./pants test` built them: testlib.llamavulkan) with their
SHA256SUMS. The node's agent.toml forces `llamacpp_backend = "vulkan"` (lavapipe is a software
device: left to "auto", the node takes the CPU build); the agent fetches the Vulkan archive,
installs it beside where the CPU build would go, and serves a made GGUF with it. llama.cpp itself
passes over software devices unless GGML_VK_VISIBLE_DEVICES names them: the agent, forced to
Vulkan on a node whose only Vulkan device is lavapipe, names it in its engines' environment. A chat
completion through the gateway answers the crafted model's known greedy text (testlib.makegguf,
cycle=True), and llama-server's log (at -lv 4, from the catalog's args) says every layer went to
the Vulkan device, llvmpipe.
"""

from __future__ import annotations

import http.client
import json
import subprocess
from pathlib import Path

from agent.discovery.vulkan import parse_summary
from agent.replica_logs import log_path
from llmgw import pins
from llmgw.llamarecipe import VULKAN_MODULE
from testlib.cluster import Cluster, measure_speed_off, wait_until
from testlib.llamavulkan import release_dir, vulkan_archive
from testlib.makegguf import cycle_text, make_gguf

INSTALL_S = 120.0  # fetch, unpack and the checks, on a loaded 2-core machine
READY_S = 120.0  # placement, the start, and the model's load through lavapipe (its shaders compiled on the CPU)
TOKENS = 6


def lavapipe_index() -> int:
    """Lavapipe's number as the Vulkan loader enumerates devices (vulkaninfo's GPU number)."""
    done = subprocess.run(["vulkaninfo", "--summary"], capture_output=True, text=True, timeout=60)
    devices = parse_summary(done.stdout)
    software = [d.index for d in devices if d.software]
    assert software, f"no software Vulkan device (lavapipe, mesa-vulkan-drivers) here:\n{done.stdout}{done.stderr}"
    return software[0]


def chat_through_gateway(port: int, token: str) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": TOKENS, "temperature": 0}
    try:
        conn.request(
            "POST",
            "/v1/chat/completions",
            json.dumps(body),
            {"content-type": "application/json", "authorization": f"Bearer {token}"},
        )
        response = conn.getresponse()
        data = json.loads(response.read() or b"null")
        assert response.status == 200, data
        return data
    finally:
        conn.close()


def test_a_node_forced_to_vulkan_serves_through_the_gateway_on_lavapipe(tmp_path: Path) -> None:
    archive = vulkan_archive()
    release = release_dir(tmp_path / "release")
    cluster = Cluster(tmp_path, engines_toml=measure_speed_off(f'[release]\ndir = "{release}"\n'))
    try:
        cluster.init_ca()
        server = cluster.start_server()
        files = cluster.add_node("node-a", agent_toml='llamacpp_backend = "vulkan"\n')
        agent = cluster.start_agent("node-a")

        def settled() -> dict | None:
            node = (cluster.nodes() or {}).get("node-a")
            if node is None or node["state"] != "joined":
                return None
            llama = next((e for e in node["engines"] if e["name"] == "llamacpp"), None)
            return llama if llama is not None and llama["state"] != "installing" else None

        llama = wait_until(
            "node-a to report llama.cpp installed or not",
            settled,
            procs=cluster.latest(),
            alive=[cluster.server],
            timeout=INSTALL_S,
            last_seen=lambda: cluster.last_nodes,
        )
        assert llama["ok"], llama["detail"]
        assert (llama["version"], llama["state"]) == (pins.LLAMACPP_VERSION, "ok")
        # llama.cpp passes over software devices: the agent named lavapipe to its engines.
        [named] = agent.events("engine_environment")
        assert named["GGML_VK_VISIBLE_DEVICES"] == str(lavapipe_index()), named
        # The Vulkan archive was served (not the CPU one), and installed as its own flavor.
        served = [e["name"] for e in server.events("release_served")]
        assert served == [archive.name], served
        current = files.state_dir / "engines" / "llamacpp" / "current"
        assert current.resolve().name == f"{pins.LLAMACPP_VERSION}-vulkan"
        top = archive.name.removesuffix(".tar.gz")
        assert (current / top / VULKAN_MODULE).is_file()

        # A made model whose greedy answer is known, served by the Vulkan build.
        model = make_gguf(tmp_path / "m.gguf", n_layer=2, n_embd=64, n_head=4, dtype="F32", cycle=True)
        cluster.set_catalog(
            f'[[models]]\nname = "tiny"\nengine = "llamacpp"\nsource = {{ path = "{model}" }}\nargs = ["-lv", "4"]\n'
        )
        cluster.llmgw("ctl", "reload", "--state-dir", str(cluster.state))
        [replica] = cluster.wait_replicas(
            "the llama.cpp replica on Vulkan to be ready",
            lambda rs: len(rs) == 1 and rs[0]["state"] == "ready" and bool(rs[0]["port"]),
            timeout=READY_S,
        )
        http_port = int(server.events("server_ready")[-1]["admin_url"].rsplit(":", 1)[1])
        answer = chat_through_gateway(http_port, cluster.ctl("keys", "create", "vulkan")["token"])
        assert answer["choices"][0]["message"]["content"] == cycle_text(TOKENS), answer

        # llama-server loaded the Vulkan backend, found lavapipe and put the model's layers on it.
        text = log_path(files.state_dir / "logs", replica["replica"], 0).read_text(errors="replace")
        assert "llvmpipe" in text, text[-3000:]
        offloaded = [line for line in text.splitlines() if "offloaded" in line and "layers to GPU" in line]
        assert offloaded, text[-3000:]
        done, total = offloaded[-1].split("offloaded", 1)[1].split("layers", 1)[0].strip().split("/")
        assert int(done) == int(total) > 0, offloaded
    finally:
        cluster.close()
