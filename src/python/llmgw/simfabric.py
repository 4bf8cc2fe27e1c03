"""A simulated InfiniBand fabric for `llmgw up --fabric`: what the hardware edge would show.

For each simulated node it writes a sysfs-shaped tree (what the kernel writes under
/sys/class/infiniband for two active HDR ports) and a stand-in for `sminfo` that reports one
subnet manager GUID for the whole fabric. The agent's real discovery reads them, exactly as
the tests' fixtures are read: only the hardware is simulated.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

ADAPTERS = ("mlx5_0", "mlx5_1")


def _guid(seed: str) -> str:
    h = hashlib.sha256(seed.encode()).hexdigest()[:16]
    return ":".join(h[i : i + 4] for i in range(0, 16, 4))


def write_node(directory: Path, *, fabric: str, node: str, index: int) -> tuple[Path, Path]:
    """Writes DIR/infiniband/... and DIR/sminfo; returns (ib_root, sminfo path)."""
    ib_root = directory / "infiniband"
    for n, adapter in enumerate(ADAPTERS):
        guid = _guid(f"{node}/{adapter}")
        base = ib_root / adapter
        port = base / "ports" / "1"
        (port / "gids").mkdir(parents=True, exist_ok=True)
        for d in (directory, ib_root, base, base / "ports", port, port / "gids"):
            d.chmod(0o755)  # as sysfs has them, whatever the umask
        files = {
            base / "node_guid": guid,
            base / "node_type": "1: CA",
            base / "node_desc": f"{node} {adapter}",
            base / "hca_type": "MT4129",
            port / "state": "4: ACTIVE",
            port / "phys_state": "5: LinkUp",
            port / "link_layer": "InfiniBand",
            port / "rate": "200 Gb/sec (4X HDR)",
            port / "lid": hex(2 + index * len(ADAPTERS) + n),
            port / "sm_lid": "0x1",
            port / "gids" / "0": "fe80:0000:0000:0000:" + guid,
        }
        for path, text in files.items():
            path.write_text(text + "\n")
            path.chmod(0o644)
    sm_guid = "0x" + hashlib.sha256(f"sm/{fabric}".encode()).hexdigest()[:16]
    sminfo = directory / "sminfo"
    sminfo.write_text(
        "#!/bin/sh\n"
        "# Simulated sminfo (llmgw up --fabric): every port here sees the fabric's one subnet manager.\n"
        f'echo "sminfo: sm lid 1 sm guid {sm_guid}, activity count 1 priority 15 state 3 SMINFO_MASTER"\n'
    )
    sminfo.chmod(0o755)
    return ib_root, sminfo
