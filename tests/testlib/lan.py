"""Network namespaces on one LAN: a bridge on this machine and a namespace per node plugged into
it, every address in one /24, as machines behind one switch are. For tests whose nodes must be
close by their addresses (a llama.cpp replica over several nodes is placed on one subnet,
server/state/closeness.py), which `testlib.netns.NetNS` and `testlib.shapednet.ShapedStar` (a /30
per namespace, routed through this machine) are not.

`Lan(nodes=3)` makes the bridge `host_addr` (10.232.K.1/24, K picked free) and the namespaces,
node i at 10.232.K.(10 + i), each with a default route through the bridge's address; processes
here reach the nodes on the bridge, the nodes reach each other directly; `LanNode.enter()` runs
a command in one, keeping this machine's mounts. `stop()` (the context's
exit, also after a failed start) kills every process in the namespaces and deletes them, their
veths and the bridge; each step is bounded and one failing does not skip the others. Needs root
and iproute2 (`testlib.netns.preflight`).
"""

from __future__ import annotations

import os
import random
import re
import subprocess

import attrs

from testlib.netns import STOP_TIMEOUT_S, _run, kill_namespace, namespace_pids

PREFIX = "10.232"


@attrs.frozen(kw_only=True)
class LanNode:
    name: str  # the namespace
    veth: str  # this machine's end, a port of the bridge
    node_addr: str

    def enter(self) -> list[str]:
        """A command prefix that runs the command in this namespace. nsenter, not `ip netns exec`,
        which mounts a sysfs of the namespace's own on /sys and so hides /sys/fs/cgroup from the
        command: an agent there could not read the cgroup limit it runs under."""
        return ["nsenter", f"--net=/run/netns/{self.name}", "--"]

    def popen(self, argv: list[str], **kw) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", self.name, *argv], **kw)

    def run(self, *argv: str) -> str:
        return _run("ip", "netns", "exec", self.name, *argv)

    def pids(self) -> list[int]:
        return namespace_pids(self.name)


class Lan:
    def __init__(self, *, nodes: int) -> None:
        used = set(re.findall(rf"inet {re.escape(PREFIX)}\.(\d+)\.", _run("ip", "-4", "-o", "addr", "show")))
        subnet = random.choice([k for k in range(1, 251) if str(k) not in used])
        tag = f"{os.getpid() % 10000}l{subnet}"
        self.bridge = f"lgb{tag}"  # interface names: 15 characters at most
        self.host_addr = f"{PREFIX}.{subnet}.1"
        self.nodes = [
            LanNode(name=f"llmgwl{tag}n{i}", veth=f"lgl{tag}n{i}", node_addr=f"{PREFIX}.{subnet}.{10 + i}")
            for i in range(nodes)
        ]

    def __enter__(self) -> Lan:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        try:
            _run("ip", "link", "add", self.bridge, "type", "bridge")
            _run("ip", "addr", "add", f"{self.host_addr}/24", "dev", self.bridge)
            _run("ip", "link", "set", self.bridge, "up")
            for node in self.nodes:
                _run("ip", "netns", "add", node.name)
                node.run("ip", "link", "set", "lo", "up")
                _run("ip", "link", "add", node.veth, "type", "veth", "peer", "name", "eth0", "netns", node.name)
                _run("ip", "link", "set", node.veth, "master", self.bridge)
                _run("ip", "link", "set", node.veth, "up")
                node.run("ip", "addr", "add", f"{node.node_addr}/24", "dev", "eth0")
                node.run("ip", "link", "set", "eth0", "up")
                node.run("ip", "route", "add", "default", "via", self.host_addr)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for node in self.nodes:
            kill_namespace(node.name, STOP_TIMEOUT_S)
            subprocess.run(["ip", "netns", "del", node.name], capture_output=True, timeout=30)
            subprocess.run(["ip", "link", "del", node.veth], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=30)
