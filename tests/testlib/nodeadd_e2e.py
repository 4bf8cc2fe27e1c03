"""`llmgw node add` end to end, the parts its tests share: a release built from this checkout the
way `release:build` builds it, a test node (testlib.netnode) and a control plane (`llmgw server`
as a child process) whose agent port the node reaches over its link, and node add run against it.
Fixtures `release_dir` (module-scoped), `node` and `cp`: import them into a test module.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from llmgw_release import build, wheels

import llmgw
from testlib.cluster import Proc, wait_until
from testlib.llama import llama_server
from testlib.netnode import NetNode, preflight
from testlib.proc import build_root, run_llmgw

ADD_TIMEOUT_S = 300
# llama.cpp as the operator's llama-server (node add --llamacpp-bin), not the pinned build: the
# control plane then has no source to fetch from PyPI.
CATALOG = """
[engines.llamacpp]
version = ""

[[models]]
name = "sim-small"
engine = "sim"
replicas = 1
"""


def build_release(out: Path, version: str, arches: tuple[str, ...] = ("amd64",)) -> Path:
    """A release of this checkout, built the way `release:build` builds it, in `out`."""
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
    build.build_release(inputs, out, arches=arches, progress=lambda *a: None)
    return out


@pytest.fixture(scope="module")
def release_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_release(tmp_path_factory.mktemp("release"), "0.0.0-e2e")


@pytest.fixture()
def node(tmp_path: Path) -> Iterator[NetNode]:
    why = preflight()
    if why:
        pytest.fail(why)
    n = NetNode(tmp_path / "node", binds={"/mnt": Path(llama_server()).parent})
    n.start()
    try:
        yield n
    finally:
        n.stop()


class ControlPlane:
    def __init__(self, root: Path, node: NetNode) -> None:
        self.root = root
        self.state = root / "state"
        self.config = root / "server.toml"
        self.known_hosts = root / "known_hosts"
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

    def add_config(self, text: str) -> None:
        """Append to server.toml (a table of its own, e.g. `[release]`), before `start`."""
        with self.config.open("a") as f:
            f.write("\n" + text)

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

    def added(self, release: Path) -> str:
        """A first add that must succeed; its output."""
        rc, out, err = self.node_add("--plain", "--accept-new-host-key", release=release)
        assert rc == 0, out + err
        return out

    def node_add(self, *extra: str, release: Path | str | None = None, login: str = "root") -> tuple[int, str, str]:
        args = [
            "node", "add", f"{login}@{self.node.node_addr}", "--config", str(self.config),
            "-i", str(self.node.client_key), "--known-hosts", str(self.known_hosts),
            "--llamacpp-bin", "/mnt/llama-server", "--join-timeout", "120",
        ]  # fmt: skip
        if release is not None:
            args += ["--release", str(release)]
        done = self.llmgw(*args, *extra, timeout=ADD_TIMEOUT_S)
        return done.returncode, done.stdout, done.stderr


@pytest.fixture()
def cp(tmp_path: Path, node: NetNode) -> Iterator[ControlPlane]:
    c = ControlPlane(tmp_path, node)
    try:
        yield c
    finally:
        c.stop()


def events(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith('{"step"')]


def outcomes(stdout: str) -> dict[str, str]:
    return {e["step"]: e["status"] for e in events(stdout) if e["status"] != "started"}
