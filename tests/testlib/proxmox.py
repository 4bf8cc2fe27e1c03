"""A stand-in for Proxmox VE's `qm` and `pvesm`, for testing llmgw-provision-node without a hypervisor.

`FakeProxmox.make(dir)` writes executable `qm` and `pvesm` into `dir/bin` (each runs this module
with the Python running the tests) and keeps the host's state under `dir/state`: the storages
(`storages.json`) and one JSON file per VM. Each call's argv is appended to `calls.jsonl` before
it is answered, so a test sees every call, refused or not, in order.

It answers the subset of the CLI the tool uses, the way Proxmox 8 does: the same table layouts,
and the messages and exit codes of the failures a test provokes. For a VMID with no config
`qm status`/`qm config`/`qm set` say "Configuration file 'nodes/pve/qemu-server/144.conf' does not
exist" with exit status 2 (Perl's die keeps the errno of the failed open, ENOENT); `qm create` of
an existing VMID says "unable to create VM 144 - VM 144 already exists on node 'pve'"; a storage
that is not configured is "storage 'x' does not exist"; both exit 255 as Perl's die does.
Nothing here runs a VM: `qm start` only records the state. A disk imported with `import-from`
is copied, as Proxmox copies it into the storage's volume, to `state/disks/VOLUME` (`disk()`):
what the VM would see on it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

import attrs

NODE = "pve"
ENV = "LLMGW_FAKE_PROXMOX"  # the state directory, for the scripts
# What changes the host; everything else only reads.
MUTATING = {
    ("qm", "create"),
    ("qm", "set"),
    ("qm", "start"),
    ("qm", "destroy"),
    ("qm", "importdisk"),
    ("qm", "disk"),
    ("qm", "resize"),
    ("pvesm", "set"),
    ("pvesm", "alloc"),
    ("pvesm", "free"),
}

DEFAULT_STORAGES = {
    "local": {"type": "dir", "content": ["iso", "vztmpl", "backup", "snippets"], "status": "active"},
    "local-lvm": {"type": "lvmthin", "content": ["images", "rootdir"], "status": "active"},
}


@attrs.frozen
class FakeProxmox:
    root: Path

    @property
    def bin(self) -> Path:
        return self.root / "bin"

    @property
    def state(self) -> Path:
        return self.root / "state"

    @classmethod
    def make(cls, root: Path, storages: dict | None = None) -> FakeProxmox:
        fake = cls(root)
        fake.bin.mkdir(parents=True)
        (fake.state / "vms").mkdir(parents=True)
        stores = json.loads(json.dumps(storages if storages is not None else DEFAULT_STORAGES))
        for name, store in stores.items():
            if store["type"] == "dir":
                store.setdefault("path", str(fake.root / "storage" / name))
        (fake.state / "storages.json").write_text(json.dumps(stores, indent=1))
        (fake.state / "calls.jsonl").touch()
        here = Path(__file__).resolve().parent.parent  # the directory holding testlib
        for prog in ("qm", "pvesm"):
            script = fake.bin / prog
            script.write_text(
                f"#!{sys.executable}\n"
                "import sys\n"
                f"sys.path.insert(0, {str(here)!r})\n"
                "from testlib.proxmox import main\n"
                f"sys.exit(main({prog!r}, sys.argv[1:]))\n"
            )
            script.chmod(0o755)
        return fake

    def env(self) -> dict[str, str]:
        return {**os.environ, ENV: str(self.state), "PATH": f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}"}

    def calls(self) -> list[list[str]]:
        return [json.loads(line) for line in (self.state / "calls.jsonl").read_text().splitlines()]

    def mutating_calls(self) -> list[list[str]]:
        return [c for c in self.calls() if tuple(c[:2]) in MUTATING]

    def add_vm(self, vmid: int, name: str, status: str = "stopped") -> None:
        (self.state / "vms" / f"{vmid}.json").write_text(json.dumps({"name": name, "status": status}))

    def vm(self, vmid: int) -> dict | None:
        path = self.state / "vms" / f"{vmid}.json"
        return json.loads(path.read_text()) if path.exists() else None

    def fail_on(self, argv_prefix: list[str], message: str) -> None:
        """Make the call starting with `argv_prefix` fail with `message` (exit 255), as a broken storage would."""
        (self.state / "fail_on.json").write_text(json.dumps({"prefix": argv_prefix, "message": message}))

    def disk(self, vmid: int, key: str) -> Path:
        """The contents of the VM's disk `key` (e.g. "scsi1") as the import left them."""
        conf = self.vm(vmid)
        assert conf is not None and key in conf, f"VM {vmid} has no {key}: {conf}"
        volume = conf[key].split(",")[0].split(":", 1)[1]
        return self.state / "disks" / volume

    def storage_path(self, name: str) -> Path:
        return Path(json.loads((self.state / "storages.json").read_text())[name]["path"])


# -- the scripts ------------------------------------------------------------------------------


class Fail(Exception):
    def __init__(self, message: str, code: int = 255) -> None:
        super().__init__(message)
        self.code = code


def main(prog: str, argv: list[str]) -> int:
    state = Path(os.environ[ENV])
    with open(state / "calls.jsonl", "a") as log:
        log.write(json.dumps([prog, *argv]) + "\n")
    fail = state / "fail_on.json"
    try:
        if fail.exists():
            rule = json.loads(fail.read_text())
            if [prog, *argv][: len(rule["prefix"])] == rule["prefix"]:
                raise Fail(rule["message"])
        (qm if prog == "qm" else pvesm)(state, argv)
    except Fail as exc:
        print(str(exc), file=sys.stderr)
        return exc.code
    return 0


def options(args: list[str]) -> dict[str, str]:
    out = {}
    it = iter(args)
    for arg in it:
        if not arg.startswith("--"):
            raise Fail(f"400 unable to parse option\n{arg}")
        out[arg[2:]] = next(it, "")
    return out


def storages(state: Path) -> dict:
    return json.loads((state / "storages.json").read_text())


def storage(state: Path, name: str) -> dict:
    store = storages(state).get(name)
    if store is None:
        raise Fail(f"storage '{name}' does not exist")
    return store


def vm_path(state: Path, vmid: str) -> Path:
    return state / "vms" / f"{vmid}.json"


def load_vm(state: Path, vmid: str) -> dict:
    path = vm_path(state, vmid)
    if not path.exists():
        raise Fail(f"Configuration file 'nodes/{NODE}/qemu-server/{vmid}.conf' does not exist", 2)
    return json.loads(path.read_text())


def save_vm(state: Path, vmid: str, conf: dict) -> None:
    vm_path(state, vmid).write_text(json.dumps(conf, indent=1))


def snippet_file(state: Path, volid: str) -> Path:
    store_name, _, rel = volid.partition(":")
    store = storage(state, store_name)
    if "snippets" not in store["content"] or not rel.startswith("snippets/"):
        raise Fail(f"{volid} is not in the snippets directory")
    return Path(store["path"]) / rel


def qm(state: Path, argv: list[str]) -> None:
    if not argv:
        raise Fail("ERROR: no command specified")
    cmd, rest = argv[0], argv[1:]
    if cmd == "list":
        print(f"{'VMID':>10} {'NAME':<20} {'STATUS':<10} {'MEM(MB)':>10} {'BOOTDISK(GB)':>12} {'PID':>10}")
        for path in sorted((state / "vms").glob("*.json"), key=lambda p: int(p.stem)):
            conf = json.loads(path.read_text())
            print(
                f"{path.stem:>10} {conf.get('name', ''):<20} {conf['status']:<10} {conf.get('memory', 2048):>10} {0:>12.2f} {0:>10}"
            )
        return
    if cmd in ("status", "config", "start", "set", "create", "destroy"):
        vmid = rest[0]
        if cmd == "create":
            if vm_path(state, vmid).exists():
                raise Fail(f"unable to create VM {vmid} - VM {vmid} already exists on node '{NODE}'")
            opts = options(rest[1:])
            if "name" in opts and not re.fullmatch(r"[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?", opts["name"]):
                raise Fail("400 Parameter verification failed.\nname: value does not look like a valid DNS name")
            save_vm(state, vmid, {**opts, "status": "stopped"})
            return
        conf = load_vm(state, vmid)
        if cmd == "status":
            print(f"status: {conf['status']}")
        elif cmd == "config":
            for key, value in sorted(conf.items()):
                if key != "status":
                    print(f"{key}: {value}")
        elif cmd == "start":
            conf["status"] = "running"
            save_vm(state, vmid, conf)
        elif cmd == "destroy":
            vm_path(state, vmid).unlink()
        else:
            qm_set(state, vmid, conf, options(rest[1:]))
        return
    if cmd == "disk" and rest[:1] == ["resize"]:
        vmid, disk, size = rest[1:4]
        conf = load_vm(state, vmid)
        if disk not in conf:
            raise Fail(f"disk '{disk}' does not exist")
        conf[disk] += f",size={size}"
        save_vm(state, vmid, conf)
        return
    raise Fail(f"unknown command 'qm {cmd}'")


def qm_set(state: Path, vmid: str, conf: dict, opts: dict[str, str]) -> None:
    for key, value in opts.items():
        if re.fullmatch(r"(scsi|ide|sata|virtio)\d+", key):
            store_name, _, rest = value.partition(":")
            store = storage(state, store_name)
            if rest == "cloudinit":
                if "images" not in store["content"]:
                    raise Fail(f"storage '{store_name}' does not support content-type 'images'")
                value = f"{store_name}:vm-{vmid}-cloudinit,media=cdrom"
            elif rest.startswith("0,import-from="):
                source = rest.split("import-from=", 1)[1].split(",")[0]
                if not os.path.isabs(source) or not os.path.isfile(source):
                    raise Fail(f"could not get file size of {source}")
                if "images" not in store["content"]:
                    raise Fail(f"storage '{store_name}' does not support content-type 'images'")
                disks = sum(1 for v in conf.values() if f":vm-{vmid}-disk-" in str(v))
                (state / "disks").mkdir(exist_ok=True)
                shutil.copyfile(source, state / "disks" / f"vm-{vmid}-disk-{disks}")
                value = f"{store_name}:vm-{vmid}-disk-{disks},imported-from={source},imported-bytes={os.path.getsize(source)}"
        elif key == "cicustom":
            for part in value.split(","):
                _, _, volid = part.partition("=")
                if not snippet_file(state, volid).is_file():
                    raise Fail(f"volume '{volid}' does not exist")
        conf[key] = value
    save_vm(state, vmid, conf)


def pvesm(state: Path, argv: list[str]) -> None:
    cmd, rest = (argv[0], argv[1:]) if argv else ("", [])
    if cmd == "status":
        opts = options(rest)
        stores = storages(state)
        if "storage" in opts:
            storage(state, opts["storage"])
            stores = {opts["storage"]: stores[opts["storage"]]}
        print(f"{'Name':<16} {'Type':<8} {'Status':<10} {'Total':>15} {'Used':>15} {'Available':>15} {'%':>8}")
        for name, store in sorted(stores.items()):
            if "content" in opts and opts["content"] not in store["content"]:
                continue
            print(
                f"{name:<16} {store['type']:<8} {store['status']:<10} {1 << 30:>15} {0:>15} {1 << 30:>15} {'0.00%':>8}"
            )
        return
    if cmd == "path":
        volid = rest[0]
        store_name, _, rel = volid.partition(":")
        store = storage(state, store_name)
        if "path" not in store:
            print(f"/dev/pve/{rel}")
            return
        print(Path(store["path"]) / rel)
        return
    raise Fail(f"unknown command 'pvesm {cmd}'")
