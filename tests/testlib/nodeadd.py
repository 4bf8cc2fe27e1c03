"""What the onboarding integration tests share (node add, gateway add, server add): a release
built from this checkout, a control plane driven through the `llmgw` command, and pytest fixtures
for both and the node.

A test module takes the fixtures `release_dir`, `node` and `cp` with `pytest_plugins =
("testlib.nodeadd",)`. `release_dir` is the one release fixture: a module or a test names the
release it needs with `pytest.mark.release(version=..., with_llama=...)` (default: version
0.0.0-e2e, no llama.cpp archive), and each release so named is built once a session. The node (testlib.netnode) has the real llama-server `./pants test` builds mounted at /mnt, named
to node add with --llamacpp-bin; the catalog's model is a sim model. A ControlPlane faces any
node with `host_addr`, `node_addr` and `client_key`: the systemd machine (testlib.machine) too.
`ControlPlane(..., llamacpp_bin=None)` with a catalog naming no `[engines.llamacpp]` and a
release built `with_llama` is the operator's default instead: no engine flag, and llama.cpp the
release's archive, which the control plane serves from `[release] dir`. Every ControlPlane's
server.toml says `measure_speed = false` under `[engines.llamacpp]` (added where the catalog has
no such table, every other key at its default): these tests never look at speeds.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import pytest
from llmgw_release import build, llamabuild, wheels

import llmgw
from llmgw.ctl.client import AdminClient
from testlib import releasecache
from testlib.cluster import free_port, measure_speed_off, wait_until
from testlib.llama import cache_root, llama_server, portable_recipe
from testlib.netnode import NetNode, preflight
from testlib.proc import Proc, build_root, llmgw_here, run_llmgw

ADD_TIMEOUT_S = 300
# llama.cpp as the operator's llama-server (node add --llamacpp-bin), not the pinned build: the
# control plane then has no source to fetch from PyPI. Its speed not measured: no test here looks.
CATALOG = """
[engines.llamacpp]
version = ""
measure_speed = false

[[models]]
name = "sim-small"
engine = "sim"
replicas = 1
"""


class Node(Protocol):
    hostname: str
    host_addr: str
    node_addr: str
    client_key: Path


def build_release(out: Path, version: str, arches: tuple[str, ...] = ("amd64",), *, with_llama: bool = False) -> Path:
    """The release's files for this machine's architecture, built as `release:build` builds them;
    `with_llama`: with llama.cpp's archive for this machine's architecture too, the portable build
    `./pants test` keeps in its cache (taken from there, so nothing is compiled here). Built once
    for the test files that ask for the same release (`testlib.releasecache`); `out` gets a copy."""
    inputs = _release_inputs(version, with_llama=with_llama)
    name = releasecache.key(_release_parts(inputs, arches), _release_files(inputs))
    return releasecache.built(
        name, lambda work: build.build_release(inputs, work, arches=arches, progress=lambda *a: None), out
    )


def _release_inputs(version: str, *, with_llama: bool) -> build.Inputs:
    root = build_root()
    return build.Inputs(
        version=version,
        commit="0123456789ab",
        source_date_epoch=1795965623,
        src_root=Path(llmgw.__file__).parent.parent,
        requirements_txt=root / "3rdparty" / "python" / "requirements.txt",
        lockfile=root / "3rdparty" / "python" / "default.lock",
        wheel_cache=wheels.default_cache(),
        llama_cache=cache_root() if with_llama else None,
        llama_arches=(llamabuild.this_host(),) if with_llama else None,
        llama_this_cpu=True,  # the build `./pants test` made
    )


def _release_parts(inputs: build.Inputs, arches: tuple[str, ...]) -> list[str | bytes]:
    """What goes into the release besides files: its settings, and llmgw's and the agent's sources
    as the build collects them (`build.sources`: the version written into llmgw/__init__.py)."""
    parts: list[str | bytes] = [repr((inputs.version, arches, inputs.commit, inputs.source_date_epoch))]
    for path, data in sorted(build.sources(inputs.src_root, inputs.version).items()):
        parts += [path, data]
    if inputs.llama_cache is not None:  # this machine's archive alone (_release_inputs)
        archive = llamabuild.archive_path(inputs.llama_cache, portable_recipe())
        stat = archive.stat() if archive.is_file() else None
        parts.append(f"{archive} {stat.st_size if stat else None} {stat.st_mtime_ns if stat else None}")
    return parts


def _release_files(inputs: build.Inputs) -> list[Path]:
    """The files the build reads besides the sources: the pins, and the release build's own code."""
    code = sorted(p for p in Path(build.__file__).parent.iterdir() if p.suffix == ".py")
    return [inputs.requirements_txt, inputs.lockfile, *code]


VERSION = "0.0.0-e2e"  # release_dir's, unless a test's `release` mark names another


# The `release` mark is registered by tests/integration/conftest.py, before the modules using it load.


@pytest.fixture(scope="session")
def _releases() -> dict[tuple[str, bool], Path]:
    return {}


@pytest.fixture()
def release_dir(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, _releases: dict[tuple[str, bool], Path]
) -> Path:
    """The release's files for this machine's architecture (`build_release`), as the test's or its
    module's `release` mark names them; built once a session for each version and llama.cpp."""
    mark = request.node.get_closest_marker("release")
    given = dict(mark.kwargs) if mark is not None else {}
    key = (given.pop("version", VERSION), given.pop("with_llama", False))
    if given:
        raise TypeError(f"pytest.mark.release takes version and with_llama, not {sorted(given)}")  # a bug in a test
    if key not in _releases:
        version, with_llama = key
        _releases[key] = build_release(tmp_path_factory.mktemp("release"), version, with_llama=with_llama)
    return _releases[key]


def new_node(root: Path, **kwargs) -> NetNode:
    """A NetNode with the test llama-server at /mnt (a test failure, never a skip, where it cannot be made)."""
    why = preflight()
    if why:
        pytest.fail(why)
    return NetNode(root, binds={"/mnt": Path(llama_server()).parent}, **kwargs)


@pytest.fixture()
def node(tmp_path: Path) -> Iterator[NetNode]:
    n = new_node(tmp_path / "node")
    n.start()
    try:
        yield n
    finally:
        n.stop()


def events(stdout: str) -> list[dict]:
    """node add --json's step events."""
    return [json.loads(line) for line in stdout.splitlines() if line.startswith('{"step"')]


def outcomes(stdout: str) -> dict[str, str]:
    return {e["step"]: e["status"] for e in events(stdout) if e["status"] != "started"}


class ControlPlane:
    def __init__(
        self, root: Path, node: Node, *, catalog: str = CATALOG, llamacpp_bin: str | None = "/mnt/llama-server"
    ) -> None:
        """`llamacpp_bin` is given to every node add as --llamacpp-bin; None gives no such flag."""
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.llamacpp_bin = llamacpp_bin
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
            "heartbeat_ttl_s = 3.0\n"
            "gateway_workers = 1\n" + measure_speed_off(catalog)  # as testlib.cluster's (GATEWAY_WORKERS says why)
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
        llmgw_here("ca", "init", "--config", str(self.config))

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

    # nodes(), node_view() and replicas() ask the admin API in this process, with the AdminClient
    # `llmgw ctl nodes --json` and `llmgw ctl replicas --json` use: the waits poll them, and a
    # `llmgw ctl` process a poll cost ~0.15 s of CPU. `ctl` runs the command itself.

    def _admin(self) -> AdminClient:
        return AdminClient.locate(server=None, credential=None, state_dir=str(self.state))

    def nodes(self) -> dict[str, dict]:
        """What `llmgw ctl nodes --json` says, by node id."""
        return {n["id"]: n for n in self._admin().nodes()}

    def replicas(self) -> list[dict]:
        """What `llmgw ctl replicas --json` says (placed, then pending)."""
        return self._admin().request("GET", "/admin/v1/replicas")["replicas"]

    def added(self, release: Path) -> str:
        """A first add that must succeed; its output."""
        rc, out, err = self.node_add("--plain", "--accept-new-host-key", release=release)
        assert rc == 0, out + err
        return out

    def node_add_argv(
        self, *extra: str, release: Path | str | None = None, login: str = "root", key_file: bool = True
    ) -> list[str]:
        """`llmgw node add`'s arguments as node_add gives them, logging in with the node's test key
        (`-i`), or with no key named (`key_file=False`: ~/.ssh and the SSH agent)."""
        args = [
            "node", "add", f"{login}@{self.node.node_addr}", "--config", str(self.config),
            "--known-hosts", str(self.known_hosts), "--join-timeout", "120",
        ]  # fmt: skip
        if self.llamacpp_bin is not None:
            args += ["--llamacpp-bin", self.llamacpp_bin]
        if key_file:
            args += ["-i", str(self.node.client_key)]
        if release is not None:
            args += ["--release", str(release)]
        return [*args, *extra]

    def node_add(self, *extra: str, release: Path | str | None = None, login: str = "root") -> tuple[int, str, str]:
        done = self.llmgw(*self.node_add_argv(*extra, release=release, login=login), timeout=ADD_TIMEOUT_S)
        return done.returncode, done.stdout, done.stderr

    def node_view(self) -> dict:
        """The admin API's view of the node (what `llmgw ctl nodes --json` says of it)."""
        return self.nodes()[self.node.hostname]


@pytest.fixture()
def cp(tmp_path: Path, node: NetNode) -> Iterator[ControlPlane]:
    c = ControlPlane(tmp_path, node)
    try:
        yield c
    finally:
        c.stop()


class ServedRelease:
    """A release directory served over plain HTTP (`python -m http.server`) on the host's side of a
    node's link: a release the node fetches itself."""

    def __init__(self, node: NetNode, directory: Path) -> None:
        port = free_port(node.host_addr)
        self.url = f"http://{node.host_addr}:{port}/"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "http.server", "--bind", node.host_addr, "--directory", str(directory), str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_until("the release's file server", lambda: _answers(self.url), timeout=15)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


def _answers(url: str) -> bool:
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with direct.open(url + "SHA256SUMS", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False
