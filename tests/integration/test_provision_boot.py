"""The machine half of onboarding, for real: llmgw-provision-node on a stand-in Proxmox host (qm and
pvesm are the only fakes, testlib.proxmox), then the machine it describes booted with cloud-init
running the tool's own files, then `llmgw node add` against that machine.

The "VM" is the Debian 12 test machine (testlib.machine: a debootstrap'd root with cloud-init,
booted by systemd-nspawn) standing in for the cloud image. It is given what Proxmox would give
the VM: the user-data snippet the tool wrote into the snippets storage (Proxmox serves it as it
is), the network-config and meta-data Proxmox renders from --ipconfig0 and net0 (the tool's
`--seed-dir` writes the same), as a NoCloud seed, net0's MAC address on eth0, and the release's
disk (scsi1, the file the stand-in imported) as a block device (a loop device).

From there the whole path goes on to a first token: the image has no llama.cpp and no compiler;
node add is given no engine flag, so the node installs the release's llama.cpp (node add's
`--release` directory ships its archive over SSH with the zipapp), downloads the catalog's GGUF model (testlib.firsttoken) and
answers a chat completion through the gateway. "provision to first token" is measured, from the
first `qm` call to the answer's first token (docs/performance.md).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from llmgw import pins
from llmgw.releasefiles import llama_file_name
from testlib.cluster import wait_until
from testlib.firsttoken import ModelFiles, first_token, report
from testlib.machine import BUILD_TOOLS, Machine, preflight
from testlib.needs import program
from testlib.nodeadd import VERSION, ControlPlane, build_release
from testlib.provision import ARCH, Host, load_tool, make_host
from testlib.sshd import keygen

VMID = 144
NAME = "llmgw-node04"
LOGIN = "ubuntu"
SEED = "/var/lib/cloud/seed/nocloud"
CLOUD_INIT_TIMEOUT_S = 180
READY_TIMEOUT_S = 120  # the model's download, llama-server's start and the model's load, on a loaded machine


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = build_release(tmp_path_factory.mktemp("release"), VERSION, with_llama=True)
    return next(directory.glob(f"llmgw-{VERSION}-linux-*.pyz"))


class Loop:
    """A file as a read-only block device: the VM's second disk."""

    def __init__(self, image: Path) -> None:
        losetup = program("losetup", "mount")
        done = subprocess.run([losetup, "-f", "--show", "-r", str(image)], capture_output=True, text=True, check=True)
        self.device = done.stdout.strip()

    def detach(self) -> None:
        subprocess.run(["losetup", "-d", self.device], capture_output=True, check=False)


@pytest.fixture()
def cleanup() -> Iterator[list]:
    """Whatever a test starts (machines, loop devices, control planes), stopped in reverse order."""
    things: list = []
    yield things
    for thing in reversed(things):
        if isinstance(thing, Loop):
            thing.detach()
        else:
            thing.stop()


def _hypervisor(tmp: Path) -> tuple[Host, Path]:
    """A Proxmox host whose /root/.ssh/authorized_keys holds a real key (the hypervisor's)."""
    host = make_host(tmp / "pve")
    key = keygen(tmp / "hypervisor_key", "root@pve")
    host.keys.write_text(Path(f"{key}.pub").read_text())
    return host, key


def _machine(tmp: Path) -> Machine:
    why = preflight()
    if why:
        pytest.fail(why)
    mac = load_tool().derived_mac(VMID, NAME)  # net0's, which network-config matches eth0 by
    return Machine(tmp / "vm", address=False, cloud_init=True, mac=mac)


def _provision_args(machine: Machine, release: Path) -> dict[str, str]:
    return {"--ip": f"{machine.node_addr}/30", "--gateway": machine.host_addr, "--binary": str(release)}


def _seed(machine: Machine, files: dict[str, bytes]) -> None:
    seed = machine.path(SEED)
    seed.mkdir(parents=True)
    for name, body in files.items():
        (seed / name).write_bytes(body)


def _cloud_init_finished(machine: Machine) -> str:
    done = machine.run("cloud-init", "status", "--wait", "--long", check=False, timeout=CLOUD_INIT_TIMEOUT_S)
    return done.stdout


def _ssh(machine: Machine, key: Path, command: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            "ssh", "-i", str(key), "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no",
            "-o", "UserKnownHostsFile=/dev/null", f"{LOGIN}@{machine.node_addr}", command,
        ],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def test_provisioned_booted_added_and_answering_its_first_token(tmp_path: Path, release: Path, cleanup: list) -> None:
    host, key = _hypervisor(tmp_path)
    machine = _machine(tmp_path)
    cleanup.append(machine)
    started = time.monotonic()

    # The machine half, on the Proxmox host.
    done = host.run("--binary", str(release), replace=_provision_args(machine, release))
    assert done.returncode == 0, done.stdout + done.stderr
    assert host.fake.vm(VMID)["status"] == "running"
    assert f"sudo llmgw node add {LOGIN}@{machine.node_addr}" in done.stdout
    seed_dir = tmp_path / "seed"
    rendered = host.run("--seed-dir", str(seed_dir), replace=_provision_args(machine, release))
    assert rendered.returncode == 0, rendered.stderr
    snippet = host.snippets() / f"llmgw-node-{VMID}.yaml"
    _seed(
        machine,
        {
            "user-data": snippet.read_bytes(),
            "network-config": (seed_dir / "network-config").read_bytes(),
            "meta-data": (seed_dir / "meta-data").read_bytes(),
        },
    )
    disk = Loop(host.fake.disk(VMID, "scsi1"))
    cleanup.append(disk)
    machine.devices = (disk.device,)

    # First boot: cloud-init does the rest.
    machine.start()
    status = _cloud_init_finished(machine)
    assert "status: done" in status, status + machine.run("cat", "/var/log/cloud-init-output.log").stdout
    booted_s = time.monotonic() - started
    assert machine.run("hostname").stdout.strip() == NAME
    assert f"{machine.node_addr}/30" in machine.run("ip", "-4", "-o", "addr", "show", "dev", "eth0").stdout
    login = _ssh(machine, key, "sudo -n /usr/local/bin/llmgw version && sha256sum /usr/local/bin/llmgw")
    assert login.returncode == 0, login.stderr
    assert VERSION in login.stdout
    assert hashlib.sha256(release.read_bytes()).hexdigest() in login.stdout
    log = machine.run("cat", "/var/log/cloud-init-output.log").stdout
    assert f"installed {release.name} as /usr/local/bin/llmgw" in log and "checked" in log

    # The image is a stock one: no compiler, no llama.cpp.
    assert machine.on_path(*BUILD_TOOLS) == [] and machine.on_path("python3") == ["/usr/bin/python3"]

    # The identity half, on the control plane: node add with the hypervisor's key, the same release,
    # no engine flag; the catalog names a GGUF model the node downloads from the host's side of its link.
    model = ModelFiles(tmp_path / "models", machine.host_addr)
    cleanup.append(model)
    node = SimpleNamespace(hostname=NAME, host_addr=machine.host_addr, node_addr=machine.node_addr, client_key=key)
    cp = ControlPlane(tmp_path / "plane", node, catalog=model.catalog(), llamacpp_bin=None)
    cp.add_config(f'[release]\ndir = "{release.parent}"\n')
    cleanup.append(cp)
    cp.run()
    gateway = cp.server.events("server_ready")[-1]["admin_url"]
    key_token = cp.ctl("keys", "create", "first-token")["token"]
    add_started = time.monotonic()
    rc, out, err = cp.node_add("--plain", "--accept-new-host-key", release=release.parent, login=LOGIN)
    assert rc == 0, out + err
    assert "the same as /usr/local/bin/llmgw" in out  # the file cloud-init installed is the release node add ships
    assert f"joined; llama.cpp installed and checked ({pins.LLAMACPP_VERSION})" in out, out
    me = cp.nodes()[NAME]
    assert me["state"] == "joined" and me["address"] == machine.node_addr
    joined_s = time.monotonic() - started
    [llama] = [e for e in me["engines"] if e["name"] == "llamacpp"]
    assert llama["ok"] and llama["version"] == pins.LLAMACPP_VERSION and llama["cpu_backend"], llama
    # --release names the directory: the node's llama.cpp archive goes with node add over SSH, so the
    # plane serves the node nothing (docs/install.md, "Adding the node").
    archive = llama_file_name(pins.LLAMACPP_VERSION, ARCH)
    assert f"{archive} copied over SSH too" in out, out
    assert machine.node_addr not in [e["peer"] for e in cp.server.events("release_served")]
    assert machine.systemctl("is-enabled", "llmgw-agent.service") == "enabled"

    # The first token: the model placed on the node, a chat answered through the gateway by it.
    replica = wait_until(
        "the llama.cpp replica on the VM to be ready",
        lambda: next((r for r in cp.replicas() if r["state"] == "ready" and r["nodes"] == [NAME]), None),
        alive=[cp.server],
        timeout=READY_TIMEOUT_S,
        last_seen=lambda: cp.ctl("replicas"),
    )
    answer = first_token(gateway, key_token)
    assert answer.replica == replica["replica"] and answer.finish_reason == "length", answer
    first_token_s = answer.first_token_at - started
    measured = {
        "cloud_init_done_s": booted_s,
        "node_add_started_s": add_started - started,
        "joined_s": joined_s,
        "provision_to_first_token_s": first_token_s,
        "node_add_to_first_token_s": answer.first_token_at - add_started,
    }
    report("provision-node.json", json.dumps({k: round(v, 1) for k, v in measured.items()}))
    print(
        f"provision to first token: {first_token_s:.1f} s (cloud-init done at {booted_s:.1f} s, node add started "
        f"at {add_started - started:.1f} s, joined at {joined_s:.1f} s; node add to first token "
        f"{measured['node_add_to_first_token_s']:.1f} s)"
    )


def test_a_damaged_release_stops_first_boots_install_with_a_message(
    tmp_path: Path, release: Path, cleanup: list
) -> None:
    host, _ = _hypervisor(tmp_path)
    machine = _machine(tmp_path)
    cleanup.append(machine)
    seed_dir = tmp_path / "seed"
    done = host.run("--seed-dir", str(seed_dir), replace=_provision_args(machine, release))
    assert done.returncode == 0, done.stderr
    _seed(machine, {name: (seed_dir / name).read_bytes() for name in ("user-data", "network-config", "meta-data")})
    payload = tmp_path / "damaged.img"
    shutil.copyfile(seed_dir / "llmgw-payload.img", payload)
    with open(payload, "r+b") as f:
        f.seek(load_tool().HEADER_SIZE + 1000)
        f.write(b"\xff")
    disk = Loop(payload)
    cleanup.append(disk)
    machine.devices = (disk.device,)

    machine.start()
    status = _cloud_init_finished(machine)
    log = machine.run("cat", "/var/log/cloud-init-output.log").stdout
    assert "status: error" in status, status  # cloud-init counts the failed install as an error
    assert "sha256 MISMATCH" in log and "/usr/local/bin/llmgw NOT installed" in log, log
    assert not machine.path("/usr/local/bin/llmgw").exists()
    # Everything else cloud-init was to do is done: the machine is reachable to fix by hand.
    assert machine.run("hostname").stdout.strip() == NAME
