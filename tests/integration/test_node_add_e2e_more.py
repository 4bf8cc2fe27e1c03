"""`llmgw node add` end to end, the second half of test_node_add_e2e.py's cases (the same real
parts: a real `llmgw server`, a release built from this checkout, a node in a network namespace of
its own with a real sshd, llama-server mounted at /mnt): the terminal's checklist, damaged files,
joins that do not finish, hostnames taken or hostile, adapter groups, an upgrade. A file of its
own so that the two halves run side by side (each is a couple of minutes of node adds, and the
first `./pants test` runs them after llama.cpp's build)."""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

from testlib.hardware import ib_root, sminfo
from testlib.netnode import NetNode
from testlib.nodeadd import ADD_TIMEOUT_S, ControlPlane, ServedRelease, build_release
from testlib.sshd import fingerprint_of
from testlib.terminal import Terminal, words

# The node add tests' fixtures: release_dir, node and cp.
pytest_plugins = ("testlib.nodeadd",)

IB_CASE = "one-fabric"  # tests/fixtures/ib: two active adapters behind one subnet manager
IB_IDENTITY = "ib-sm:0x0002c90300a1b2c3"  # the subnet manager GUID the fixture's sminfo answers


def test_in_a_terminal_the_checklist_asks_for_the_host_key(
    cp: ControlPlane, node: NetNode, release_dir: Path, tmp_path: Path
) -> None:
    cp.run()
    argv = [
        sys.executable, "-m", "llmgw", "node", "add", node.target, "--config", str(cp.config),
        "-i", str(node.client_key), "--known-hosts", str(cp.known_hosts), "--release", str(release_dir),
        "--llamacpp-bin", "/mnt/llama-server", "--join-timeout", "120",
    ]  # fmt: skip
    term = Terminal(tmp_path, argv, timeout_s=60)
    try:
        term.wait_for(f"llmgw node add {node.target}", fingerprint_of(node.host_key.with_suffix(".pub")))
        assert "[ok] read the certificate authority" in term.screen()
        term.keys("y")
        assert term.wait_exit(timeout_s=ADD_TIMEOUT_S) == 0, term.scrollback()
        shown = words(term.scrollback())
        assert words(f"node {node.hostname} joined") in shown
        assert words("ok wait for the node to join and install llama.cpp") in shown  # the summary left behind
    finally:
        term.close()
    assert len(cp.known_hosts.read_text().splitlines()) == 1
    assert {n["id"]: n for n in cp.ctl("nodes")}[node.hostname]["state"] == "joined"


def test_a_file_that_arrives_damaged_is_never_run(
    cp: ControlPlane, node: NetNode, release_dir: Path, tmp_path: Path
) -> None:
    cp.run()
    damaged = tmp_path / "damaged"
    shutil.copytree(release_dir, damaged)
    pyz = next(damaged.glob("*.pyz"))
    pyz.write_bytes(pyz.read_bytes() + b"tampered")  # SHA256SUMS still lists the released bytes
    served = ServedRelease(node, damaged)
    try:
        rc, out, err = cp.node_add("--plain", "--accept-new-host-key", release=served.url)
    finally:
        served.stop()
    assert rc != 0
    assert "failed ship" in out and "arrived with sha256" in out and "nothing ran it" in out, out
    assert [line.split()[1] for line in out.splitlines()][-1] == "ship"  # it stopped there: doctor never ran
    assert [p for p in node.written() if "llmgw" in p] == []


def test_a_join_that_does_not_finish_says_what_is_missing_and_shows_the_log(
    cp: ControlPlane, node: NetNode, release_dir: Path
) -> None:
    cp.run()
    # server.toml names no llama.cpp release (version ""), and this llama-server does not exist:
    # the agent says so at once, and node add stops waiting then, long before its timeout.
    args = ("--plain", "--accept-new-host-key", "--llamacpp-bin", "/mnt/no-such-llama-server", "--join-timeout", "100")
    started = time.monotonic()
    rc, out, err = cp.node_add(*args, release=release_dir)
    assert rc != 0 and time.monotonic() - started < 90
    failed = next(line for line in out.splitlines() if line.startswith("failed"))
    assert failed.startswith("failed join"), out
    assert "llama.cpp cannot be used" in out and "/mnt/no-such-llama-server" in out, out
    assert "/var/log/llmgw-agent.log" in out and "its last lines" in out


def test_another_machine_with_a_joined_nodes_hostname_is_refused(
    cp: ControlPlane, node: NetNode, release_dir: Path, tmp_path: Path
) -> None:
    cp.run()
    cp.added(release_dir)
    twin = NetNode(tmp_path / "twin", hostname=node.hostname)
    twin.start()
    try:
        done = cp.llmgw(
            "node", "add", twin.target, "--config", str(cp.config), "-i", str(twin.client_key),
            "--known-hosts", str(cp.known_hosts), "--accept-new-host-key", "--plain", "--release", str(release_dir),
            timeout=ADD_TIMEOUT_S,
        )  # fmt: skip
        assert done.returncode != 0
        assert "failed identify" in done.stdout and "another machine with the same hostname" in done.stdout
        assert [p for p in twin.written() if "llmgw" in p] == []
    finally:
        twin.stop()
    me = {n["id"]: n for n in cp.ctl("nodes")}[node.hostname]
    assert me["state"] == "joined" and me["address"] == node.node_addr  # the first machine keeps its place


def test_in_a_terminal_each_adapter_group_is_named_and_the_node_keeps_its_settings(
    cp: ControlPlane, node: NetNode, release_dir: Path, tmp_path: Path
) -> None:
    cp.run()
    # The node's own agent.toml says where its adapters are (a sysfs-shaped tree and an sminfo
    # that answers for one subnet manager): node add keeps those settings and doctor uses them.
    node.write(
        "/etc/llmgw/agent.toml",
        f'server = "wss://{node.host_addr}:7443"\nib_root = "{ib_root(IB_CASE)}"\nsminfo = "{sminfo(IB_CASE)}"\n',
    )
    argv = [
        sys.executable, "-m", "llmgw", "node", "add", node.target, "--config", str(cp.config),
        "-i", str(node.client_key), "--known-hosts", str(cp.known_hosts), "--release", str(release_dir),
        "--llamacpp-bin", "/mnt/llama-server", "--accept-new-host-key",
    ]  # fmt: skip
    term = Terminal(tmp_path, argv, timeout_s=60)
    try:
        term.wait_for(
            "infiniband adapters mlx5_0, mlx5_1", f"identity {IB_IDENTITY}", "fabrics in the cluster: none yet"
        )
        term.type("ib-a")
        term.keys("Enter")
        assert term.wait_exit(timeout_s=ADD_TIMEOUT_S) == 0, term.scrollback()
    finally:
        term.close()
    me = {n["id"]: n for n in cp.ctl("nodes")}[node.hostname]
    assert me["fabrics"] == [{"name": "ib-a", "identity": IB_IDENTITY, "adapters": ["mlx5_0", "mlx5_1"]}]
    written = node.read("/etc/llmgw/agent.toml").decode()
    assert f'ib_root = "{ib_root(IB_CASE)}"' in written and 'name = "ib-a"' in written


def test_adding_again_with_a_new_release_upgrades_the_node(
    cp: ControlPlane, node: NetNode, release_dir: Path, tmp_path: Path
) -> None:
    cp.run()
    cp.added(release_dir)
    newer = build_release(tmp_path / "newer", "0.0.1-e2e")
    rc, out, err = cp.node_add("--plain", release=newer)
    assert rc == 0, out + err
    assert "will replace /usr/local/bin/llmgw there" in out and "kept its certificate" in out, out
    assert node.read("/usr/local/bin/llmgw") == next(newer.glob("*.pyz")).read_bytes()
    me = {n["id"]: n for n in cp.ctl("nodes")}[node.hostname]
    assert me["agent_version"] == "0.0.1-e2e" and me["state"] == "joined"


def test_a_hostile_hostname_runs_nothing(cp: ControlPlane, tmp_path: Path, release_dir: Path) -> None:
    # The kernel takes almost any bytes as a hostname; node add reads it and must not run it.
    hostile = NetNode(tmp_path / "hostile", hostname="x;touch${IFS}/tmp/pwned;$(touch${IFS}/tmp/pwned2)")
    hostile.start()
    try:
        cp.node = hostile
        cp.run()
        rc, out, err = cp.node_add("--plain", "--accept-new-host-key", release=release_dir)
        assert rc != 0
        assert "failed identify" in out and "cannot be a node id" in out, out
        assert hostile.run("ls", "/tmp/pwned", "/tmp/pwned2").returncode != 0
        written = [p for p in hostile.written() if not p.startswith("/etc/ssh")]  # the test's authorized keys
        assert written == [], written  # not even in /tmp
    finally:
        hostile.stop()
