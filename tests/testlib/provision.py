"""A Proxmox host for testing llmgw-provision-node: the stand-in qm/pvesm (testlib.proxmox), a cloud
image, keys, a bridge; and the tool itself, run as a program or loaded as a module."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import struct
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType

import attrs
import pytest

from testlib.proc import build_root
from testlib.proxmox import FakeProxmox
from testlib.pythons import find_python39

KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl root@pve"
IMAGE_GIB = 2
ARCH = {"x86_64": "amd64", "aarch64": "arm64"}[os.uname().machine]


def tool_path() -> Path:
    path = build_root() / "tools" / "provision" / "llmgw-provision-node"
    if not path.is_file():
        pytest.fail(f"{path} is not here: tests/provision/BUILD must depend on tools/provision:llmgw-provision-node")
    return path


def load_tool() -> ModuleType:
    """The tool as a module (it has no .py name, so by its loader)."""
    loader = importlib.machinery.SourceFileLoader("llmgw_provision_node", str(tool_path()))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[loader.name] = module  # NamedTuple and dataclass-like classes look their module up
    loader.exec_module(module)
    return module


def qcow2(path: Path, virtual_bytes: int) -> Path:
    """A file with a qcow2 header saying `virtual_bytes`: all the tool and the stand-in read."""
    header = b"QFI\xfb" + struct.pack(">I", 3) + b"\0" * 16 + struct.pack(">Q", virtual_bytes)
    path.write_bytes(header + b"\0" * 480)
    return path


def release_file(directory: Path, body: bytes = b"print('llmgw 0.0.0')\n", version: str = "0.0.0") -> Path:
    """A zipapp named like a release, for this machine's architecture."""
    path = directory / f"llmgw-{version}-linux-{ARCH}.pyz"
    with open(path, "wb") as f:
        f.write(b"#!/usr/bin/env python3\n")  # as the release's: it runs as a program
        with zipfile.ZipFile(f, "w") as z:
            z.writestr("__main__.py", body)
    return path


@attrs.frozen
class Host:
    fake: FakeProxmox
    image: Path
    keys: Path
    net_root: Path
    interfaces: Path
    resolv: Path
    tmp: Path

    def base(self) -> list[str]:
        return [
            "--vmid", "144",
            "--name", "llmgw-node04",
            "--ip", "10.0.0.144/24",
            "--gateway", "10.0.0.1",
            "--image", str(self.image),
            "--ssh-keys", str(self.keys),
            "--net-root", str(self.net_root),
            "--interfaces", str(self.interfaces),
            "--resolv-conf", str(self.resolv),
        ]  # fmt: skip

    def run(
        self, *args: str, base: bool = True, python: str = sys.executable, replace: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        argv = self.base() if base else []
        for flag, value in (replace or {}).items():  # a flag given twice: argparse takes the last
            argv += [flag, value]
        return subprocess.run(
            [python, str(tool_path()), *argv, *args],
            env=self.fake.env(),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    def snippets(self) -> Path:
        return self.fake.storage_path("local") / "snippets"


def make_host(tmp: Path, storages: dict | None = None) -> Host:
    fake = FakeProxmox.make(tmp / "pve", storages)
    net_root = tmp / "net"
    (net_root / "vmbr0").mkdir(parents=True)
    interfaces = tmp / "interfaces"
    interfaces.write_text("auto lo\niface lo inet loopback\n")
    keys = tmp / "authorized_keys"
    keys.write_text(f"# the hypervisor's\n{KEY}\n")
    resolv = tmp / "resolv.conf"
    resolv.write_text("search example.net\nnameserver 10.0.0.53\n")
    image = qcow2(tmp / "debian-12-generic-amd64.qcow2", IMAGE_GIB << 30)
    return Host(fake, image, keys, net_root, interfaces, resolv, tmp)


def python39() -> str:
    """A CPython 3.9, where ./pants finds the one it runs Pants with (so every test machine has one)."""
    return str(find_python39())
