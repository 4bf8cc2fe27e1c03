"""A star of network namespaces joined through this machine, each link shaped to a rate, for
benchmarks of bytes moving between a cluster's nodes and from the internet.

`ShapedStar(root, nodes=N, node_rate=..., source_rate=...)` makes N node namespaces and one more,
`source` (the internet server), each a `testlib.netns.NetNS`: a veth pair to this machine with a
/30 of its own under 10.231.0.0/16. Every namespace routes 10.231.0.0/16 through its `host_addr`,
and this machine forwards between the links, so a node reaches another node and the source at
their `node_addr`; processes here (the control plane) reach each namespace at its `node_addr`, and
a namespace reaches them at its `host_addr`. Run processes inside with `ns.popen`.

Shaping is tc's token bucket filter on both ends of each veth: this machine's end's egress is what
the namespace downloads, the namespace's end's egress what it uploads, each at the link's rate
(`node_rate` for nodes, `source_rate` for the source). A transfer from node A to node B passes A's
upload and B's download; two downloads into one node share its download.

Forwarding is switched on for this star's veths alone (net.ipv4.conf.<veth>.forwarding, which is
what the kernel asks of the device a packet came in on), not with net.ipv4.ip_forward: that one
is the machine's, and two stars (or a test and CI) restoring it in the wrong order would cut each
other off; the per-device switch goes with the veth. Where iptables' FORWARD policy is DROP, an
ACCEPT for 10.231.0.0/16 is inserted and taken out again at stop. `stop()` (the context's exit,
also after an error in `start`) kills every process in the namespaces and deletes them and their
veths, with the qdiscs on them; each step is bounded and one failing does not skip the others.

tbf counts whole frames (1514 bytes for TCP's 1448 of payload, timestamps on): a TCP stream's
goodput tops out at 0.956 of the rate. The defaults, measured with Python endpoints (1 MiB
sendall / recv_into) on a 2-core machine that other test runs kept at a load average of 5 to 14:
- burst 256kb. veth has TSO/GSO on, so tbf is handed packets of up to 64 KiB, and one larger than
  the bucket it cuts into frames itself. Bursts of 16kb, 32kb and 64kb gave 0.48-0.82 of 1gbit
  and took 0.5-0.65 cores of softirq; 128kb to 512kb 0.92-0.97 (once 0.85) and 0.02-0.15. 256kb holds
  four such packets and lets a link's first 256 KiB through at once (2 ms at 1gbit; 3% of an
  8 MiB transfer at any rate). The offloads stay on: the larger bucket is what spares segmenting.
- latency 20ms: a queue of rate x 20 ms + burst (2.7 MB at 1gbit), deep enough for a few streams
  and a bound on what a control-plane packet behind them waits. 5ms and 50ms did no better or
  worse within the noise of that load: two cubic streams into one 1gbit link got 0.77-0.93 at
  5ms and 0.80-0.90 at 20ms, five runs each side by side; BBR (this machine's default, which the
  namespaces inherit) 0.88-0.96 at each of 5ms, 20ms and 50ms.
- Goodput, worst and best of 3 (96 MiB a stream at 300mbit and 1gbit, 24 MiB at 50mbit and
  200mbit): one stream at 1gbit (node to node) 0.86-0.96 of the rate, at 300mbit (source to a
  node) 0.93-0.96; two into one node's 1gbit 0.88-0.96 (cubic 0.85-0.94), two out of one node's
  0.97; 50mbit 0.96-0.97, 200mbit 0.92-0.97. The low ones are most likely the endpoints short of
  CPU (they came with the highest loads).
- CPU at 1 Gbit/s of one stream: 0.2-0.4 cores of the 2 for both endpoints' processes (user and
  system time) and 0.05-0.15 of softirq. Unshaped, the same
  veths moved 6.2-7.4 Gbit/s for 0.9-1.2 cores.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from testlib.needs import find, missing_message
from testlib.netns import NetNS, _run
from testlib.netns import preflight as netns_preflight

NET = "10.231.0.0/16"
BURST = "256kb"
LATENCY = "20ms"
# What a cleanup step may raise: a command failing or timing out (netns._run), a file not written.
CLEANUP_ERRORS = (RuntimeError, OSError, subprocess.SubprocessError)

_UNITS = {
    "bit": 1,
    "kbit": 10**3,
    "mbit": 10**6,
    "gbit": 10**9,
    "tbit": 10**12,
    "kibit": 2**10,
    "mibit": 2**20,
    "gibit": 2**30,
    "tibit": 2**40,
    "bps": 8,
    "kbps": 8 * 10**3,
    "mbps": 8 * 10**6,
    "gbps": 8 * 10**9,
    "tbps": 8 * 10**12,
    "kibps": 8 * 2**10,
    "mibps": 8 * 2**20,
    "gibps": 8 * 2**30,
    "tibps": 8 * 2**40,
}


def rate_bits(rate: str) -> int:
    """A tc rate ("1gbit", "300mbit", "12.5mbps": bps is bytes a second, as tc has it) in bit/s."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-z]+)\s*", rate.lower())
    if not m or m.group(2) not in _UNITS:
        raise ValueError(f"rate {rate!r} is not a tc rate: a number and one of {', '.join(_UNITS)} (e.g. '1gbit')")
    return round(float(m.group(1)) * _UNITS[m.group(2)])


def preflight() -> str:
    """Why this machine cannot make a ShapedStar, or "" when it can (a test fails with it: never a skip)."""
    if why := netns_preflight():
        return why
    if find("tc") is None:
        return missing_message("tc", "iproute2")
    if not Path("/proc/sys/net/ipv4/conf/default/forwarding").exists():
        return "/proc/sys/net/ipv4 is missing: this kernel has no IPv4 sysctls to switch forwarding on with"
    return ""


def _forward_accept_rule() -> list[str]:
    """The iptables command that would let 10.231.0.0/16 through FORWARD, less its -I or -D, where
    that chain's policy is DROP (a Docker host's is); [] where it is not, or there is no iptables."""
    iptables = find("iptables")
    if iptables is None:
        return []
    if "-P FORWARD DROP" not in _run(iptables, "-w", "5", "-S", "FORWARD").splitlines():
        return []
    return [iptables, "-w", "5", "FORWARD", "-s", NET, "-d", NET, "-j", "ACCEPT"]


class ShapedStar:
    def __init__(
        self,
        root: Path,
        *,
        nodes: int = 8,
        node_rate: str = "1gbit",
        source_rate: str = "300mbit",
        burst: str = BURST,
        latency: str = LATENCY,
    ) -> None:
        """`root` receives the qdiscs' counters at stop (qdisc-stats.txt: what each end sent,
        dropped and held back, to read after a benchmark); `burst` and `latency` are tbf's (see
        above)."""
        rate_bits(node_rate), rate_bits(source_rate)  # a bad rate fails here, before any namespace
        self.root = root
        self.node_count = nodes
        self.node_rate = node_rate
        self.source_rate = source_rate
        self.burst = burst
        self.latency = latency
        self.nodes: list[NetNS] = []
        self.source: NetNS | None = None
        self._rates: dict[str, str] = {}
        self._accept: list[str] = []
        self._tc = "tc"

    def __enter__(self) -> ShapedStar:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def namespaces(self) -> list[NetNS]:
        """The nodes, then the source."""
        return self.nodes + ([self.source] if self.source else [])

    def rate_bits(self, ns: NetNS) -> int:
        """The rate of `ns`'s link, each way, in bit/s."""
        return rate_bits(self._rates[ns.name])

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self._tc = find("tc") or "tc"
        try:
            if accept := _forward_accept_rule():
                _run(*accept[:3], "-I", *accept[3:])
                self._accept = accept
            for i in range(self.node_count + 1):
                ns = NetNS()  # an index no interface here has: each is picked after the last started
                if i < self.node_count:
                    self.nodes.append(ns)
                    self._rates[ns.name] = self.node_rate
                else:
                    self.source = ns
                    self._rates[ns.name] = self.source_rate
                ns.start()
                self._join(ns)
        except BaseException:
            self.stop()
            raise

    def _join(self, ns: NetNS) -> None:
        Path(f"/proc/sys/net/ipv4/conf/{ns.veth}/forwarding").write_text("1\n")
        ns.run("ip", "route", "add", NET, "via", ns.host_addr)
        tbf = ["root", "tbf", "rate", self._rates[ns.name], "burst", self.burst, "latency", self.latency]
        _run(self._tc, "qdisc", "add", "dev", ns.veth, *tbf)
        ns.run(self._tc, "qdisc", "add", "dev", ns.link.inside, *tbf)

    def qdisc_stats(self) -> str:
        """`tc -s qdisc` of both ends of every link, under its namespace's name and direction."""
        out = []
        for ns in self.namespaces:
            out.append(f"{ns.name} download ({ns.veth} here):\n{self._show(ns, inside=False)}")
            out.append(f"{ns.name} upload ({ns.link.inside} inside):\n{self._show(ns, inside=True)}")
        return "".join(out)

    def _show(self, ns: NetNS, *, inside: bool) -> str:
        argv = (self._tc, "-s", "qdisc", "show", "dev", ns.link.inside if inside else ns.veth)
        try:
            return ns.run(*argv) if inside else _run(*argv)
        except CLEANUP_ERRORS as e:  # a namespace a failed start left half made
            return f"not read: {e}\n"

    def stop(self) -> None:
        """Everything `start` made is undone, each step tried whatever the others did; the first
        failure is raised once all were tried."""
        failures: list[Exception] = []
        if self.namespaces:
            try:
                (self.root / "qdisc-stats.txt").write_text(self.qdisc_stats())
            except OSError as e:
                failures.append(e)
        for ns in self.namespaces:
            try:
                ns.stop()  # its veth goes, and the qdiscs on both ends with it
            except CLEANUP_ERRORS as e:
                failures.append(e)
        self.nodes, self.source = [], None
        if self._accept:
            try:
                _run(*self._accept[:3], "-D", *self._accept[3:])
                self._accept = []
            except CLEANUP_ERRORS as e:
                failures.append(e)
        if failures:
            raise failures[0]
