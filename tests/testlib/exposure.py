"""What a process exposes to the rest of the machine, read from /proc as any local user could.

`listening(pid)`: the TCP addresses the process listens on (its socket inodes, found in
/proc/PID/net/tcp and tcp6, which list the sockets of its network namespace). `cmdlines_holding`:
every process whose argv holds a given secret (/proc/PID/cmdline is world-readable).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from pathlib import Path

LISTEN = "0A"  # TCP_LISTEN, as /proc/net/tcp writes a socket's state


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes


def _address(hex_addr: str, family: int) -> str:
    raw = bytes.fromhex(hex_addr)
    # The kernel prints each 32-bit word of the address in host byte order.
    words = struct.unpack(f"<{len(raw) // 4}I", raw)
    packed = struct.pack(f">{len(words)}I", *words)
    return str(ipaddress.ip_address(socket.inet_ntop(family, packed)))


def listening(pid: int) -> list[tuple[str, int]]:
    """Every (address, port) on which `pid` has a listening TCP socket, sorted."""
    inodes = _socket_inodes(pid)
    found = []
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        table = Path(f"/proc/{pid}/net/{name}")
        if not table.exists():
            continue
        for line in table.read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == LISTEN and inode in inodes:
                hex_addr, hex_port = local.split(":")
                found.append((_address(hex_addr, family), int(hex_port, 16)))
    return sorted(found)


def cmdlines_holding(secret: str) -> list[tuple[int, list[str]]]:
    """Every live process whose argv contains `secret`, with that argv."""
    needle = secret.encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            raw = Path(entry.path, "cmdline").read_bytes()
        except OSError:
            continue  # gone meanwhile
        if needle in raw:
            found.append((int(entry.name), [a.decode(errors="replace") for a in raw.split(b"\0") if a]))
    return found
