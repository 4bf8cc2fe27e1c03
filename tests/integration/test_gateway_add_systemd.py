"""`llmgw gateway add` on a real systemd machine (testlib.machine: a Debian 12 root booted with
systemd-nspawn, its own network namespace, a real sshd), against a control plane and a local
agent serving a sim model on this machine's side of the link.

What an operator's gateway machine does is what is tested: the release is fetched by the machine
from the control plane, the gateway's user, key and certificate are made, the unit is written,
enabled and started by systemctl and runs under its sandbox as that user, the control plane lists
its two workers linked, and a chat completion sent to the machine's port is answered 200 by the
model behind it. Adding again converges (the certificate kept, the unit restarted, new workers
linked); `llmgw gateway remove --ssh` revokes the certificate (the control plane closes the
links), leaves the unit stopped and disabled, and the gateway cannot link again.
"""

from __future__ import annotations

import http.client
import json
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmgw.nodeadd.gateway import layout
from testlib.cluster import wait_until
from testlib.machine import Machine, machine_fixture
from testlib.marked import MARKER_ENV, kill_groups, marked_pids
from testlib.nodeadd import ADD_TIMEOUT_S, ControlPlane
from testlib.proc import Proc

# The node add tests' fixtures: release_dir, node and cp.
pytest_plugins = ("testlib.nodeadd",)

HOSTNAME = "gw1"
UNIT = layout.UNIT_NAME
PORT = 8080
MODEL = "sim-small"  # testlib.nodeadd.CATALOG's
READY_TIMEOUT_S = 120  # placement, the sim engine's start and its health checks, on a loaded machine
MARKER = "gateway-add-local-node"


machine = machine_fixture(HOSTNAME)


@pytest.fixture()
def cp(tmp_path: Path, machine: Machine, release_dir: Path) -> Iterator[ControlPlane]:
    c = ControlPlane(tmp_path / "plane", machine, llamacpp_bin=None)
    c.add_config(f'[release]\ndir = "{release_dir}"\n')
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture()
def local_node(tmp_path: Path, cp: ControlPlane, machine: Machine) -> Iterator[Path]:
    """After `cp.run()`: a node on this machine's side of the link (its agent dials from
    `host_addr`, so its engines listen there, where the gateway's machine reaches them)."""
    root = tmp_path / "local-node"
    root.mkdir()
    yield root
    kill_groups(marked_pids(MARKER))


def _start_local_agent(cp: ControlPlane, machine: Machine, root: Path) -> Proc:
    config = root / "agent.toml"
    config.write_text(
        f'server = "wss://{machine.host_addr}:7443"\nnode_id = "local-node"\nstate_dir = "{root / "state"}"\n'
        f'source_address = "{machine.host_addr}"\n'
    )
    for args in (
        ["agent", "csr", "--config", str(config)],
        ["ca", "issue", "local-node", "--config", str(cp.config), "--csr", str(root / "state/pki/node.csr"),
         "--out", str(root / "state/pki/node.crt")],
    ):  # fmt: skip
        done = cp.llmgw(*args)
        assert done.returncode == 0, done.stdout + done.stderr
    shutil.copy(cp.state / "ca" / "ca.crt", root / "state/pki/ca.crt")
    return Proc("agent", ["agent", "run", "--config", str(config), "--log-format", "json"], root / "agent.log",
                {MARKER_ENV: MARKER})  # fmt: skip


def _gateway_add(cp: ControlPlane, machine: Machine, *extra: str) -> tuple[int, str, str]:
    done = cp.llmgw(
        "gateway", "add", machine.target, "--config", str(cp.config), "--known-hosts", str(cp.known_hosts),
        "-i", str(machine.client_key), "--join-timeout", "120", "--plain", *extra,
        timeout=ADD_TIMEOUT_S,
    )  # fmt: skip
    return done.returncode, done.stdout, done.stderr


def _linked(cp: ControlPlane) -> list[dict]:
    """The gateway instances the control plane lists now (GET /admin/v1/gateways)."""
    from llmgw.ctl.client import AdminClient

    admin = AdminClient.locate(server=None, credential=None, state_dir=str(cp.state))
    return [g for g in admin.gateways() if g["name"] == HOSTNAME]


def _chat(machine: Machine, token: str) -> tuple[int, dict]:
    conn = http.client.HTTPConnection(machine.node_addr, PORT, timeout=30)
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
        conn.request(
            "POST",
            "/v1/chat/completions",
            json.dumps(body),
            {"authorization": f"Bearer {token}", "content-type": "application/json"},
        )
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"{}")
    finally:
        conn.close()


def _answered(machine: Machine, token: str) -> tuple[int, dict] | None:
    try:
        status, body = _chat(machine, token)
    except OSError:
        return None
    return (status, body) if status == 200 else None


def test_a_machine_becomes_a_gateway_that_answers_then_converges_and_is_removed(
    cp: ControlPlane, machine: Machine, local_node: Path
) -> None:
    assert not machine.path(layout.STATE_DIR).exists()
    cp.run()
    agent = _start_local_agent(cp, machine, local_node)
    token = cp.ctl("keys", "create", "gw-test")["token"]

    # `llmgw gateway add root@ADDR --workers 2`: the release from the plane, the rest from the machine.
    started = time.monotonic()
    rc, out, err = _gateway_add(cp, machine, "--accept-new-host-key", "--workers", "2")
    add_s = time.monotonic() - started
    assert rc == 0, out + err
    lines = {line.split()[1]: line for line in out.splitlines() if line.startswith(("ok", "warn"))}
    assert list(lines) == ["authority", "connect", "identify", "address", "ship", "install", "identity",
                           "configure", "start", "join"], out  # fmt: skip
    assert "gateway 'gw1' (its hostname), x86_64, systemd" in lines["identify"], out
    assert "fetched by the machine from the control plane" in lines["ship"] and "it runs there: llmgw " in out, out
    assert "issued CN=gw1 (gateway role) for a new key" in lines["identity"], out
    assert "linked: 2 worker(s) of gateway 'gw1' connected from " + machine.node_addr in lines["join"], out
    print(f"gateway add: {add_s:.1f} s")

    # The unit runs as the gateway's user, enabled, its key that user's own and 0600.
    assert machine.systemctl("is-enabled", UNIT) == "enabled" and machine.systemctl("is-active", UNIT) == "active"
    pid = machine.systemctl("show", "-p", "MainPID", "--value", UNIT)
    assert machine.run("ps", "-o", "user=", "-p", pid).stdout.strip() == layout.USER
    key = machine.run("stat", "-c", "%U %a", f"{layout.PKI_DIR}/gateway.key").stdout.split()
    assert key == [layout.USER, "600"]
    assert machine.path(layout.UNIT).read_text() == layout.systemd_unit(
        server=f"wss://{machine.host_addr}:7443", listen=f"0.0.0.0:{PORT}", workers="2", name=HOSTNAME
    )
    security = machine.run("systemd-analyze", "security", "--no-pager", UNIT, check=False).stdout
    level = re.search(r"Overall exposure level for \S+: ([0-9.]+) (\w+)", security)
    assert level is not None, security
    assert float(level.group(1)) <= 3.0, security
    print(f"systemd-analyze security {UNIT}: {level.group(1)} {level.group(2)}")
    linked = _linked(cp)
    assert len(linked) == 2 and {g["address"] for g in linked} == {machine.node_addr}, linked

    # The model behind it answers through the machine's port.
    wait_until(
        "the sim replica to be ready",
        lambda: any(r["state"] == "ready" for r in cp.replicas()),
        alive=[cp.server, agent],
        timeout=READY_TIMEOUT_S,
    )
    status, body = wait_until(
        "a chat completion through the gateway",
        lambda: _answered(machine, token),
        alive=[cp.server, agent],
        timeout=30,
        last_seen=lambda: machine.journal(UNIT, 20),
    )
    assert status == 200 and body["choices"][0]["message"]["content"], body

    # Adding again converges: the same certificate, the unit restarted, new workers linked.
    before = {g["instance"] for g in linked}
    rc, out, err = _gateway_add(cp, machine, "--workers", "2")
    assert rc == 0, out + err
    assert "kept its certificate (serial " in out and "; new install" not in out, out
    assert f"the same as {layout.BIN} there" in out, out
    assert machine.systemctl("show", "-p", "MainPID", "--value", UNIT) not in (pid, "0")
    again = wait_until("the restarted workers alone listed", lambda: (g := _linked(cp)) and len(g) == 2 and g)
    assert not before & {g["instance"] for g in again}
    assert _answered(machine, token) is not None

    # Removed: its certificate revoked and its links closed; the unit stopped and disabled; no way back.
    serial = again[0]["cert_serial"]
    done = cp.llmgw(
        "gateway", "remove", HOSTNAME, "--state-dir", str(cp.state), "--ssh", machine.target,
        "-i", str(machine.client_key), "--known-hosts", str(cp.known_hosts), timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"revoked certificate serials: {serial}" in done.stdout, done.stdout
    assert f"stopped and disabled {UNIT}" in done.stdout, done.stdout
    assert machine.systemctl("is-enabled", UNIT) == "disabled"
    assert machine.systemctl("is-active", UNIT) == "inactive"
    assert _linked(cp) == []
    machine.run("systemctl", "start", UNIT)  # by hand: its certificate no longer links
    wait_until(
        "the control plane to refuse the revoked gateway",
        lambda: "revoked" in machine.journal(UNIT, 40),
        timeout=60,
    )
    assert _linked(cp) == []
