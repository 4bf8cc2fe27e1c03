"""An engine is reachable only as intended: through the gateway, or with its own key on the one
address the gateway dials.

Real processes on loopback (`testlib.cluster`): `llmgw server`, one `llmgw agent run` dialling
the control plane from 127.0.0.7 (as a node dials from its address on the cluster network), and
the sim engine the agent starts. The engine listens on 127.0.0.7 only; its key is in no
process's argv and not in its environment, but in a 0600 file under the agent's state
directory; without the key it answers 401, with it 200, and the gateway serves through it. An
agent killed and started again adopts the engine with its address and its key file; the key
file goes when the engine stops.
"""

from __future__ import annotations

import http.client
import json
from pathlib import Path

import pytest

from testlib.cluster import Cluster, wait_until
from testlib.exposure import cmdlines_holding, listening

NODE_ADDRESS = "127.0.0.7"
CATALOG = """
[[models]]
name = "chat"
engine = "sim"
replicas = 1
"""
CLIENT_TIMEOUT_S = 10.0


def post(host: str, port: int, path: str, body: dict, key: str | None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection(host, port, timeout=CLIENT_TIMEOUT_S)
    headers = {"content-type": "application/json"}
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    try:
        conn.request("POST", path, body=json.dumps(body), headers=headers)
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"{}")
    finally:
        conn.close()


def mode(path: Path) -> int:
    return path.lstat().st_mode & 0o777


def test_an_engine_listens_on_the_nodes_address_only_and_takes_its_key_from_a_private_file(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, heartbeat_interval_s=0.5, heartbeat_ttl_s=15)
    try:
        cluster.init_ca()
        cluster.set_catalog(CATALOG)
        files = cluster.add_node("node-a", f'source_address = "{NODE_ADDRESS}"\n')
        server = cluster.start_server()
        first = cluster.start_agent("node-a")
        [ready] = cluster.wait_replicas("the replica ready", lambda rs: [r["state"] for r in rs] == ["ready"])
        rid, [pid], port = ready["replica"], ready["pids"], ready["port"]
        assert cluster.nodes()["node-a"]["address"] == NODE_ADDRESS

        # It listens where the gateway dials it, and nowhere else.
        assert listening(pid) == [(NODE_ADDRESS, port)]
        body = {"model": "chat", "prompt": "hello", "max_tokens": 4}
        with pytest.raises(ConnectionRefusedError):
            post("127.0.0.1", port, "/v1/completions", body, None)

        # Its key: in a file only root reads, in no argv, not in its environment.
        key_file = files.state_dir / "keys" / f"{rid}-r0" / "api-key"
        key = key_file.read_text().strip()
        assert (mode(key_file.parent.parent), mode(key_file.parent), mode(key_file)) == (0o700, 0o700, 0o600)
        assert cmdlines_holding(key) == []
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert argv[argv.index(b"--api-key-file") + 1] == str(key_file).encode()
        assert key.encode() not in Path(f"/proc/{pid}/environ").read_bytes()

        # Without its key the engine refuses; with it, and through the gateway, it answers.
        assert post(NODE_ADDRESS, port, "/v1/completions", body, None)[0] == 401
        assert post(NODE_ADDRESS, port, "/v1/completions", body, key + "x")[0] == 401
        status, answer = post(NODE_ADDRESS, port, "/v1/completions", body, key)
        assert status == 200 and answer["choices"][0]["text"], answer
        http_port = int(server.events("server_ready")[-1]["admin_url"].rsplit(":", 1)[1])
        token = cluster.ctl("keys", "create", "exposure")["token"]
        chat = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        status, answer = post("127.0.0.1", http_port, "/v1/chat/completions", chat, token)
        assert status == 200 and answer["choices"][0]["message"]["content"], answer

        # An agent killed and started again adopts the engine: same address, same key file.
        first.kill()
        second = cluster.start_agent("node-a")
        wait_until(
            "the adoption confirmed by the desired state",
            lambda: second.events("replica_adoption_confirmed"),
            procs=cluster.latest(),
            alive=[second],
        )
        [adopted] = second.events("replica_adopted")
        assert (adopted["pid"], adopted["host"], adopted["port"]) == (pid, NODE_ADDRESS, port)
        assert key_file.read_text().strip() == key
        status, answer = post("127.0.0.1", http_port, "/v1/chat/completions", chat, token)
        assert status == 200, answer

        # The model leaves the catalog: the adopted engine stops, and its key file goes with it.
        cluster.set_catalog("")
        cluster.ctl("reload")
        wait_until("the engine stopped", lambda: cluster.engine_pids("node-a") == [], procs=cluster.latest())
        wait_until("its key file removed", lambda: not key_file.parent.exists(), procs=cluster.latest())
        assert list((files.state_dir / "keys").iterdir()) == []
    finally:
        cluster.close()
