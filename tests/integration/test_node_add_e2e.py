"""`llmgw node add` end to end, with real parts only: a real `llmgw server`, a release built from
this checkout the way `release:build` builds it, and a node that is a separate host as far as
the network goes (testlib.netnode: its own network namespace, address and hostname, a real
sshd, a fresh empty home, and /etc, /usr/local and /var overlaid so that what node add writes
there can be inspected and is thrown away afterwards).

The node's llama.cpp is the real llama-server `./pants test` builds before the tests run
(tools/llama/build-llama-server), mounted on the node at /mnt and named with --llamacpp-bin; the
model served is a sim model. The node's programs are this machine's (/usr is shared): what the
tests need of them (sshd, sudo, useradd, curl, python3) `./pants test` installs first.
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

from cryptography import x509

from llmgw.pki.ca import cert_info
from testlib.cluster import wait_until
from testlib.needs import program
from testlib.netnode import NetNode
from testlib.nodeadd import ControlPlane, ServedRelease, events, outcomes

# The node add tests' fixtures: release_dir, node and cp.
pytest_plugins = ("testlib.nodeadd",)

IB_CASE = "one-fabric"  # tests/fixtures/ib: two active adapters behind one subnet manager
IB_IDENTITY = "ib-sm:0x0002c90300a1b2c3"  # the subnet manager GUID the fixture's sminfo answers


def _chat(url: str, key: str) -> dict:
    body = json.dumps({"model": "sim-small", "messages": [{"role": "user", "content": "hello"}]}).encode()
    request = urllib.request.Request(
        f"{url}/v1/chat/completions", data=body, headers={"Authorization": f"Bearer {key}"}
    )
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never through a proxy
    with direct.open(request, timeout=30) as response:
        return json.loads(response.read())


def _not_sshd(node: NetNode) -> list[str]:
    return [line for line in node.processes() if "sshd" not in line]


def _agents_running(node: NetNode) -> list[str]:
    return [line for line in node.processes() if " agent run " in line or " agent supervise " in line]


def test_node_add_joins_serves_is_idempotent_and_node_remove_stops_it(
    cp: ControlPlane, node: NetNode, release_dir: Path
) -> None:
    cp.run()
    rc, out, err = cp.node_add("--plain", "--accept-new-host-key", release=release_dir)
    assert rc == 0, out + err
    lines = [line.split()[:2] for line in out.splitlines() if line.split()[:1] in (["ok"], ["warn"])]
    assert [step for _, step in lines] == [
        "authority", "connect", "identify", "address", "ship", "doctor",
        "fabrics", "identity", "trust", "configure", "start", "join",
    ]  # fmt: skip
    assert "node id 'node" in out and f"wss://{node.host_addr}:7443" in out
    # No systemd in the namespace: the fallback supervisor, said by the step, and doctor's warning.
    assert "no systemd on the node" in out and "service-manager" in out
    # The trust store comes from the table row for the node's os-release (Debian here), not from the node's word.
    assert (
        "Debian, Ubuntu trust store" in out
        and "(/usr/local/share/ca-certificates/llmgw-ca.crt, update-ca-certificates)" in out
    )

    # Joined in `ctl nodes`, llama.cpp checked, and the sim replica answers through the gateway.
    nodes = {n["id"]: n for n in cp.ctl("nodes")}
    me = nodes[node.hostname]
    assert me["state"] == "joined" and me["address"] == node.node_addr
    assert any(e["name"] == "llamacpp" and e["ok"] for e in me["engines"])
    url = cp.server.events("server_ready")[-1]["admin_url"]
    key = cp.ctl("keys", "create", "e2e")["token"]
    wait_until(
        "the sim replica to be ready",
        lambda: any(r.get("state") == "ready" for r in cp.replicas()),
        alive=[cp.server],
        timeout=60,
    )
    assert _chat(url, key)["model"] == "sim-small"

    # What is on the node: the files the docs name, the certificate for its hostname.
    assert node.read("/etc/llmgw/agent.toml").decode().count("server = ") == 1
    first_cert = node.read("/var/lib/llmgw-agent/pki/node.crt")
    assert cert_info(x509.load_pem_x509_certificate(first_cert)).common_name == node.hostname
    assert node.read("/usr/local/share/ca-certificates/llmgw-ca.crt") == (cp.state / "ca" / "ca.crt").read_bytes()
    known = cp.known_hosts.read_text().splitlines()
    assert len(known) == 1 and known[0].startswith(node.node_addr)
    started_before = me["agent_started_at"]

    # Again, cordoned, with --json: converges, keeps the identity, restarts the agent, counts the
    # restarted agent's heartbeat as the join.
    cp.ctl("cordon", node.hostname)
    rc, out, err = cp.node_add("--json", release=release_dir)
    assert rc == 0, out + err
    done = outcomes(out)
    assert done["join"] == "ok" and done["identity"] == "ok", out
    said = {e["step"]: e["detail"] for e in events(out) if e["status"] != "started"}
    assert "kept its certificate" in said["identity"]
    assert "the same as /usr/local/bin/llmgw" in said["ship"]
    assert "cordoned" in said["join"]
    assert json.loads(out.splitlines()[-1])["added"] == node.hostname
    assert node.read("/var/lib/llmgw-agent/pki/node.crt") == first_cert
    assert cp.known_hosts.read_text().splitlines() == known
    me = {n["id"]: n for n in cp.ctl("nodes")}[node.hostname]
    assert me["agent_started_at"] != started_before and me["state"] == "joined"
    assert len(_agents_running(node)) == 2, _agents_running(node)  # one supervisor, one agent: nothing doubled

    # Remove, stopping the agent over SSH.
    done = cp.llmgw(
        "node", "remove", node.hostname, "--state-dir", str(cp.state), "--ssh", node.target,
        "-i", str(node.client_key), "--known-hosts", str(cp.known_hosts), timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "stopped and disabled the agent" in done.stdout
    assert node.hostname not in {n["id"] for n in cp.ctl("nodes")}
    # Nothing of llmgw runs there any more: not the supervisor, the agent, nor the sim engine it ran.
    deadline = time.monotonic() + 20
    while _not_sshd(node) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _not_sshd(node) == []


def test_a_missing_authority_is_said_before_any_ssh_connection(cp: ControlPlane, node: NetNode) -> None:
    rc, out, err = cp.node_add("--plain", "--accept-new-host-key")
    assert rc != 0
    assert out.splitlines()[0].startswith("failed authority"), out
    assert "llmgw ca init" in out
    assert node.connections() == 0, node.log_text()
    assert not cp.known_hosts.exists()


def test_a_doctor_failure_changes_nothing_on_the_node(cp: ControlPlane, node: NetNode, release_dir: Path) -> None:
    cp.run()
    # A typo in --fabric: the node has no such adapter, which doctor's fabrics check refuses.
    rc, out, err = cp.node_add("--plain", "--accept-new-host-key", "--fabric", "ib-a:mlx5_9", release=release_dir)
    assert rc != 0, out
    assert "failed doctor" in out and "mlx5_9" in out and "--ignore-doctor fabrics" in out, out
    assert "Nothing was changed on the node" in out
    assert "Starting session" in node.log_text()  # it did run things there: doctor
    written = [p for p in node.written() if "llmgw" in p]
    assert written == [], written  # nor a stage left in /tmp
    assert node.hostname not in {n["id"] for n in cp.ctl("nodes")}

    # --ignore-doctor: the check runs and is shown, but no longer stops the run.
    rc, out, err = cp.node_add("--plain", "--fabric", "ib-a:mlx5_9", "--ignore-doctor", "fabrics", release=release_dir)
    assert rc == 0, out + err
    assert "ignored: fabrics" in out
    assert node.hostname in {n["id"] for n in cp.ctl("nodes")}


def test_an_unknown_host_key_is_not_trusted_without_a_yes(cp: ControlPlane, node: NetNode, release_dir: Path) -> None:
    cp.run()
    rc, out, err = cp.node_add("--plain", release=release_dir)
    assert rc != 0
    assert "failed connect" in out and "SHA256:" in out and "--accept-new-host-key" in out, out
    assert not cp.known_hosts.exists() or cp.known_hosts.read_text() == ""
    assert "Starting session" not in node.log_text()


def test_a_sudo_login_a_release_fetched_by_the_node_and_a_reissue(
    cp: ControlPlane, node: NetNode, release_dir: Path
) -> None:
    # The node's programs are this machine's: without sudo, node add would stop at identify for that
    # reason instead of the one this test is about.
    program("sudo", "sudo")
    program("useradd", "passwd")
    cp.run()
    # A password of "*" (none works) rather than useradd's "!", which sshd takes for a locked account.
    made = node.run(
        "useradd", "--create-home", "--home-dir", "/var/lib/ubuntu-home", "--shell", "/bin/sh", "--password", "*", "ubuntu"
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    served = ServedRelease(node, release_dir)
    try:
        url = served.url

        # Without passwordless sudo: stopped at identify, with the line that would allow it.
        rc, out, err = cp.node_add("--plain", "--accept-new-host-key", release=url, login="ubuntu")
        assert rc != 0 and "failed identify" in out and "NOPASSWD" in out, out + err
        assert [p for p in node.written() if "llmgw" in p] == []

        allow = node.run("sh", "-c", "echo 'ubuntu ALL=(ALL) NOPASSWD: ALL' > /etc/sudoers.d/ubuntu")
        assert allow.returncode == 0, allow.stderr
        rc, out, err = cp.node_add("--plain", release=url, login="ubuntu")
        assert rc == 0, out + err
        assert f"fetched by the node from {url}llmgw-0.0.0-e2e-linux-amd64.pyz" in out
        first_cert = node.read("/var/lib/llmgw-agent/pki/node.crt")

        # --reissue: a new key and certificate, and the old one revoked.
        rc, out, err = cp.node_add("--json", "--reissue", release=url, login="ubuntu")
        assert rc == 0, out + err
        said = {e["step"]: e["detail"] for e in events(out) if e["status"] != "started"}
        assert "issued CN=node" in said["identity"] and "a new key" in said["identity"], said
        assert "revoked the previous one" in said["identity"]
        assert node.read("/var/lib/llmgw-agent/pki/node.crt") != first_cert
        me = {n["id"]: n for n in cp.ctl("nodes")}[node.hostname]
        assert me["state"] == "joined"
    finally:
        served.stop()
