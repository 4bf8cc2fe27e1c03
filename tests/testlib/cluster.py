"""A cluster of real `llmgw` processes on loopback: one control plane, its agents, their files.

`Cluster` owns every process it starts and kills each one in `close()`, whatever state a test
left it in. Nothing waits by sleeping: every wait is a poll with a deadline that, when it
expires, fails with what was last seen and the log tails of the processes involved, so a red
run says what each side saw. Processes log JSON lines (`--log-format json`) to one file per
run (`testlib.proc.Proc`), so a test reads the events of exactly the run it started.

Engines are the agents' children in their own process groups, so they outlive an agent that
is killed. Each agent runs with `MARKER_ENV` (`testlib.marked`) naming its node, which its
engines inherit: that is how `engine_pids` finds them in /proc, how `kill_node` takes a node
down as a dead machine would (agent and engines), and how `close` leaves no engine behind.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import shutil
import socket
import sqlite3
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import attrs
import tomllib

from llmgw.ctl.client import AdminClient
from llmgw.errors import LlmgwError
from llmgw.server.gateways.workers import LINK_TIMEOUT_S
from testlib import activation
from testlib.marked import MARKER_ENV, kill_groups, marked_engines, marked_pids
from testlib.ports import free_port
from testlib.proc import Proc, llmgw_here, run_llmgw, tails

T = TypeVar("T")

POLL_S = 0.1
# The control plane's gateway in one worker process unless a test names a count: the product's
# "auto" is one per core, and each worker costs about 0.7 CPU-s at every start of the server (its
# imports, its link and TLS; the server itself about 1.1). The tests of several workers name
# theirs (test_control_plane_workers; the standalone gateways' run `llmgw gateway --workers 2`).
GATEWAY_WORKERS = "gateway_workers = 1\n"
DEADLINE_S = 20.0
CLI_TIMEOUT_S = 30.0


def connection_metrics(port: int) -> dict[str, float]:
    """The `llmgw_connections_*` series of the control plane's /metrics on `port`, by name and
    labels: the gateway workers' (labelled `worker`, as their last heartbeats said them) added up
    per listener and reason, as one process's figures were before the gateway had workers."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("llmgw_connections_"):
            name, value = line.rsplit(" ", 1)
            name = re.sub(r'worker="[^"]*",?', "", name)
            out[name] = out.get(name, 0.0) + float(value)
    return out


def wait_until(
    what: str,
    check: Callable[[], T | None],
    *,
    procs: Iterable[Proc] = (),
    alive: Iterable[Proc] = (),
    timeout: float = DEADLINE_S,
    last_seen: Callable[[], Any] = lambda: None,
) -> T:
    """Poll `check` until it returns something truthy; fail after `timeout` or as soon as a
    process in `alive` exits, with `last_seen()` and the log tails of `procs` and `alive`.
    Blocking, for a test beside real processes; an async test waits with
    `testlib.waiting.await_true(predicate, what)`."""
    procs, alive = list(procs), list(alive)
    shown = procs + [p for p in alive if p not in procs]
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        dead = [p for p in alive if p.returncode is not None]
        if dead or time.monotonic() >= deadline:
            why = f"{', '.join(p.name for p in dead)} exited" if dead else f"not within {timeout:g} s"
            raise AssertionError(f"waiting for {what}: {why}\nlast seen: {last_seen()!r}\n{tails(shown)}")
        time.sleep(POLL_S)


@attrs.frozen(kw_only=True)
class NodeFiles:
    node_id: str
    state_dir: Path
    config: Path

    @property
    def pki(self) -> Path:
        return self.state_dir / "pki"


# The operator's llama-server (agent.toml's llamacpp_bin), as before llama.cpp came with each node
# by default: most clusters serve sim models, and a build per agent would cost minutes of CPU
# (tests/integration/test_llamacpp_build.py builds it; test_llamacpp_release.py takes the release's).
# Not measured by itself (agent.bench): no test of these clusters looks at speeds, and each
# agent with a llama-server would spend seconds of CPU measuring it (test_speed_bench measures).
OPERATORS_LLAMACPP = '[engines.llamacpp]\nversion = ""\nmeasure_speed = false\n'
LLAMACPP_TABLE = "[engines.llamacpp]\n"


def measure_speed_off(toml: str) -> str:
    """server.toml text `toml` with `measure_speed = false` under [engines.llamacpp]: in its table
    where it has one (TOML refuses a second), else in one added at the end, which leaves every
    other key of llama.cpp at its default. For the tests' clusters that never look at speeds."""
    if "measure_speed" in toml:
        out = toml
    elif LLAMACPP_TABLE in toml:
        out = toml.replace(LLAMACPP_TABLE, LLAMACPP_TABLE + "measure_speed = false\n", 1)
    else:
        out = (
            toml
            + ("\n" if toml and not toml.endswith("\n") else "")
            + "\n"
            + LLAMACPP_TABLE
            + "measure_speed = false\n"
        )
    assert tomllib.loads(out)["engines"]["llamacpp"].get("measure_speed") is False, out
    return out


@attrs.frozen(kw_only=True)
class ServerNet:
    """Where `llmgw server` runs and how the others reach it: on this machine's loopback by
    default, or inside a network namespace (`prefix`: `ip netns exec NAME`) with its agent port on
    `agent_host` ("0.0.0.0": every address of the namespace), its HTTP port on `dial_host`, which
    its agents dial, and its certificate naming `advertise`."""

    prefix: tuple[str, ...] = ()
    agent_host: str = "127.0.0.1"
    dial_host: str = "127.0.0.1"
    advertise: tuple[str, ...] = ("127.0.0.1",)


class Cluster:
    """A control plane in `root/state` with its agent port at a fixed number (so a restarted
    server listens where its agents dial), and the agents' state under `root`."""

    def __init__(
        self,
        root: Path,
        *,
        heartbeat_interval_s: float = 0.2,
        heartbeat_ttl_s: float = 1.5,
        socket_activation: bool = False,
        engines_toml: str = OPERATORS_LLAMACPP,
        net: ServerNet | None = None,
        reconnect_grace_s: float = 10.0,
        server_toml: str = "",
        fixed_http_port: bool = False,
    ) -> None:
        """`socket_activation`: the cluster owns the server's listening sockets and passes them
        to each `llmgw server` it starts, as a systemd .socket unit does; connections made
        while the server restarts wait in their backlog. `engines_toml`: server.toml's tables
        after [server] ([engines.*], [release]; TOML text). `net`: where the server runs.
        `reconnect_grace_s`: how long a restarted server waits for the agents it knew; their
        backoff reaches 30 s after a long outage (the product's default, 35 s, covers it).
        `server_toml`: more keys of [server] (`gateway_workers = 2`; TOML text; without
        `gateway_workers`, one worker: see GATEWAY_WORKERS). `fixed_http_port`:
        http_listen on a port chosen here, not by the system at each start (the same after a
        restart, or a standby becoming the leader)."""
        net = net or ServerNet()
        assert not (socket_activation and net.prefix), "socket activation passes this machine's sockets"
        self.root = root
        self.net = net
        self.state = root / "state"
        self.sockets: list[socket.socket] = []
        if socket_activation:
            self.sockets = [activation.listening_socket(), activation.listening_socket()]
            self.port = self.sockets[0].getsockname()[1]
            self.http_port = self.sockets[1].getsockname()[1]
        else:
            self.port = free_port()
            self.http_port = free_port() if fixed_http_port else 0
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.server_config = root / "server.toml"
        self._server_section = (
            "[server]\n"
            f'state_dir = "{self.state}"\n'
            f'agent_listen = "{net.agent_host}:{self.port}"\n'
            f'http_listen = "{net.dial_host}:{self.http_port}"\n'
            f"advertise = {json.dumps(list(net.advertise))}\n"
            f"heartbeat_interval_s = {heartbeat_interval_s}\n"
            f"heartbeat_ttl_s = {heartbeat_ttl_s}\n"
            # Agents come back on their own backoff after a server restart; give them that long.
            f"reconnect_grace_s = {reconnect_grace_s}\n"
            + ("" if "gateway_workers" in server_toml else GATEWAY_WORKERS)
            + server_toml
            + engines_toml
        )
        self.server_config.write_text(self._server_section)
        self.nodes_files: dict[str, NodeFiles] = {}
        self.server: Proc | None = None
        self.agents: dict[str, Proc] = {}
        self.procs: list[Proc] = []
        self.last_nodes: Any = None  # the last `ctl nodes` answer, for failure messages
        self.last_replicas: Any = None  # the last `ctl replicas` answer, likewise
        self._runs: dict[str, int] = {}

    @property
    def agent_url(self) -> str:
        """The control plane's agent port, as its agents dial it."""
        return f"wss://{self.net.dial_host}:{self.port}"

    # -- one-shot commands ----------------------------------------------------------------

    def llmgw(self, *args: str, ok: bool = True) -> subprocess.CompletedProcess:
        result = run_llmgw(*args, timeout=CLI_TIMEOUT_S)
        if ok and result.returncode != 0:
            raise AssertionError(
                f"`llmgw {' '.join(args)}` exited {result.returncode}\n"
                f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}\n{tails(self.latest())}"
            )
        return result

    def ctl(self, *args: str) -> Any:
        """`llmgw ctl ARGS --json` against this control plane, parsed; fails on a non-zero exit."""
        return json.loads(self.llmgw("ctl", *args, "--json", "--state-dir", str(self.state)).stdout)

    def init_ca(self) -> None:
        llmgw_here("ca", "init", "--config", str(self.server_config))

    def set_catalog(self, models_toml: str) -> None:
        """server.toml's `[[models]]` (TOML text); a running server reads it on `ctl reload`."""
        self.server_config.write_text(self._server_section + models_toml)

    def add_node(self, node_id: str, agent_toml: str = "", servers: list[str] | None = None) -> NodeFiles:
        """The node's own key and CSR, a certificate the CA signs for it, and the CA certificate.
        `agent_toml` is added to its agent.toml (top-level keys, then tables). `servers`: every
        control plane's agent port, when several share a store (default: this one's)."""
        files = NodeFiles(node_id=node_id, state_dir=self.root / node_id, config=self.root / f"{node_id}.toml")
        server = json.dumps(servers) if servers else f'"{self.agent_url}"'
        files.config.write_text(
            f'server = {server}\nnode_id = "{node_id}"\nstate_dir = "{files.state_dir}"\n' + agent_toml
        )
        llmgw_here("agent", "csr", "--config", str(files.config))
        llmgw_here(
            "ca",
            "issue",
            node_id,
            "--config",
            str(self.server_config),
            "--csr",
            str(files.pki / "node.csr"),
            "--out",
            str(files.pki / "node.crt"),
        )
        shutil.copy(self.state / "ca" / "ca.crt", files.pki / "ca.crt")
        self.nodes_files[node_id] = files
        return files

    def engine_key(self, replica_id: str) -> str:
        """The replica's engine key as the control plane holds it: its row of llmgw.db, where it
        is sealed, opened with the state directory's engine-keys.secret."""
        from llmgw.server.store import keyseal, store_path

        with contextlib.closing(sqlite3.connect(f"file:{store_path(self.state)}?mode=ro", uri=True)) as db:
            [(body,)] = db.execute("SELECT body FROM placements WHERE replica_id = ?", (replica_id,)).fetchall()
        key = keyseal.load(self.state, sealed_keys=1).open(replica_id, json.loads(body)["sealed_key"])
        assert key is not None, f"the sealed key of {replica_id} does not open with {self.state}'s secret"
        return key

    # The waits poll these every POLL_S. They ask the admin API as `llmgw ctl replicas --json` and
    # `llmgw ctl nodes --json` do (the same AdminClient, found from the state directory, a standby
    # followed to its leader), in this process: a `llmgw ctl` process per poll cost ~0.15 s of CPU,
    # a quarter of some tests' CPU. The commands themselves are run by `ctl` and the tests of ctl.

    def _admin(self, ask: Callable[[AdminClient], T]) -> tuple[T | None, str | None]:
        """What `ask` got of the admin API, or None and why (what `llmgw ctl` would have said)."""
        try:
            return ask(AdminClient.locate(server=None, credential=None, state_dir=str(self.state))), None
        except LlmgwError as exc:
            return None, f"exit {exc.exit_status}: {exc}"

    def replicas(self) -> list[dict[str, Any]] | None:
        """What `llmgw ctl replicas --json` says (placed, then pending), or None while no control plane answers."""
        answer, why = self._admin(lambda client: client.request("GET", "/admin/v1/replicas")["replicas"])
        if answer is None:
            self.last_replicas = why
            return None
        self.last_replicas = answer
        return answer

    def nodes(self) -> dict[str, dict[str, Any]] | None:
        """What `llmgw ctl nodes --json` says, by node id, or None while no control plane answers."""
        answer, why = self._admin(lambda client: client.nodes())
        if answer is None:
            self.last_nodes = why
            return None
        nodes = {n["id"]: n for n in answer}
        self.last_nodes = {k: n["state"] for k, n in nodes.items()}
        return nodes

    # -- long-running processes -----------------------------------------------------------

    def _spawn(
        self,
        name: str,
        args: list[str],
        env: dict[str, str] | None = None,
        sockets: list[socket.socket] | None = None,
        prefix: list[str] | None = None,
    ) -> Proc:
        run = self._runs[name] = self._runs.get(name, 0) + 1
        proc = Proc(name, args, self.root / f"{name}-{run}.log", env, sockets=sockets, prefix=prefix)
        self.procs.append(proc)
        return proc

    def start_server(self) -> Proc:
        """Start `llmgw server` and wait for this run's `server_ready` (both listeners accept)."""
        assert self.server is None or self.server.returncode is not None, "the server is already running"
        server = self.server = self._spawn(
            "server",
            ["server", "--config", str(self.server_config), "--log-format", "json"],
            sockets=self.sockets,
            prefix=list(self.net.prefix),
        )
        # The server bounds its own start (its gateway workers must link within LINK_TIMEOUT_S, or
        # it exits saying why, which `alive` notices): on a host busy with other tests a worker
        # process's start has taken more than the usual deadline, so the server's is waited.
        wait_until(
            "the server to be ready",
            lambda: server.events("server_ready"),
            alive=[server],
            timeout=max(DEADLINE_S, LINK_TIMEOUT_S + 10.0),
        )
        return server

    def start_agent(self, node_id: str, env: dict[str, str] | None = None, prefix: list[str] | None = None) -> Proc:
        """Start `llmgw agent run` for a node added with `add_node`; does not wait for its link.
        `env`: variables to set in its environment (PATH, say). `prefix`: a command that runs it
        (`ip netns exec NAME`: the node in a network namespace of its own)."""
        files = self.nodes_files[node_id]
        agent = self._spawn(
            node_id,
            ["agent", "run", "--config", str(files.config), "--log-format", "json"],
            {**(env or {}), MARKER_ENV: self._marker(node_id)},
            prefix=prefix,
        )
        self.agents[node_id] = agent
        return agent

    def start_supervised_agent(self, node_id: str, pid_file: Path, log: Path) -> Proc:
        """Start `llmgw agent supervise` for a node (its agent's and its own events, JSON, go to
        `log`). Its agent child is marked like any agent, so `close` leaves nothing behind; it is
        not told from an engine by `engine_pids`."""
        files = self.nodes_files[node_id]
        return self._spawn(
            f"{node_id}-supervise",
            ["--log-format", "json", "agent", "supervise", "--config", str(files.config)]
            + ["--pid-file", str(pid_file), "--log", str(log)],
            {MARKER_ENV: self._marker(node_id)},
        )

    def wait_nodes(
        self, what: str, check: Callable[[dict[str, dict[str, Any]]], bool], *, timeout: float = DEADLINE_S
    ) -> dict[str, dict[str, Any]]:
        """Poll `ctl nodes` until `check(nodes)` (for at most `timeout`); the nodes it passed on."""

        def poll() -> dict[str, dict[str, Any]] | None:
            nodes = self.nodes()
            return nodes if nodes is not None and check(nodes) else None

        return wait_until(
            what, poll, procs=self.latest(), alive=[self.server], timeout=timeout, last_seen=lambda: self.last_nodes
        )

    def wait_replicas(
        self, what: str, check: Callable[[list[dict[str, Any]]], bool], *, timeout: float = DEADLINE_S
    ) -> list[dict[str, Any]]:
        """Poll `ctl replicas` until `check(replicas)`; the replicas it passed on. A failure shows
        what `ctl replicas` and `ctl nodes` last said."""

        def poll() -> list[dict[str, Any]] | None:
            replicas = self.replicas()
            if replicas is None or not check(replicas):
                self.nodes()  # for the failure message
                return None
            return replicas

        return wait_until(
            what,
            poll,
            procs=self.latest(),
            alive=[self.server],
            timeout=timeout,
            last_seen=lambda: {"replicas": self.last_replicas, "nodes": self.last_nodes},
        )

    def _marker(self, node_id: str) -> str:
        return f"{self.root}/{node_id}"

    def engine_pids(self, node_id: str) -> list[int]:
        """The live engine processes a node's agents started (this run's or an earlier one's)."""
        agents = {p.popen.pid for p in self.procs if p.name == node_id}
        return [pid for pid in marked_engines(self._marker(node_id)) if pid not in agents]

    def kill_node(self, node_id: str) -> list[int]:
        """The machine dies: SIGKILL its agent, then its engines' process groups; the engine pids."""
        engines = self.engine_pids(node_id)
        self.agents[node_id].kill()
        kill_groups(engines)
        return engines

    def latest(self) -> list[Proc]:
        """The latest run of the server and of each agent: whose logs a failure shows."""
        return [p for p in (self.server, *self.agents.values()) if p is not None]

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()
        for node_id in self.nodes_files:  # engines outlive their agent: they lead their own groups
            kill_groups(marked_pids(self._marker(node_id)))
        for sock in self.sockets:
            sock.close()
