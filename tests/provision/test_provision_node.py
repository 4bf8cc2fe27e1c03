"""llmgw-provision-node against a stand-in qm/pvesm: the calls it makes, their order, and refusals
that make none."""

from __future__ import annotations

import hashlib
import shlex
from pathlib import Path

import pytest

from testlib.provision import KEY, Host, make_host, python39, qcow2, release_file

EXPECTED_CALLS = [
    ["qm", "create", "144", "--name", "llmgw-node04", "--ostype", "l26", "--cpu", "host", "--cores", "8",
     "--memory", "16384", "--net0", "virtio={mac},bridge=vmbr0", "--scsihw", "virtio-scsi-pci",
     "--serial0", "socket", "--vga", "serial0", "--agent", "0", "--onboot", "1"],
    ["qm", "set", "144", "--scsi0", "local-lvm:0,import-from={image}"],
    ["qm", "set", "144", "--ide2", "local-lvm:cloudinit"],
    ["qm", "set", "144", "--boot", "order=scsi0"],
    ["qm", "set", "144", "--ipconfig0", "ip=10.0.0.144/24,gw=10.0.0.1", "--ciuser", "ubuntu", "--sshkeys", "{keys}"],
    ["qm", "set", "144", "--cicustom", "user=local:snippets/llmgw-node-144.yaml"],
    ["qm", "disk", "resize", "144", "scsi0", "64G"],
    ["qm", "start", "144"],
]  # fmt: skip


def expected(host: Host, mac: str) -> list[list[str]]:
    subs = {"{mac}": mac.upper(), "{image}": str(host.image), "{keys}": str(host.keys)}
    out = []
    for call in EXPECTED_CALLS:
        row = []
        for arg in call:
            for key, value in subs.items():
                arg = arg.replace(key, value)
            row.append(arg)
        out.append(row)
    return out


def test_builds_the_vm_in_order_with_cloud_init_doing_the_rest(host: Host, tool) -> None:
    done = host.run()
    assert done.returncode == 0, done.stderr
    mac = tool.derived_mac(144, "llmgw-node04")
    assert host.fake.mutating_calls() == expected(host, mac)
    # Read-only questions first: the VMID, the name, the storages.
    calls = host.fake.calls()
    first_change = calls.index(host.fake.mutating_calls()[0])
    assert [c[:3] for c in calls[:first_change]] == [
        ["qm", "status", "144"],
        ["qm", "list"],
        ["pvesm", "status", "--content"],
        ["pvesm", "status", "--content"],
        ["pvesm", "path", "local:snippets/llmgw-node-144.yaml"],
    ]
    vm = host.fake.vm(144)
    assert vm is not None and vm["status"] == "running" and vm["cpu"] == "host"
    assert vm["scsi0"].startswith("local-lvm:vm-144-disk-0,") and vm["scsi0"].endswith(",size=64G")
    assert vm["ide2"] == "local-lvm:vm-144-cloudinit,media=cdrom"
    user_data = (host.snippets() / "llmgw-node-144.yaml").read_text()
    assert user_data.startswith("#cloud-config\n")
    assert 'hostname: "llmgw-node04"' in user_data
    assert f'      - "{KEY}"' in user_data
    assert "/usr/local/bin/llmgw" not in user_data  # no --binary: node add ships the release
    assert "sudo llmgw node add ubuntu@10.0.0.144" in done.stdout


def test_the_seed_dir_holds_what_proxmox_serves(host: Host, tmp_path: Path, tool) -> None:
    assert host.run().returncode == 0
    seed = tmp_path / "seed"
    done = host.run("--seed-dir", str(seed))
    assert done.returncode == 0, done.stderr
    user = (seed / "user-data").read_text()
    assert user == (host.snippets() / "llmgw-node-144.yaml").read_text()
    network = (seed / "network-config").read_text()
    mac = tool.derived_mac(144, "llmgw-node04")
    assert f"mac_address: '{mac}'" in network and f"virtio={mac.upper()}" in host.fake.vm(144)["net0"]
    # Proxmox's instance id: sha1 of user-data and network-config.
    assert (seed / "meta-data").read_text() == f"instance-id: {hashlib.sha1((user + network).encode()).hexdigest()}\n"
    # No --dns: the host's resolv.conf, as Proxmox does when the VM has no nameserver.
    assert "'10.0.0.53'" in network and "'example.net'" in network
    assert "--nameserver" not in sum(host.fake.calls(), [])


def test_a_binary_rides_on_its_own_disk_with_its_host_sha256(host: Host) -> None:
    binary = release_file(host.tmp)
    digest = hashlib.sha256(binary.read_bytes()).hexdigest()
    (host.tmp / "SHA256SUMS").write_text(f"{digest}  {binary.name}\n")
    done = host.run("--binary", str(binary), "--dns", "10.0.0.2,10.0.0.3")
    assert done.returncode == 0, done.stderr
    calls = host.fake.mutating_calls()
    payload = host.snippets() / "llmgw-node-144.payload.img"
    assert calls[2] == ["qm", "set", "144", "--scsi1", f"local-lvm:0,import-from={payload}"]
    assert calls[5][-6:] == ["--nameserver", "10.0.0.2 10.0.0.3", "--ciuser", "ubuntu", "--sshkeys", str(host.keys)]
    assert not payload.exists()  # imported, then removed
    assert "imported-bytes=1048576" in host.fake.vm(144)["scsi1"]  # header + file, padded to 1 MiB
    user_data = (host.snippets() / "llmgw-node-144.yaml").read_text()
    assert f"SHA256='{digest}'" in user_data and f"SIZE={binary.stat().st_size}" in user_data
    assert "qm disk unlink 144 --idlist scsi1 --force" in done.stdout


def test_a_binary_that_is_not_the_released_one_is_refused(host: Host) -> None:
    binary = release_file(host.tmp)
    (host.tmp / "SHA256SUMS").write_text(f"{'0' * 64}  {binary.name}\n")
    done = host.run("--binary", str(binary))
    assert done.returncode == 3
    assert "SHA256SUMS beside it says 0000" in done.stderr
    assert host.fake.calls() == []  # a local refusal asks Proxmox nothing


def storages_without_snippets() -> dict:
    return {"local-lvm": {"type": "lvmthin", "content": ["images", "rootdir"], "status": "active"}}


# (what is wrong, how it is set up, what the message must say)
REFUSALS = {
    "existing VMID": (lambda h: h.fake.add_vm(144, "something-else"), {}, ["VM 144 already exists", "`qm config 144`"]),
    "existing name": (lambda h: h.fake.add_vm(150, "llmgw-node04"), {}, ["VM 150 is already named", "`qm config 150`"]),
    "missing image": (lambda h: h.image.unlink(), {}, ["--image", "does not exist", "wget -O"]),
    "unknown storage": (None, {"--storage": "nope"}, ["storage 'nope' does not exist", "local-lvm"]),
    "bad CIDR": (None, {"--ip": "10.0.0.144"}, ["no prefix length", "--ip 10.0.0.144/24"]),
    "bad address": (None, {"--ip": "10.0.0.300/24"}, ["not an address in CIDR form"]),
    "bad name": (None, {"--name": "llmgw_node04"}, ["not a hostname or Proxmox VM name", "--name llmgw-node04"]),
    "dotted name": (None, {"--name": "llmgw-node04.lab"}, ["holds a '.'", "--name llmgw-node04"]),
    "not a node id": (None, {"--name": "node@04"}, ["not a valid llmgw node id"]),
    "missing snippets storage": ("no-snippets", {}, ["does not hold snippets", "pvesm set local --content"]),
    "missing bridge": (lambda h: (h.net_root / "vmbr0").rmdir(), {}, ["no bridge 'vmbr0'", "--bridge NAME"]),
    "gateway elsewhere": (None, {"--gateway": "10.1.0.1"}, ["not in the VM's network 10.0.0.0/24"]),
    "disk below the image": (
        lambda h: qcow2(h.image, 80 << 30),
        {},
        ["smaller than the image (80.0 GiB)", "--disk 80G"],
    ),
    "no keys": (lambda h: h.keys.write_text("# none\n"), {}, ["holds no public key", "--ssh-keys FILE"]),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_a_refused_run_says_the_fix_and_changes_nothing(tmp_path: Path, case: str) -> None:
    setup, replace, says = REFUSALS[case]
    host = make_host(tmp_path, storages_without_snippets() if setup == "no-snippets" else None)
    if callable(setup):
        setup(host)
    before = {name: host.fake.vm(vmid) for vmid, name in ((144, 144), (150, 150))}
    done = host.run(replace=replace)
    assert done.returncode == 3, done.stdout + done.stderr
    assert "refused, nothing was changed" in done.stderr
    for text in says:
        assert text in done.stderr, done.stderr
    assert host.fake.mutating_calls() == []
    assert {name: host.fake.vm(vmid) for vmid, name in ((144, 144), (150, 150))} == before
    snippets = tmp_path / "pve" / "storage" / "local" / "snippets"
    assert not snippets.exists() or list(snippets.iterdir()) == []


def test_every_refusal_is_said_at_once(host: Host) -> None:
    host.fake.add_vm(144, "other")
    host.fake.add_vm(150, "llmgw-node04")
    done = host.run(replace={"--storage": "nope"})
    assert done.returncode == 3
    for text in ("VM 144 already exists", "VM 150 is already named", "storage 'nope'"):
        assert text in done.stderr


def test_dry_run_prints_the_exact_commands_and_changes_nothing(host: Host, tmp_path: Path) -> None:
    dry = host.run("--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert host.fake.mutating_calls() == []
    assert not host.snippets().exists()
    lines = dry.stdout.splitlines()
    commands = [shlex.split(line) for line in lines if line.startswith(("qm ", "pvesm "))]
    # The user-data is printed as the heredoc a run writes.
    start = lines.index(f"cat > {host.snippets() / 'llmgw-node-144.yaml'} <<'EOF'")
    end = lines.index("EOF", start)
    printed_user_data = "\n".join(lines[start + 1 : end]) + "\n"
    assert "#   version: 1" in dry.stdout  # the network-config Proxmox makes from ipconfig0

    real = make_host(tmp_path / "real")
    # The same paths, so the commands compare as text.
    real = Host(real.fake, host.image, host.keys, host.net_root, host.interfaces, host.resolv, host.tmp)
    assert real.run().returncode == 0
    assert commands == real.fake.mutating_calls()
    assert printed_user_data == (real.snippets() / "llmgw-node-144.yaml").read_text()


def test_a_step_that_fails_says_what_exists_and_how_to_start_over(host: Host) -> None:
    host.fake.fail_on(["qm", "disk", "resize"], "disk resize failed: storage is full")
    done = host.run()
    assert done.returncode == 1
    assert "disk resize failed: storage is full" in done.stderr  # qm's own words pass through
    assert "VM 144 exists, half built" in done.stderr and "qm destroy 144 --purge" in done.stderr
    assert host.fake.mutating_calls()[-1][:3] == ["qm", "disk", "resize"]  # and nothing after it


def test_the_help_names_the_one_string_and_the_cpu_trade(host: Host) -> None:
    done = host.run("--help", base=False)
    assert done.returncode == 0
    text = " ".join(done.stdout.split())
    assert "VM name = hostname = node id = certificate CN" in text
    assert "kvm64 (like qemu64), hides AVX, AVX2, FMA and even SSE4.2" in text
    assert "The trade is live migration" in text and "--cpu overrides it" in text


@pytest.mark.parametrize("which", ["debian", "3.9"])
def test_runs_on_the_hypervisors_python(host: Host, which: str) -> None:
    python = "/usr/bin/python3" if which == "debian" else python39()
    binary = release_file(host.tmp)
    done = host.run("--dry-run", "--binary", str(binary), python=python)
    assert done.returncode == 0, done.stderr
    assert "qm create 144" in done.stdout


def test_seed_needs_no_proxmox(host: Host, tmp_path: Path) -> None:
    done = host.run(
        "--seed-dir", str(tmp_path / "seed"), "--binary", str(release_file(host.tmp)), "--mac", "02:aa:bb:cc:dd:ee"
    )
    assert done.returncode == 0, done.stderr
    assert host.fake.calls() == []
    names = sorted(p.name for p in (tmp_path / "seed").iterdir())
    assert names == ["llmgw-payload.img", "meta-data", "network-config", "user-data"]
    assert "mac_address: '02:aa:bb:cc:dd:ee'" in (tmp_path / "seed" / "network-config").read_text()
