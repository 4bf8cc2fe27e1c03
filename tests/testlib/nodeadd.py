"""What `llmgw node add`'s end-to-end tests share: a release built from this checkout, and a
real `llmgw server` whose agent port faces a test node (testlib.netnode.NetNode, or the systemd
machine testlib.machine.Machine: anything with `host_addr`, `node_addr` and `client_key`).

The node's llama.cpp is the operator's llama-server (`--llamacpp-bin`, default /mnt/llama-server
where NetNode mounts the one `./pants test` builds), not the pinned build: the control plane then
has no source to fetch from PyPI. The model served is a sim model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

from llmgw_release import build, wheels

import llmgw
from testlib.cluster import Proc, wait_until
from testlib.proc import build_root, run_llmgw

ADD_TIMEOUT_S = 300
CATALOG = """
[engines.llamacpp]
version = ""

[[models]]
name = "sim-small"
engine = "sim"
replicas = 1
"""


class Node(Protocol):
    host_addr: str
    node_addr: str
    client_key: Path


def build_release(out: Path, version: str) -> Path:
    """The release's files for this machine's architecture, built as `release:build` builds them."""
    root = build_root()
    inputs = build.Inputs(
        version=version,
        commit="0123456789ab",
        source_date_epoch=1795965623,
        src_root=Path(llmgw.__file__).parent.parent,
        requirements_txt=root / "3rdparty" / "python" / "requirements.txt",
        lockfile=root / "3rdparty" / "python" / "default.lock",
        wheel_cache=wheels.default_cache(),
    )
    build.build_release(inputs, out, arches=("amd64",), progress=lambda *a: None)
    return out


def events(stdout: str) -> list[dict]:
    """node add --json's step events."""
    return [json.loads(line) for line in stdout.splitlines() if line.startswith('{"step"')]


def outcomes(stdout: str) -> dict[str, str]:
    return {e["step"]: e["status"] for e in events(stdout) if e["status"] != "started"}


class ControlPlane:
    def __init__(self, root: Path, node: Node, *, llamacpp_bin: str = "/mnt/llama-server") -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.state = root / "state"
        self.config = root / "server.toml"
        self.known_hosts = root / "known_hosts"
        self.llamacpp_bin = llamacpp_bin
        self.config.write_text(
            "[server]\n"
            f'state_dir = "{self.state}"\n'
            f'agent_listen = "{node.host_addr}:7443"\n'
            'http_listen = "127.0.0.1:0"\n'
            f'advertise = ["{node.host_addr}"]\n'
            "heartbeat_interval_s = 0.5\n"
            "heartbeat_ttl_s = 3.0\n" + CATALOG
        )
        self.node = node
        self.server: Proc | None = None

    def llmgw(self, *args: str, timeout: float = 60):
        return run_llmgw(*args, timeout=timeout)

    def init_ca(self) -> None:
        done = self.llmgw("ca", "init", "--config", str(self.config))
        assert done.returncode == 0, done.stderr

    def run(self) -> None:
        """A CA, then the server: the usual start of a test."""
        self.init_ca()
        self.start()

    def start(self) -> None:
        self.server = Proc(
            "server", ["server", "--config", str(self.config), "--log-format", "json"], self.root / "server.log"
        )
        wait_until("the server to be ready", lambda: self.server.events("server_ready"), alive=[self.server])

    def stop(self) -> None:
        if self.server is not None:
            self.server.kill()

    def ctl(self, *args: str):
        done = self.llmgw("ctl", *args, "--json", "--state-dir", str(self.state))
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    def nodes(self) -> dict[str, dict]:
        return {n["id"]: n for n in self.ctl("nodes")}

    def added(self, release: Path) -> str:
        """A first add that must succeed; its output."""
        rc, out, err = self.node_add("--plain", "--accept-new-host-key", release=release)
        assert rc == 0, out + err
        return out

    def node_add(self, *extra: str, release: Path | str | None = None, login: str = "root") -> tuple[int, str, str]:
        args = [
            "node", "add", f"{login}@{self.node.node_addr}", "--config", str(self.config),
            "-i", str(self.node.client_key), "--known-hosts", str(self.known_hosts),
            "--llamacpp-bin", self.llamacpp_bin, "--join-timeout", "120",
        ]  # fmt: skip
        if release is not None:
            args += ["--release", str(release)]
        done = self.llmgw(*args, *extra, timeout=ADD_TIMEOUT_S)
        return done.returncode, done.stdout, done.stderr
