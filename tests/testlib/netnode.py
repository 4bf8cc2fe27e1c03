"""A separate host for tests: a network namespace with its own address, hostname and a real sshd.

The node is this machine seen from inside a network namespace the test creates, reached over a
veth pair (host side HOST_ADDR, node side NODE_ADDR, a /30 of its own). Its sshd runs in a
private mount namespace in which /etc, /usr/local, /var and /tmp are overlays whose writes land in
this test's directory (`written()` lists them: "what was written on the node"), and /root and
/run are fresh empty tmpfs: the login's home is empty, as on a new machine. Everything the node
starts (its agent, engines) lives in those namespaces, and `stop()` kills every process in the
network namespace before deleting it. Needs root (CI runs as root), iproute2 and openssh-server.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import time
from pathlib import Path

from testlib.needs import missing_message
from testlib.netns import _run, free_index, kill_namespace, namespace_pids
from testlib.sshd import SFTP_SERVER, SSHD, keygen, sshd_config

START_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 10.0
OVERLAID = ("/etc", "/usr/local", "/var", "/tmp")
SFTP_LOG = "/run/sftp-test.log"  # on the node (its /run is its own): every file SFTP opened there
# What a node is made with, and the Debian package of each.
TOOLS = (
    ("/usr/sbin/ip", "iproute2"),
    ("/usr/bin/unshare", "util-linux"),
    ("/usr/bin/nsenter", "util-linux"),
    (str(SSHD), "openssh-server"),
    (str(SFTP_SERVER), "openssh-sftp-server"),
)


def preflight() -> str:
    """Why this machine cannot make a NetNode, or "" when it can (a test fails with it: never a skip)."""
    if os.geteuid() != 0:
        return "network namespaces need root: run the suite as root (CI does)"
    for tool, package in TOOLS:
        if not Path(tool).exists():
            return missing_message(tool, package)
    return ""


class NetNode:
    def __init__(
        self,
        root: Path,
        *,
        index: int | None = None,
        binds: dict[str, Path] | None = None,
        hostname: str = "",
        overlays: tuple[str, ...] = (),
    ) -> None:
        """`index` (1-250) picks the namespace's name and its /30 (default: one no other node on this
        machine uses, so two test runs side by side do not share addresses); `binds` mounts host paths
        at node paths (e.g. a llama-server's directory at /mnt) that must already exist on the node's side;
        `overlays` are directories overlaid besides OVERLAID (e.g. /opt, or /usr/bin for a program the
        node's OS would have where this machine's has none)."""
        if index is None:
            index = free_index()
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.name = f"llmgwt{os.getpid() % 10000}n{index}"
        self.veth = f"lgv{os.getpid() % 10000}n{index}"
        self.host_addr = f"10.231.{index}.1"
        self.node_addr = f"10.231.{index}.2"
        self.hostname = hostname or f"node{index}"
        self.binds = dict(binds or {})
        # /tmp last: once it is overlaid, the uppers (under this test's directory in /tmp) are seen
        # through that overlay, and an overlay cannot have its upper on another.
        self.overlaid = tuple(overlays) + OVERLAID
        self.log = root / "sshd.log"
        self.client_key = keygen(root / "client_key", "llmgw-test-client")
        self.host_key = keygen(root / "host_key", "llmgw-test-node")
        # Inside the node's /etc, so that any login can read it: sshd reads it as the user, and
        # this test's own directory is root's alone.
        self.authorized_keys = self.upper("/etc") / "ssh" / "test_authorized_keys"
        self.authorized_keys.parent.mkdir(parents=True, exist_ok=True)
        self.authorized_keys.write_text((root / "client_key.pub").read_text())
        self.authorized_keys.chmod(0o644)
        self._proc: subprocess.Popen | None = None

    @property
    def target(self) -> str:
        return f"root@{self.node_addr}"

    def upper(self, path: str) -> Path:
        return self.root / "upper" / path.strip("/").replace("/", "_")

    def start(self) -> None:
        _run("ip", "netns", "add", self.name)
        try:
            _run("ip", "link", "add", self.veth, "type", "veth", "peer", "name", "eth0", "netns", self.name)
            _run("ip", "addr", "add", f"{self.host_addr}/30", "dev", self.veth)
            _run("ip", "link", "set", self.veth, "up")
            for argv in (
                ("ip", "link", "set", "lo", "up"),
                ("ip", "addr", "add", f"{self.node_addr}/30", "dev", "eth0"),
                ("ip", "link", "set", "eth0", "up"),
            ):
                _run("ip", "netns", "exec", self.name, *argv)
            self._start_sshd()
        except BaseException:
            self.stop()
            raise

    def _start_sshd(self) -> None:
        # Through /proc, not hostname(1): the kernel takes names the tool refuses, and tests need those.
        lines = ["set -e", f"printf %s {shlex.quote(self.hostname)} > /proc/sys/kernel/hostname"]
        for path in self.overlaid:
            upper, work = self.upper(path), self.root / "work" / path.strip("/").replace("/", "_")
            upper.mkdir(parents=True, exist_ok=True)
            work.mkdir(parents=True, exist_ok=True)
            os.chmod(upper, os.stat(path).st_mode & 0o7777)  # the overlay's top takes the upper's mode: /tmp is 1777
            lines.append(f"mount -t overlay overlay -o lowerdir={path},upperdir={upper},workdir={work} {path}")
        for node_path, host_path in self.binds.items():  # before /root is hidden: a source may be there
            lines.append(f"mount --bind {host_path} {node_path}")
        lines += ["mount -t tmpfs -o mode=0700 tmpfs /root", "mount -t tmpfs -o mode=0755 tmpfs /run"]
        lines.append("mkdir -p /run/sshd")
        # Every login's SFTP appends to it (sftp-server runs as the login): writable by all.
        lines.append(f"touch {SFTP_LOG} && chmod 0666 {SFTP_LOG}")
        lines.append(f"exec {SSHD} -D -e -f {self._config()}")
        script = self.root / "node-init.sh"
        script.write_text("\n".join(lines) + "\n")
        with self.log.open("ab") as log:
            self._proc = subprocess.Popen(
                [
                    "ip",
                    "netns",
                    "exec",
                    self.name,
                    "unshare",
                    "--mount",
                    "--uts",
                    "--propagation",
                    "private",
                    "sh",
                    str(script),
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while f"Server listening on {self.node_addr} port 22" not in self.log_text():
            if self._proc.poll() is not None:
                raise RuntimeError(f"the node's sshd exited with {self._proc.returncode}:\n{self.log_text()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the node's sshd did not listen within {START_TIMEOUT_S} s:\n{self.log_text()}")
            time.sleep(0.05)

    def _config(self) -> Path:
        config = self.root / "sshd_config"
        config.write_text(
            sshd_config(
                listen=f"{self.node_addr}:22",
                host_key=self.host_key,
                pid_file="/run/sshd-test.pid",  # inside the node
                authorized_keys="/etc/ssh/test_authorized_keys",
                sftp_log=SFTP_LOG,
            )
        )
        return config

    def pids(self) -> list[int]:
        return namespace_pids(self.name)

    def stop(self) -> None:
        kill_namespace(self.name, STOP_TIMEOUT_S)
        if self._proc is not None:
            try:
                self._proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass
            self._proc = None
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", self.veth], capture_output=True, timeout=30)

    def log_text(self) -> str:
        return self.log.read_bytes().decode("utf-8", "replace") if self.log.exists() else ""

    def sftp_written(self) -> list[str]:
        """Every file SFTP opened for writing on the node, in order (the node's paths)."""
        done = self.run("cat", SFTP_LOG)
        return re.findall(r'open "([^"]+)" flags WRITE', done.stdout) if done.returncode == 0 else []

    def connections(self) -> int:
        """How many SSH connections reached the node's sshd."""
        return self.log_text().count("Connection from ")

    def written(self) -> list[str]:
        """Every file or directory written on the node under the overlaid trees, as node paths."""
        out = []
        for path in self.overlaid:
            upper = self.upper(path)
            for dirpath, dirnames, filenames in os.walk(upper):
                for name in dirnames + filenames:
                    out.append(path + "/" + str((Path(dirpath) / name).relative_to(upper)))
        return sorted(out)

    def read(self, node_path: str) -> bytes:
        """A file as the node sees it: its overlay's copy if written, else this machine's."""
        for path in self.overlaid:
            if node_path.startswith(path + "/"):
                copy = self.upper(path) / node_path[len(path) + 1 :]
                if copy.exists():
                    return copy.read_bytes()
        return Path(node_path).read_bytes()

    def processes(self) -> list[str]:
        """The command lines of the processes in the node's network namespace (not the whole machine's)."""
        out = []
        for pid in self.pids():
            try:
                raw = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue  # exited meanwhile
            out.append(" ".join(part.decode("utf-8", "replace") for part in raw.split(b"\0") if part))
        return out

    def write(self, node_path: str, text: str) -> None:
        """Put a file on the node (through its overlays, as root there). A symlink there is replaced,
        not followed: /etc/os-release points into /usr/lib, which is this machine's own."""
        script = 'mkdir -p "$(dirname "$1")" && rm -f "$1" && cat > "$1"'
        done = self.run("sh", "-c", script, "sh", node_path, input=text)
        if done.returncode != 0:
            raise RuntimeError(f"writing {node_path} on the node failed: {done.stderr}")

    def run(self, *argv: str, timeout_s: float = 30, input: str | None = None) -> subprocess.CompletedProcess:
        """A command inside the node's namespaces (its network, its mounts: via nsenter on sshd)."""
        assert self._proc is not None, "the node is not running"
        pid = self._proc.pid  # sshd itself: ip netns exec, unshare and sh each exec the next
        return subprocess.run(
            ["nsenter", "-t", str(pid), "-n", "-m", *argv],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            input=input,
        )
