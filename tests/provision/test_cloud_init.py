"""What llmgw-provision-node tells the VM, checked by cloud-init itself (Debian's package: its schema,
its network-config parser and renderer), and its first-boot script run on a real block device."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path
from types import ModuleType

import pytest

from llmgw.pki import ca
from testlib import needs
from testlib.provision import KEY, Host, python39, release_file

CLOUD_PYTHON = "/usr/bin/python3"  # the Python Debian's cloud-init package runs on, with its modules


def seed(host: Host, *args: str) -> Path:
    out = host.tmp / "seed"
    done = host.run("--seed-dir", str(out), *args)
    assert done.returncode == 0, done.stderr
    return out


def schema(path: Path) -> subprocess.CompletedProcess[str]:
    cloud_init = needs.program("cloud-init", "cloud-init")
    return subprocess.run(
        [cloud_init, "schema", "--config-file", str(path)], capture_output=True, text=True, timeout=120, check=False
    )


@pytest.mark.parametrize("with_binary", [False, True])
def test_user_data_passes_cloud_inits_own_schema(host: Host, with_binary: bool) -> None:
    # A key comment with YAML's special characters, which must stay one quoted string.
    host.keys.write_text(f'{KEY}\nssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQC7 "ops: team" #1 & more\n')
    args = ["--binary", str(release_file(host.tmp))] if with_binary else []
    user_data = seed(host, *args) / "user-data"
    done = schema(user_data)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Valid cloud-config" in done.stdout
    # The same check refuses a broken file: it is not a check that passes anything.
    broken = user_data.with_name("broken")
    broken.write_text(user_data.read_text().replace("lock_passwd: true", "lock_passwd: maybe"))
    assert schema(broken).returncode != 0


READ_BY_CLOUD_INIT = r"""
import json, os, sys, tempfile, yaml
from cloudinit.net.network_state import parse_net_config_data
from cloudinit.net import networkd
seed = sys.argv[1]
user = yaml.safe_load(open(os.path.join(seed, "user-data")))
state = parse_net_config_data(yaml.safe_load(open(os.path.join(seed, "network-config"))))
out = tempfile.mkdtemp()
networkd.Renderer({}).render_network_state(state, target=out)
rendered = {}
for root, _, files in os.walk(out):
    for name in files:
        rendered[name] = open(os.path.join(root, name)).read()
print(json.dumps({"user": user, "meta": yaml.safe_load(open(os.path.join(seed, "meta-data"))), "networkd": rendered}))
"""


def read_by_cloud_init(seed_dir: Path) -> dict:
    needs.program("cloud-init", "cloud-init")
    done = subprocess.run(
        [CLOUD_PYTHON, "-c", READ_BY_CLOUD_INIT, str(seed_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_seed_reads_as_proxmox_means_it(host: Host, tool: ModuleType) -> None:
    seed_dir = seed(host, "--dns", "10.0.0.2")
    read = read_by_cloud_init(seed_dir)
    user = read["user"]
    assert user["hostname"] == "llmgw-node04" and "fqdn" not in user
    assert user["prefer_fqdn_over_hostname"] is False
    assert user["users"] == [
        {
            "name": "ubuntu",
            "gecos": "llmgw node add login",
            "shell": "/bin/bash",
            "lock_passwd": True,
            "sudo": "ALL=(ALL) NOPASSWD:ALL",
            "ssh_authorized_keys": [KEY],
        }
    ]
    assert "packages" not in user  # python3 is cloud-init's own runtime; first boot needs no mirror
    # cloud-init's own renderer makes of network-config what Proxmox's ipconfig0 says.
    mac = tool.derived_mac(144, "llmgw-node04")
    (network,) = read["networkd"].values()
    for line in (f"MACAddress={mac}", "Name=eth0", "Address=10.0.0.144/24", "Gateway=10.0.0.1", "DNS=10.0.0.2"):
        assert line in network.splitlines(), network
    text = (seed_dir / "user-data").read_text() + (seed_dir / "network-config").read_text()
    assert read["meta"] == {"instance-id": hashlib.sha1(text.encode()).hexdigest()}


def test_the_name_rule_is_llmgws_node_id_rule_narrowed_to_a_hostname(tool: ModuleType) -> None:
    assert tool.NODE_ID_RE.pattern == ca._NODE_ID.pattern
    names = [
        "llmgw-node04", "n", "N1", "a" * 63, "a" * 64, "node_04", "node.lab", "-node", "node-", "node 04",
        "node@04", "4node", "", "ünode", "node04.", "_node",
    ]  # fmt: skip
    for name in names:
        try:
            ca.check_node_id(name)
            llmgw_accepts = True
        except Exception:  # noqa: BLE001 (whatever check_node_id raises is a no)
            llmgw_accepts = False
        tool_accepts = tool.check_name(name) is None
        assert not (tool_accepts and not llmgw_accepts), name  # never a name llmgw would refuse
    assert tool.check_name("llmgw-node04") is None
    assert tool.check_name("node_04").fix.endswith("--name node-04")


def test_sizes_images_and_macs(tool: ModuleType, host: Host) -> None:
    assert [tool.parse_size_mib(x) for x in ("16G", "4096M", "2048", "1GiB", "16 g", "16T", "")] == [
        16384, 4096, 2048, 1024, 16384, None, None,
    ]  # fmt: skip
    assert tool.image_virtual_size(host.image) == ("qcow2", 2 << 30)
    raw = host.tmp / "disk.img"
    raw.write_bytes(b"\0" * 8192)
    assert tool.image_virtual_size(raw) == ("raw", 8192)
    mac = tool.derived_mac(144, "llmgw-node04")
    assert mac == tool.derived_mac(144, "llmgw-node04") != tool.derived_mac(145, "llmgw-node04")
    first = int(mac[:2], 16)
    assert first & 0b10 and not first & 0b01  # locally administered, unicast


# -- the first-boot script, on a loop device ---------------------------------------------------

# A private mount namespace in which the loop device is the only disk and /usr/local/bin is empty:
# the script scans /sys/class/block and /dev, and installs into /usr/local/bin.
ISOLATED = """
set -e
mount -t tmpfs tmpfs /usr/local/bin
mount -t tmpfs tmpfs /sys/class/block
mkdir /sys/class/block/{name}
mount -t tmpfs tmpfs /dev
mknod -m 666 /dev/null c 1 3
mknod /dev/{name} b {major} {minor}
set +e
sh {script}
echo "exit=$?"
if [ -e /usr/local/bin/llmgw ]; then stat -c 'mode=%a' /usr/local/bin/llmgw; sha256sum /usr/local/bin/llmgw; fi
ls -A /usr/local/bin | sed 's/^/file=/'
"""


def run_first_boot(tool: ModuleType, host: Host, damage: bool) -> subprocess.CompletedProcess[str]:
    losetup = needs.program("losetup", "mount")
    unshare = needs.program("unshare", "util-linux")
    binary = release_file(host.tmp, body=b"print('the release')\n" * 100)
    args = tool.parser().parse_args([*host.base(), "--binary", str(binary)])
    settings = tool.local_checks(args)
    payload = host.tmp / "payload.img"
    tool.write_payload(settings, payload)
    if damage:
        with open(payload, "r+b") as f:
            f.seek(tool.HEADER_SIZE + 100)
            f.write(b"X")
    script = host.tmp / "install-llmgw"
    script.write_text(tool.installer_script(settings))
    device = subprocess.run([losetup, "-f", "--show", str(payload)], capture_output=True, text=True, check=True)
    node = device.stdout.strip()
    try:
        name = Path(node).name
        st = Path(node).stat()
        major, minor = os.major(st.st_rdev), os.minor(st.st_rdev)
        return subprocess.run(
            [unshare, "--mount", "--propagation", "private", "sh", "-c",
             ISOLATED.format(name=name, major=major, minor=minor, script=script)],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
    finally:
        subprocess.run([losetup, "-d", node], check=False)


def test_first_boot_installs_the_release_it_checked(tool: ModuleType, host: Host) -> None:
    done = run_first_boot(tool, host, damage=False)
    lines = done.stdout.splitlines()
    assert "exit=0" in lines, done.stdout + done.stderr
    assert "mode=755" in lines
    binary = next(host.tmp.glob("llmgw-*.pyz"))
    assert f"{hashlib.sha256(binary.read_bytes()).hexdigest()}  /usr/local/bin/llmgw" in lines
    assert [x for x in lines if x.startswith("file=")] == ["file=llmgw"]  # no temporary file left
    assert "installed llmgw-0.0.0-linux-" in done.stderr and "checked" in done.stderr
    assert "llmgw version: the release" in done.stderr  # it ran, on this machine's python3


def test_a_damaged_release_is_not_installed_and_says_so(tool: ModuleType, host: Host) -> None:
    done = run_first_boot(tool, host, damage=True)
    lines = done.stdout.splitlines()
    assert "exit=1" in lines, done.stdout + done.stderr
    assert [x for x in lines if x.startswith(("file=", "mode="))] == []  # nothing installed, nothing left
    assert "sha256 MISMATCH" in done.stderr and "/usr/local/bin/llmgw NOT installed" in done.stderr


@pytest.mark.parametrize("old", [False, True])
def test_first_boot_says_when_the_machines_python3_cannot_run_llmgw(
    tool: ModuleType, tmp_path: Path, old: bool
) -> None:
    path = os.environ.get("PATH", "")
    if old:  # a machine whose python3 is 3.9
        (tmp_path / "bin").mkdir()
        (tmp_path / "bin" / "python3").symlink_to(python39())
        path = f"{tmp_path / 'bin'}{os.pathsep}{path}"
    done = subprocess.run(
        ["sh", "-c", tool.PYTHON_CHECK], env={**os.environ, "PATH": path}, capture_output=True, text=True, timeout=60
    )
    if old:
        assert done.returncode == 1
        assert "needs python3 3.10 to 3.13 on this machine and it has 'Python 3.9." in done.stderr
    else:
        assert done.returncode == 0 and done.stderr == ""
