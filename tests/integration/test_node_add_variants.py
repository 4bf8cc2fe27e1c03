"""`llmgw node add` on nodes unlike the default one, end to end (testlib.nodeadd, testlib.netnode):

- a driver installed elsewhere: the fixture nvidia-smi at /opt/nvidia/bin, named with --nvidia-smi;
- a RHEL-family node: its os-release says rhel, its trust store is /etc/pki/ca-trust and its tool
  `update-ca-trust` (Debian does not package it: a stand-in that records its run and writes the
  bundle, at /usr/bin as on RHEL, overlaid on the node only);
- an operator whose key is only in an ssh-agent, reached the way the spec shows
  (`sudo --preserve-env=SSH_AUTH_SOCK llmgw node add ...`), with no key file anywhere.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from testlib.hardware import FIXTURES
from testlib.needs import program
from testlib.netnode import NetNode
from testlib.nodeadd import ADD_TIMEOUT_S, CATALOG, ControlPlane, new_node
from testlib.proc import llmgw_env
from testlib.sshagent import SshAgent
from testlib.sshd import fingerprint_of

# The node add tests' fixtures: release_dir, node and cp.
pytest_plugins = ("testlib.nodeadd",)

SMI = "/opt/nvidia/bin/nvidia-smi"
# A GPU node would be asked to install vLLM from PyPI: not here.
NO_VLLM = CATALOG + "\n[engines.vllm]\nenabled = false\n"
NOBODY = 65534  # the agent's owner: another user than the root that runs node add, as after `ssh -A`


def _started(node: NetNode):
    node.start()
    return node


def _ok_steps(out: str) -> list[str]:
    return [line.split()[1] for line in out.splitlines() if line.split()[:1] in (["ok"], ["warn"])]


def test_a_node_whose_nvidia_smi_is_elsewhere_passes_doctor_and_reports_its_gpus(
    tmp_path: Path, release_dir: Path
) -> None:
    node = _started(new_node(tmp_path / "node", overlays=("/opt",)))
    cp = ControlPlane(tmp_path, node, catalog=NO_VLLM)
    try:
        # The recorded nvidia-smi of an L4 VM, installed at a path no default names.
        card = FIXTURES / "nvidia-smi"
        node.write(SMI, (card / "l4").read_text())
        node.write("/opt/nvidia/bin/_answer", (card / "_answer").read_text())
        node.write("/opt/nvidia/bin/l4.csv", (card / "l4.csv").read_text())
        assert node.run("chmod", "0755", SMI, "/opt/nvidia/bin/_answer").returncode == 0
        cp.run()

        # A relative path is refused before anything is read or connected to.
        rc, out, err = cp.node_add("--plain", "--accept-new-host-key", "--nvidia-smi", "opt/nvidia/bin/nvidia-smi")
        assert rc == 2 and "--nvidia-smi takes an absolute path" in err, out + err
        assert node.connections() == 0

        # A path the node does not have stops the run before doctor, naming the flag and the fix.
        missing = "/opt/nvidia/sbin/nvidia-smi"
        rc, out, err = cp.node_add("--plain", "--accept-new-host-key", "--nvidia-smi", missing, release=release_dir)
        assert rc != 0 and "failed doctor" in out, out + err
        assert f"--nvidia-smi {missing}: {node.target} has no executable file at that path" in out, out
        assert "leave --nvidia-smi out for the default /usr/bin/nvidia-smi" in out
        assert [p for p in node.written() if "llmgw" in p] == []

        rc, out, err = cp.node_add("--plain", "--nvidia-smi", SMI, release=release_dir)
        assert rc == 0, out + err
        assert "failed" not in out and "ignored" not in out, out  # no --ignore-doctor needed
        doctor = next(line for line in out.splitlines() if line.split()[1:2] == ["doctor"])
        assert "GPUs: 1 x NVIDIA L4" in doctor, out  # the doctor run on the node looked there
        assert f"(nvidia-smi {SMI})" in out  # the configure step says what it wrote
        assert f'nvidia_smi = "{SMI}"' in node.read("/etc/llmgw/agent.toml").decode()
        me = cp.node_view()
        assert me["state"] == "joined"
        assert [g["name"] for g in me["gpus"]] == ["NVIDIA L4"], me["gpus"]
        table = cp.llmgw("ctl", "nodes", "--state-dir", str(cp.state))
        assert table.returncode == 0 and "1 x NVIDIA L4" in table.stdout, table.stdout + table.stderr
        started = me["agent_started_at"]

        # Added again without the flag: the path is kept (agent.toml and doctor), the GPU still seen.
        rc, out, err = cp.node_add("--plain", release=release_dir)
        assert rc == 0, out + err
        assert f'nvidia_smi = "{SMI}"' in node.read("/etc/llmgw/agent.toml").decode()
        me = cp.node_view()
        assert me["agent_started_at"] != started and [g["name"] for g in me["gpus"]] == ["NVIDIA L4"]
    finally:
        cp.stop()
        node.stop()


RHEL_OS_RELEASE = """NAME="Red Hat Enterprise Linux"
VERSION="9.4 (Plow)"
ID="rhel"
ID_LIKE="fedora"
VERSION_ID="9.4"
PRETTY_NAME="Red Hat Enterprise Linux 9.4 (Plow)"
"""
# What RHEL's update-ca-trust does, as far as node add can see: `extract` rebuilds the bundles
# from the anchors. This one records each run, then writes the PEM bundle.
UPDATE_CA_TRUST = """#!/bin/sh
echo "$*" >> /var/log/update-ca-trust.runs
[ "$1" = extract ] || { echo "update-ca-trust: only extract is known here" >&2; exit 2; }
mkdir -p /etc/pki/ca-trust/extracted/pem
cat /etc/pki/ca-trust/source/anchors/*.crt > /etc/pki/ca-trust/extracted/pem/tls-ca-bundle.pem
"""


def test_a_rhel_family_node_gets_the_root_in_its_anchors_and_update_ca_trust_run(
    tmp_path: Path, release_dir: Path
) -> None:
    node = _started(new_node(tmp_path / "node", overlays=("/usr/bin",)))
    cp = ControlPlane(tmp_path, node)
    try:
        node.write("/etc/os-release", RHEL_OS_RELEASE)  # replaces Debian's link into /usr/lib
        node.write("/usr/bin/update-ca-trust", UPDATE_CA_TRUST)
        made = node.run("sh", "-c", "chmod 0755 /usr/bin/update-ca-trust && mkdir -p /etc/pki/ca-trust/source/anchors")
        assert made.returncode == 0, made.stderr
        cp.run()
        out = cp.added(release_dir)
        assert "RHEL, Fedora, CentOS, Rocky, AlmaLinux trust store" in out, out
        assert "(/etc/pki/ca-trust/source/anchors/llmgw-ca.crt, update-ca-trust)" in out, out
        ca = (cp.state / "ca" / "ca.crt").read_bytes()
        assert node.read("/etc/pki/ca-trust/source/anchors/llmgw-ca.crt") == ca
        assert node.read("/var/log/update-ca-trust.runs").decode() == "extract\n"
        assert ca in node.read("/etc/pki/ca-trust/extracted/pem/tls-ca-bundle.pem")
        # Debian's store is left alone: the row is chosen by os-release, not by which tools exist.
        assert "/usr/local/share/ca-certificates/llmgw-ca.crt" not in node.written()
        assert cp.node_view()["state"] == "joined"
    finally:
        cp.stop()
        node.stop()


def test_the_key_only_in_an_ssh_agent_is_used_through_sudo_preserve_env(
    cp: ControlPlane, node: NetNode, release_dir: Path, tmp_path: Path
) -> None:
    sudo = program("sudo", "sudo")
    cp.run()
    agent = SshAgent(uid=NOBODY).start()
    try:
        agent.add(node.client_key)  # its file is deleted: the key exists only in the agent now
        fingerprint = fingerprint_of(node.client_key.with_suffix(".pub"))
        assert fingerprint in agent.listed()
        home = tmp_path / "empty-home"  # no ~/.ssh to fall back on
        home.mkdir()
        # As `ssh -A` leaves it: SSH_AUTH_SOCK in the operator's environment, which sudo resets.
        caller = llmgw_env({"SSH_AUTH_SOCK": str(agent.socket)})
        inner = ["env", f"PYTHONPATH={caller['PYTHONPATH']}", f"HOME={home}", sys.executable, "-m", "llmgw"]
        args = cp.node_add_argv("--plain", "--accept-new-host-key", release=release_dir, key_file=False)

        def node_add(*sudo_flags: str):
            return _run([sudo, *sudo_flags, *inner, *args], caller)

        # Plain sudo drops the socket: refused, and the message names both ways out.
        done = node_add()
        assert done.returncode != 0 and "failed connect" in done.stdout, done.stdout + done.stderr
        assert "no key files and no SSH agent (SSH_AUTH_SOCK is not set)" in done.stdout
        assert "ssh-copy-id" in done.stdout and "sudo --preserve-env=SSH_AUTH_SOCK llmgw node add" in done.stdout
        assert "Starting session" not in node.log_text()

        done = node_add("--preserve-env=SSH_AUTH_SOCK")
        assert done.returncode == 0, done.stdout + done.stderr
    finally:
        agent.stop()
    assert not node.client_key.exists() and list(home.iterdir()) == []
    assert f"Accepted publickey for root from {node.host_addr}" in node.log_text()
    assert fingerprint in node.log_text()
    assert cp.node_view()["state"] == "joined"


def _run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=ADD_TIMEOUT_S, check=False)


@pytest.fixture(autouse=True)
def _no_operator_agent(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the agent a test starts is offered: not the one of whoever runs the tests."""
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
