"""The shaped star of the weights benchmark: every namespace reaches the others and this machine,
a bulk transfer moves at its link's rate (each direction's shaping seen on its own), and nothing of
it remains after the context exits."""

from __future__ import annotations

import json
import select
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from testlib.netns import NetNS
from testlib.shapednet import ShapedStar, preflight

PORT = 5201
WAIT_S = 15.0
IP_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")

# Each server prints "listening" once it accepts connections, so the test waits for that line, not a while.
ECHO = f"""
import socket
s = socket.create_server(("0.0.0.0", {PORT}))
print("listening", flush=True)
while True:
    c, _ = s.accept()
    with c:
        c.sendall(c.recv(64))
"""
ASK = f"""
import socket, sys
with socket.create_connection((sys.argv[1], {PORT}), timeout=10) as c:
    c.sendall(b"ping " + sys.argv[1].encode())
    print(c.recv(64).decode())
"""
# The time from the first byte to the end: the connect and the sender's start are not the link's.
RECEIVE = f"""
import json, socket, time
s = socket.create_server(("0.0.0.0", {PORT}))
print("listening", flush=True)
c, _ = s.accept()
buf, got, first = bytearray(1 << 20), 0, None
while n := c.recv_into(buf):
    first = first or time.monotonic()
    got += n
print(json.dumps({{"bytes": got, "seconds": time.monotonic() - first}}), flush=True)
"""
CALL_BACK = """
import socket, sys
socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10).sendall(b"hi")
"""
SEND = f"""
import socket, sys
with socket.create_connection((sys.argv[1], {PORT}), timeout=10) as c:
    block = bytes(1 << 20)
    for _ in range(int(sys.argv[2])):
        c.sendall(block)
"""


def serve(ns: NetNS, script: str) -> subprocess.Popen:
    """A Python server in `ns`, once it listens."""
    proc = ns.popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert line(proc) == "listening"
    return proc


def line(proc: subprocess.Popen, timeout_s: float = WAIT_S) -> str:
    """The next line `proc` prints, within `timeout_s`."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    assert ready, f"no line from {proc.args} in {timeout_s} s"
    return proc.stdout.readline().strip()


def stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(timeout=WAIT_S)


def transfer(src: NetNS | None, dst: NetNS, mib: int) -> float:
    """Goodput in bit/s of `mib` MiB sent over one TCP connection from `src` (None: this machine)
    to `dst`."""
    python = ["ip", "netns", "exec", src.name, sys.executable] if src else [sys.executable]
    receiver = serve(dst, RECEIVE)
    try:
        subprocess.run([*python, "-c", SEND, dst.node_addr, str(mib)], check=True, timeout=WAIT_S)
        done = json.loads(line(receiver))
    finally:
        stop(receiver)
    assert done["bytes"] == mib << 20
    return done["bytes"] * 8 / done["seconds"]


def test_a_shaped_star_connects_shapes_both_ways_and_leaves_nothing(tmp_path: Path) -> None:
    why = preflight()
    if why:
        pytest.fail(why)  # not a skip: `./pants test` provides iproute2; root is the runner's to give
    ip_forward = IP_FORWARD.read_text()
    with ShapedStar(tmp_path / "net", nodes=3, node_rate="200mbit", source_rate="50mbit") as net:
        assert net.source is not None
        node0, node1, node2 = net.nodes
        made = [(ns.name, ns.veth) for ns in net.namespaces]

        # Node 0 reaches node 2 and the source through this machine; this machine reaches a node at
        # its node_addr, and a node reaches this machine at its host_addr.
        echoes = [serve(ns, ECHO) for ns in (node2, net.source)]
        for ns in (node2, net.source):
            assert node0.run(sys.executable, "-c", ASK, ns.node_addr).strip() == f"ping {ns.node_addr}"
        with socket.create_connection((node2.node_addr, PORT), timeout=10) as c:
            c.sendall(b"from here")
            assert c.recv(64) == b"from here"
        with socket.create_server((node0.host_addr, 0)) as here:
            here.settimeout(10)
            port = str(here.getsockname()[1])
            caller = node0.popen([sys.executable, "-c", CALL_BACK, node0.host_addr, port])
            conn, _ = here.accept()
            with conn:
                conn.settimeout(10)
                assert conn.recv(16) == b"hi"
            assert caller.wait(timeout=WAIT_S) == 0
        for echo in echoes:
            stop(echo)

        # The source's upload is shaped on its namespace's end alone, node 2's download from this
        # machine on this machine's end alone; node 1 to node 2 passes both kinds, at one rate.
        rates = {
            "source upload": (transfer(net.source, node0, 8), net.rate_bits(net.source)),
            "node 2 download": (transfer(None, node2, 16), net.rate_bits(node2)),
            "node 1 to node 2": (transfer(node1, node2, 16), net.rate_bits(node1)),
        }
        for what, (got, rate) in rates.items():
            assert 0.75 * rate <= got <= 1.25 * rate, f"{what}: {got / 1e6:.1f} Mbit/s on a {rate / 1e6:g} Mbit/s link"

    assert IP_FORWARD.read_text() == ip_forward
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=30).stdout
    qdiscs = subprocess.run(["tc", "qdisc", "show"], capture_output=True, text=True, timeout=30).stdout
    for name, veth in made:
        assert name not in namespaces.split()
        assert f" {veth}@" not in links and f" {veth}:" not in links
        assert f" dev {veth} " not in qdiscs
    assert (tmp_path / "net" / "qdisc-stats.txt").read_text().count("tbf") == 8
