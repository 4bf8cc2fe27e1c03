"""A network namespace joined to this machine by a veth pair, for tests whose peer must go silent.

`NetNS.start()` makes the namespace, the veth pair and a /30 of its own (this machine's side
`host_addr`, the namespace's `node_addr`); `popen` runs a process inside; `cut()` takes the link
down and `restore()` brings it back; `stop()` kills every process inside and deletes both ends.
Use it as a context manager, which always stops it.

A cut is made on the namespace's side, and this machine's neighbour entry for `node_addr` is
pinned, so this machine keeps its route and its peer's MAC address and sends into silence: no
error comes back, as when a node's cable or switch port dies. Measured here, it fails
connections exactly as a cut behind a switch (a bridge in a third namespace, this machine's link
staying up) does: connects time out, a request written onto an open connection is unacknowledged,
keepalive probes go unanswered. Taking this machine's side down instead is not a cut: the route
goes with it, so connects fail at once or, on a machine with a default route, leave for the real
network (where something accepted them). Needs root and iproute2.

`add_link()` joins the namespace to this machine by one more veth pair, with a /30 of its own
(`Link`: eth1 inside, then eth2...), so that one path can be cut while another stays: a control
plane whose agents reach it on one link and a gateway on another, say. `cut(link)` and
`restore(link)` take one down and up (the first, by default).
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import time
from pathlib import Path

import attrs

from testlib.needs import missing_message

STOP_TIMEOUT_S = 10.0
# When Linux sends an unanswered SYN again, in seconds after the first (initial RTO 1 s, doubling):
# a connect into a cut link is tried at these moments, and a link restored between two of them
# is found at the next.
SYN_RESENDS_S = (1.0, 3.0, 7.0, 15.0, 31.0)


def _run(*argv: str) -> str:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({out.returncode}): {out.stderr.strip()}")
    return out.stdout


def free_index() -> int:
    """A /30 under 10.231.0.0/16 that no interface on this machine has."""
    used = set(re.findall(r"inet 10\.231\.(\d+)\.", _run("ip", "-4", "-o", "addr", "show")))
    free = [i for i in range(1, 251) if str(i) not in used]
    if not free:
        raise RuntimeError("every 10.231.X.0/30 is in use: stale test namespaces? see `ip netns list`")
    return random.choice(free)


def namespace_pids(name: str) -> list[int]:
    """Every process in network namespace `name` ([] once it is gone)."""
    try:
        return [int(p) for p in _run("ip", "netns", "pids", name).split()]
    except RuntimeError:
        return []


def kill_namespace(name: str, timeout_s: float) -> None:
    """SIGKILL every process in the namespace until none is left (or `timeout_s` passed)."""
    deadline = time.monotonic() + timeout_s
    while (pids := namespace_pids(name)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def syn_sent(dst: str) -> set[str]:
    """The local ends (ADDR:PORT) of this machine's connects to `dst` waiting for an answer."""
    out = _run("ss", "-Htn", "state", "syn-sent", "dst", dst)
    return {line.split()[2] for line in out.splitlines() if line.strip()}


def preflight() -> str:
    """Why this machine cannot make a NetNS, or "" when it can (a test fails with it: never a skip)."""
    if os.geteuid() != 0:
        return "network namespaces need root: run the suite as root (CI does)"
    if not Path("/usr/sbin/ip").exists():
        return missing_message("/usr/sbin/ip", "iproute2")
    return ""


@attrs.frozen(kw_only=True)
class Link:
    """One veth pair: this machine's end `veth` with `host_addr`, the namespace's `inside` with
    `node_addr`."""

    veth: str
    inside: str
    host_addr: str
    node_addr: str

    @classmethod
    def numbered(cls, index: int, inside: str) -> Link:
        return cls(
            veth=f"lgc{os.getpid() % 10000}n{index}",  # interface names: 15 characters at most
            inside=inside,
            host_addr=f"10.231.{index}.1",
            node_addr=f"10.231.{index}.2",
        )


class NetNS:
    def __init__(self, index: int | None = None, *, address: bool = True, mac: str | None = None) -> None:
        """`index` (1-250) picks the names and the /30 under 10.231.0.0/16 (default: one no
        interface on this machine has). `address=False` leaves the namespace's eth0 down and
        without an address, for whatever runs inside to configure (cloud-init); `mac` sets its
        MAC address."""
        index = free_index() if index is None else index
        self.name = f"llmgwc{os.getpid() % 10000}n{index}"
        self.link = Link.numbered(index, "eth0")
        self.links = [self.link]
        self.veth, self.host_addr, self.node_addr = self.link.veth, self.link.host_addr, self.link.node_addr
        self.address = address
        self.mac = mac

    def __enter__(self) -> NetNS:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        _run("ip", "netns", "add", self.name)
        try:
            self.run("ip", "link", "set", "lo", "up")
            self._join(self.link, address=self.address, mac=self.mac)
        except BaseException:
            self.stop()
            raise

    def add_link(self) -> Link:
        """One more veth pair to this machine, up, with a /30 of its own (after `start`)."""
        link = Link.numbered(free_index(), f"eth{len(self.links)}")
        self.links.append(link)
        self._join(link, address=True, mac=None)
        return link

    def _join(self, link: Link, *, address: bool, mac: str | None) -> None:
        _run("ip", "link", "add", link.veth, "type", "veth", "peer", "name", link.inside, "netns", self.name)
        _run("ip", "addr", "add", f"{link.host_addr}/30", "dev", link.veth)
        _run("ip", "link", "set", link.veth, "up")
        inside = []
        if mac:
            inside.append(("ip", "link", "set", link.inside, "address", mac))
        if address:
            inside += [
                ("ip", "addr", "add", f"{link.node_addr}/30", "dev", link.inside),
                ("ip", "link", "set", link.inside, "up"),
            ]
        for argv in inside:
            self.run(*argv)
        inside_mac = self.run("cat", f"/sys/class/net/{link.inside}/address").strip()
        _run("ip", "neigh", "replace", link.node_addr, "lladdr", inside_mac, "dev", link.veth, "nud", "permanent")

    def run(self, *argv: str) -> str:
        """A short command inside the namespace; its output."""
        return _run("ip", "netns", "exec", self.name, *argv)

    def popen(self, argv: list[str], **kw) -> subprocess.Popen:
        """A process inside the namespace (`ip netns exec` execs it: the pid is the process's own)."""
        return subprocess.Popen(["ip", "netns", "exec", self.name, *argv], **kw)

    def cut(self, link: Link | None = None) -> None:
        self.run("ip", "link", "set", (link or self.link).inside, "down")

    def restore(self, link: Link | None = None) -> None:
        self.run("ip", "link", "set", (link or self.link).inside, "up")

    def pids(self) -> list[int]:
        return namespace_pids(self.name)

    def stop(self) -> None:
        kill_namespace(self.name, STOP_TIMEOUT_S)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, timeout=30)
        for link in self.links:
            subprocess.run(["ip", "link", "del", link.veth], capture_output=True, timeout=30)
