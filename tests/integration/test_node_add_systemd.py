"""`llmgw node add` on a real systemd machine: a Debian 12 root booted with systemd as its init
(testlib.machine: systemd-nspawn --boot, its own network namespace, a real sshd), not this
machine's programs in a namespace. What is tested is what an operator's node does: the unit is
written, enabled and started by systemctl; the agent comes back by itself after a reboot and
rejoins; a join that fails shows the journal; adding again restarts the unit; `node remove --ssh`
leaves it stopped and disabled, and it stays so across a reboot.

The node's llama.cpp is the llama-server `./pants test` builds, copied onto the machine; the
release is built from this checkout and runs on the machine's own python3 (Debian 12's).
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmgw.nodeadd import layout
from testlib.cluster import wait_until
from testlib.llama import llama_server_dir
from testlib.machine import Machine, copy_dir_in, preflight
from testlib.nodeadd import ControlPlane, build_release

HOSTNAME = "sysnode1"
LLAMA_DIR = "/opt/llama"
LLAMA = f"{LLAMA_DIR}/llama-server"
UNIT = layout.UNIT_NAME
REJOIN_TIMEOUT_S = 90


@pytest.fixture(scope="module")
def release_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_release(tmp_path_factory.mktemp("release"), "0.0.0-systemd")


@pytest.fixture()
def machine(tmp_path: Path) -> Iterator[Machine]:
    why = preflight()
    if why:
        pytest.fail(why)
    m = Machine(tmp_path / "machine", hostname=HOSTNAME)
    copy_dir_in(m, llama_server_dir(), LLAMA_DIR)  # llama-server and the libraries beside it
    m.start()
    try:
        yield m
    finally:
        m.stop()


@pytest.fixture()
def cp(tmp_path: Path, machine: Machine) -> Iterator[ControlPlane]:
    c = ControlPlane(tmp_path / "plane", machine, llamacpp_bin=LLAMA)
    try:
        yield c
    finally:
        c.stop()


def _me(cp: ControlPlane) -> dict:
    return cp.nodes()[HOSTNAME]


def _rejoined(cp: ControlPlane, before: float) -> bool:
    me = cp.nodes().get(HOSTNAME)
    return bool(me and me["connected"] and me["state"] == "joined" and me["agent_started_at"] != before)


def _engines(machine: Machine) -> list[str]:
    out = machine.run("ps", "-eo", "args", check=False).stdout
    return [line for line in out.splitlines() if "engine sim" in line or "llama-server --" in line]


def _report(name: str, text: str) -> None:
    """Left beside the JUnit reports (outside the sandbox), for docs/node-onboarding.md's numbers."""
    where = os.environ.get("LLMGW_TEST_REPORTS")
    if where:
        Path(where).mkdir(parents=True, exist_ok=True)
        (Path(where) / name).write_text(text)


def test_the_agent_is_an_enabled_unit_that_survives_reboots_a_re_add_and_is_stopped_by_node_remove(
    cp: ControlPlane, machine: Machine, release_dir: Path
) -> None:
    cp.run()
    started = time.monotonic()
    out = cp.added(release_dir)
    onboarding_s = time.monotonic() - started
    assert f"{layout.UNIT} (enabled)" in out and "no systemd on the node" not in out, out
    assert machine.systemctl("is-enabled", UNIT) == "enabled"
    assert machine.systemctl("is-active", UNIT) == "active"
    me = _me(cp)
    assert me["state"] == "joined" and me["address"] == machine.node_addr
    assert any(e["name"] == "llamacpp" and e["ok"] for e in me["engines"])
    wait_until(
        "the sim replica to be ready on the machine",
        lambda: any(r.get("state") == "ready" for r in cp.ctl("replicas")),
        alive=[cp.server],
        timeout=60,
    )

    # The unit is the one llmgw renders, and the node's own systemd accepts it as written.
    assert machine.path(layout.UNIT).read_text() == layout.systemd_unit()
    verify = machine.run("systemd-analyze", "verify", layout.UNIT, check=False)
    assert verify.returncode == 0 and verify.stderr.strip() == "", verify.stderr
    security = machine.run("systemd-analyze", "security", "--no-pager", UNIT, check=False).stdout
    level = re.search(r"Overall exposure level for \S+: ([0-9.]+) (\w+)", security)
    assert level is not None, security
    assert float(level.group(1)) <= 8.0, security  # 9.6 for the same unit with no sandboxing
    _report("systemd-analyze-security.txt", security)

    # A reboot: nothing but systemd starts the agent, which rejoins with the same identity.
    before = _me(cp)["agent_started_at"]
    started = time.monotonic()
    machine.reboot()
    wait_until("the agent to rejoin after the reboot", lambda: _rejoined(cp, before), timeout=REJOIN_TIMEOUT_S)
    rejoin_s = time.monotonic() - started
    measured = {"onboarding_s": onboarding_s, "reboot_to_rejoined_s": rejoin_s, "exposure": float(level[1])}
    _report("systemd-node.json", json.dumps({**{k: round(v, 1) for k, v in measured.items()}, "rating": level[2]}))
    assert machine.systemctl("is-active", UNIT) == "active"
    assert machine.systemctl("show", "-p", "NRestarts", "--value", UNIT) == "0"  # started at boot, not restarted

    # Adding again restarts the unit (a new agent process), still enabled.
    pid = machine.systemctl("show", "-p", "MainPID", "--value", UNIT)
    before = _me(cp)["agent_started_at"]
    rc, out, err = cp.node_add("--plain", release=release_dir)
    assert rc == 0, out + err
    assert machine.systemctl("show", "-p", "MainPID", "--value", UNIT) not in (pid, "0")
    assert machine.systemctl("is-enabled", UNIT) == "enabled"
    assert _rejoined(cp, before)

    # node remove --ssh: stopped and disabled, its engines stopped with it, and it stays down after a reboot.
    done = cp.llmgw(
        "node", "remove", HOSTNAME, "--state-dir", str(cp.state), "--ssh", machine.target,
        "-i", str(machine.client_key), "--known-hosts", str(cp.known_hosts), timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "stopped and disabled the agent" in done.stdout and "systemctl disable --now" in done.stdout
    assert machine.systemctl("is-enabled", UNIT) == "disabled"
    assert machine.systemctl("is-active", UNIT) == "inactive"
    assert _engines(machine) == []
    machine.reboot()
    assert machine.systemctl("is-active", UNIT) == "inactive"
    assert _engines(machine) == []


def test_a_join_that_fails_shows_the_journals_last_lines(cp: ControlPlane, machine: Machine, release_dir: Path) -> None:
    cp.run()
    rc, out, err = cp.node_add(
        "--plain", "--accept-new-host-key", "--llamacpp-bin", "/opt/llama/no-such-llama-server", release=release_dir
    )
    assert rc != 0
    failed = next(line for line in out.splitlines() if line.startswith("failed"))
    assert failed.startswith("failed join"), out
    assert f"journalctl -u {UNIT}" in out and "its last lines" in out, out
    # The lines are the node's journal: its hostname and the agent's own words are in them.
    tail = out[out.index("its last lines") :]
    assert f"{HOSTNAME} llmgw[" in tail, tail
    assert "/opt/llama/no-such-llama-server" in tail, tail
