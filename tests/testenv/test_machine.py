"""The systemd test machine (testlib.machine) is a real one: systemd is its init, sshd takes a key
login over its own network, what is enabled comes back after a reboot and what is not does not,
and stopping it leaves nothing behind on this machine."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from testlib.machine import Machine, machine_fixture, preflight
from testlib.proc import llmgw_env

UNIT = """[Unit]
Description=a test unit
[Service]
ExecStart=/bin/sleep infinity
[Install]
WantedBy=multi-user.target
"""


machine = machine_fixture("testbox7")


def _ssh(m: Machine, command: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            "ssh",
            "-i",
            str(m.client_key),
            "-o",
            "StrictHostKeyChecking=no",
            "-o",
            "UserKnownHostsFile=/dev/null",
            "-o",
            "BatchMode=yes",
            m.target,
            command,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_systemd_is_its_init_and_sshd_takes_a_key_login_over_its_own_network(machine: Machine) -> None:
    assert machine.run("cat", "/proc/1/comm").stdout.strip() == "systemd"
    done = _ssh(machine, "hostname; . /etc/os-release; echo $VERSION_ID; ip -4 -o addr show dev eth0")
    assert done.returncode == 0, done.stderr
    hostname, version, addr = done.stdout.splitlines()
    assert (hostname, version) == ("testbox7", "12")
    assert f"{machine.node_addr}/30" in addr
    assert machine.systemctl("is-active", "ssh.service") == "active"


def test_an_enabled_unit_comes_back_after_a_reboot_and_a_started_one_does_not(machine: Machine) -> None:
    for name in ("kept", "passing"):
        machine.path(f"/etc/systemd/system/{name}.service").write_text(UNIT)
    machine.run("systemctl", "daemon-reload")
    machine.run("systemctl", "enable", "--now", "kept.service")
    machine.run("systemctl", "start", "passing.service")
    assert machine.systemctl("is-active", "kept.service", "passing.service").split() == ["active", "active"]
    before = machine.run("cat", "/proc/sys/kernel/random/boot_id").stdout

    machine.reboot()

    assert machine.boots == 2
    assert machine.run("cat", "/proc/sys/kernel/random/boot_id").stdout != before
    assert machine.systemctl("is-active", "kept.service", "passing.service").split() == ["active", "inactive"]


def test_stopping_it_leaves_no_process_namespace_or_mount(tmp_path: Path) -> None:
    why = preflight()
    if why:
        pytest.fail(why)
    m = Machine(tmp_path / "m")
    m.start()
    leader = m.leader()
    assert leader is not None
    m.stop()
    assert not Path(f"/proc/{leader}").exists()
    assert m.net.name not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert str(m.merged) not in Path("/proc/self/mounts").read_text()


ORPHAN = """
import os, sys
from pathlib import Path
from testlib.machine import Machine
m = Machine(Path(sys.argv[1]))
m.start()
print(m._nspawn.pid, m.net.name, flush=True)
os._exit(0)  # as a test killed by a timeout: nothing stops the machine
"""


def test_a_machine_whose_test_dies_powers_off(tmp_path: Path) -> None:
    why = preflight()
    if why:
        pytest.fail(why)
    done = subprocess.run(
        [sys.executable, "-c", ORPHAN, str(tmp_path / "m")],
        capture_output=True,
        text=True,
        timeout=120,
        env=llmgw_env(),  # this process's sys.path: testlib, under Pants too
    )
    assert done.returncode == 0, done.stderr
    pid, netns = done.stdout.split()
    try:
        deadline = time.monotonic() + 30
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not Path(f"/proc/{pid}").exists(), "systemd-nspawn outlived the process that started it"
    finally:
        subprocess.run(["umount", "--lazy", str(tmp_path / "m" / "merged")], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", netns], capture_output=True, timeout=30)
