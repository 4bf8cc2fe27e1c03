"""`llmgw node add` on a real systemd machine: a Debian 12 root booted with systemd as its init
(testlib.machine: systemd-nspawn --boot, its own network namespace, a real sshd), not this
machine's programs in a namespace. What is tested is what an operator's node does: the unit is
written, enabled and started by systemctl; the agent comes back by itself after a reboot and
rejoins; a join that fails shows the journal; adding again restarts the unit; `node remove --ssh`
leaves it stopped and disabled, and it stays so across a reboot.

The machine is a stock one as far as llama.cpp goes: no compiler, cmake or make (checked), no
llama.cpp. node add is given no engine flag: the node installs llama.cpp from the release (the
control plane serves the release's archive from `[release] dir`: the portable build `./pants test`
keeps in its cache), downloads the catalog's GGUF model from a file server on the host's side of
its link (testlib.firsttoken), and answers a chat completion through the gateway. "node add to
first token" is measured (docs/performance.md). The release is built from this checkout and runs
on the machine's own python3 (Debian 12's).
"""

from __future__ import annotations

import json
import os
import platform
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from agent.install.installer import llama_cpu_backend
from llmgw import pins
from llmgw.nodeadd.node import layout
from llmgw.releasefiles import ARCHES, llama_file_name
from testlib.cluster import wait_until
from testlib.firsttoken import ModelFiles, first_token, report
from testlib.llama import llama_server
from testlib.machine import BUILD_TOOLS, Machine, machine_fixture
from testlib.nodeadd import ControlPlane

# The node add tests' fixtures: release_dir, node and cp.
pytest_plugins = ("testlib.nodeadd",)

HOSTNAME = "sysnode1"
ARCH = ARCHES[platform.machine()]
UNIT = layout.UNIT_NAME
REJOIN_TIMEOUT_S = 90
READY_TIMEOUT_S = 120  # the model's download, llama-server's start and the model's load, on a loaded machine
AGENT_DIR = Path(layout.STATE_DIR)


pytestmark = pytest.mark.release(with_llama=True)
machine = machine_fixture(HOSTNAME)


@pytest.fixture()
def model(tmp_path: Path, machine: Machine) -> Iterator[ModelFiles]:
    files = ModelFiles(tmp_path / "models", machine.host_addr)
    try:
        yield files
    finally:
        files.stop()


@pytest.fixture()
def cp(tmp_path: Path, machine: Machine, model: ModelFiles, release_dir: Path) -> Iterator[ControlPlane]:
    """The operator's defaults: no `[engines.llamacpp]`, the release's files in `[release] dir`, and
    node add given no engine flag."""
    c = ControlPlane(tmp_path / "plane", machine, catalog=model.catalog(), llamacpp_bin=None)
    c.add_config(f'[release]\ndir = "{release_dir}"\n')
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
    out = machine.run("ps", "-ww", "-eo", "args", check=False).stdout  # -ww: whole lines, not 80 columns
    return [line for line in out.splitlines() if "engine sim" in line or "llama-server --" in line]


def _ready_replica(cp: ControlPlane) -> dict | None:
    return next((r for r in cp.replicas() if r["state"] == "ready" and r["nodes"] == [HOSTNAME]), None)


def test_a_stock_machine_joins_with_the_releases_llamacpp_and_answers_then_survives_reboots_a_re_add_and_node_remove(
    cp: ControlPlane, machine: Machine, model: ModelFiles
) -> None:
    # A stock machine: nothing to build llama.cpp with (so nothing can be built), no llama.cpp.
    assert machine.on_path(*BUILD_TOOLS) == []
    assert machine.on_path("python3", "tar") == ["/usr/bin/python3", "/usr/bin/tar"]  # it finds what is there
    assert not machine.path(str(AGENT_DIR)).exists()
    cp.run()
    key = cp.ctl("keys", "create", "first-token")["token"]
    gateway = cp.server.events("server_ready")[-1]["admin_url"]
    backend = trio.run(llama_cpu_backend, llama_server())  # what llama.cpp picks on this CPU, the machine's

    # `sudo llmgw node add root@ADDR`: no engine flag, no --llamacpp-bin, the release from the plane.
    started = time.monotonic()
    rc, out, err = cp.node_add("--plain", "--accept-new-host-key")
    assert rc == 0, out + err
    onboarding_s = time.monotonic() - started
    assert f"{layout.UNIT} (enabled)" in out and "no systemd on the node" not in out, out
    assert f"joined; llama.cpp installed and checked ({pins.LLAMACPP_VERSION})" in out, out
    # The catalog's model: downloaded by the node, llama.cpp started on it, a chat answered through
    # the gateway by that replica; timed from node add's start to the answer's first token.
    replica = wait_until(
        "the llama.cpp replica on the machine to be ready",
        lambda: _ready_replica(cp),
        alive=[cp.server],
        timeout=READY_TIMEOUT_S,
        last_seen=lambda: (cp.ctl("replicas"), machine.journal(UNIT, 20)),
    )
    ready_s = time.monotonic() - started
    answer = first_token(gateway, key)
    first_token_s = answer.first_token_at - started
    assert answer.replica == replica["replica"] and answer.finish_reason == "length", answer
    print(
        f"node add to first token: {first_token_s:.1f} s (node add {onboarding_s:.1f} s, "
        f"replica ready at {ready_s:.1f} s); the answer: {answer.text!r}"
    )

    # Joined with llama.cpp from the release: its version, the CPU backend it loads, nothing built.
    assert machine.systemctl("is-enabled", UNIT) == "enabled"
    assert machine.systemctl("is-active", UNIT) == "active"
    me = _me(cp)
    assert me["state"] == "joined" and me["address"] == machine.node_addr
    [llama] = [e for e in me["engines"] if e["name"] == "llamacpp"]
    assert (llama["ok"], llama["state"], llama["version"]) == (True, "ok", pins.LLAMACPP_VERSION), llama
    assert (llama["cpu_backend"], llama["cpu_note"]) == (backend, ""), llama
    table = cp.llmgw("ctl", "nodes", "--state-dir", str(cp.state)).stdout
    assert f"llamacpp[{backend}]" in next(line for line in table.splitlines() if line.startswith(HOSTNAME)), table
    archive = llama_file_name(pins.LLAMACPP_VERSION, ARCH)
    served = [(e["peer"], e["name"]) for e in cp.server.events("release_served")]
    assert served.count((machine.node_addr, archive)) == 1, served  # from the plane, once
    assert cp.server.events("mirror_fetched") == cp.server.events("mirror_fetch_failed") == []  # no source
    engines = AGENT_DIR / "engines" / "llamacpp"
    assert os.readlink(machine.path(str(engines / "current"))) == pins.LLAMACPP_VERSION
    top = engines / pins.LLAMACPP_VERSION / archive.removesuffix(".tar.gz")
    assert {f"libggml-cpu-{backend}.so", "libggml-cpu-x64.so"} <= {p.name for p in machine.path(str(top)).iterdir()}
    assert any(f"{engines}/" in line and "llama-server --" in line for line in _engines(machine)), _engines(machine)
    journal = machine.journal(UNIT, 5000)
    assert "engine_cpu_backend" in journal and "engine_build_started" not in journal, journal[-3000:]
    weights = machine.path(str(AGENT_DIR / "weights" / model.sha256() / "tiny.gguf"))
    assert weights.read_bytes() == model.path.read_bytes()

    # The unit is the one llmgw renders, and the node's own systemd accepts it as written.
    assert machine.path(layout.UNIT).read_text() == layout.systemd_unit()
    verify = machine.run("systemd-analyze", "verify", layout.UNIT, check=False)
    assert verify.returncode == 0 and verify.stderr.strip() == "", verify.stderr
    security = machine.run("systemd-analyze", "security", "--no-pager", UNIT, check=False).stdout
    level = re.search(r"Overall exposure level for \S+: ([0-9.]+) (\w+)", security)
    assert level is not None, security
    assert float(level.group(1)) <= 8.0, security  # 9.6 for the same unit with no sandboxing
    report("systemd-analyze-security.txt", security)

    # A reboot: nothing but systemd starts the agent, which rejoins with the same identity.
    before = _me(cp)["agent_started_at"]
    started = time.monotonic()
    machine.reboot()
    wait_until("the agent to rejoin after the reboot", lambda: _rejoined(cp, before), timeout=REJOIN_TIMEOUT_S)
    rejoin_s = time.monotonic() - started
    measured = {
        "onboarding_s": onboarding_s,
        "node_add_to_ready_replica_s": ready_s,
        "node_add_to_first_token_s": first_token_s,
        "reboot_to_rejoined_s": rejoin_s,
        "exposure": float(level[1]),
    }
    report("systemd-node.json", json.dumps({**{k: round(v, 1) for k, v in measured.items()}, "rating": level[2]}))
    assert machine.systemctl("is-active", UNIT) == "active"
    assert machine.systemctl("show", "-p", "NRestarts", "--value", UNIT) == "0"  # started at boot, not restarted

    # Adding again restarts the unit (a new agent process), still enabled.
    pid = machine.systemctl("show", "-p", "MainPID", "--value", UNIT)
    before = _me(cp)["agent_started_at"]
    rc, out, err = cp.node_add("--plain")  # the release from the plane again
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
