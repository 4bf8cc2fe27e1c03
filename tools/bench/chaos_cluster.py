"""The chaos benchmark's cluster: real `llmgw server` and `llmgw agent run` processes, real sim
engines, and the handles the faults need (kill a process, cut a node's network, restart the
control plane on the same sockets).

The control plane's listening sockets belong to this process and are passed to each
`llmgw server` it starts, as a systemd .socket unit passes them (docs/operations.md), so a
restart keeps its backlog. As root, each node runs in a network namespace of its own
(`testlib.netns`): its agent dials the control plane over the namespace's link, the gateway
reaches its engines over it, and cutting the link partitions exactly that node. Without root,
nodes are loopback addresses (127.0.0.2, ...) and the partition fault is skipped.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmgw.ctl.client import AdminClient
from testlib import activation
from testlib.cluster import wait_until
from testlib.marked import MARKER_ENV, kill_groups, marked_engines, marked_pids
from testlib.netns import NetNS
from testlib.proc import Proc, llmgw_here, run_llmgw

CLI_TIMEOUT_S = 30.0


class ChaosCluster:
    def __init__(
        self,
        root: Path,
        *,
        nodes: tuple[str, ...],
        netns: bool,
        catalog: str,
        heartbeat_interval_s: float,
        heartbeat_ttl_s: float,
        agent_toml: str = "",
    ) -> None:
        self.root = root
        self.agent_toml = agent_toml  # more of every node's agent config (llamacpp_bin)
        self.state = root / "state"
        self.node_ids = nodes
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.namespaces: dict[str, NetNS] = {}
        self.agent_socket = activation.listening_socket("0.0.0.0" if netns else "127.0.0.1")
        self.http_socket = activation.listening_socket("127.0.0.1")
        self.agent_port = self.agent_socket.getsockname()[1]
        self.http_port = self.http_socket.getsockname()[1]
        self.server: Proc | None = None
        self.agents: dict[str, Proc] = {}
        self.procs: list[Proc] = []
        self._runs: dict[str, int] = {}
        if netns:
            for node in nodes:
                ns = NetNS()
                ns.start()
                self.namespaces[node] = ns
        advertise = ["127.0.0.1", *(ns.host_addr for ns in self.namespaces.values())]
        self.config = root / "server.toml"
        self._server_section = (
            "[server]\n"
            f'state_dir = "{self.state}"\n'
            f'agent_listen = "{"0.0.0.0" if netns else "127.0.0.1"}:{self.agent_port}"\n'
            f'http_listen = "127.0.0.1:{self.http_port}"\n'
            f"advertise = {json.dumps(advertise)}\n"
            f"heartbeat_interval_s = {heartbeat_interval_s}\n"
            f"heartbeat_ttl_s = {heartbeat_ttl_s}\n\n"
        )
        self.set_catalog(catalog)
        llmgw_here("ca", "init", "--config", str(self.config))  # set-up: the command's code in this process
        for i, node in enumerate(nodes):
            self._add_node(node, i)

    def set_catalog(self, catalog: str) -> None:
        """server.toml's sections after [server] (TOML text); a running server reads them on `reload`."""
        self.config.write_text(self._server_section + catalog)

    # -- set-up -----------------------------------------------------------------------------

    def _add_node(self, node: str, index: int) -> None:
        ns = self.namespaces.get(node)
        server_host = ns.host_addr if ns else "127.0.0.1"
        source = "" if ns else f'source_address = "127.0.0.{index + 2}"\n'
        state = self.root / node
        config = self.root / f"{node}.toml"
        config.write_text(
            f'server = "wss://{server_host}:{self.agent_port}"\nnode_id = "{node}"\nstate_dir = "{state}"\n{source}'
            + self.agent_toml
        )
        pki = state / "pki"
        llmgw_here("agent", "csr", "--config", str(config))
        llmgw_here(
            "ca",
            "issue",
            node,
            "--config",
            str(self.config),
            "--csr",
            str(pki / "node.csr"),
            "--out",
            str(pki / "node.crt"),
        )
        shutil.copy(self.state / "ca" / "ca.crt", pki / "ca.crt")

    def _cli(self, *args: str) -> str:
        out = run_llmgw(*args, timeout=CLI_TIMEOUT_S)
        if out.returncode != 0:
            raise RuntimeError(f"`llmgw {' '.join(args)}` exited {out.returncode}: {out.stderr.strip()}")
        return out.stdout

    def _spawn(self, name: str, args: list[str], **kw: Any) -> Proc:
        run = self._runs[name] = self._runs.get(name, 0) + 1
        proc = Proc(name, args, self.root / f"{name}-{run}.log", **kw)
        self.procs.append(proc)
        return proc

    # -- processes --------------------------------------------------------------------------

    def start_server(self) -> Proc:
        server = self.server = self._spawn(
            "server",
            ["server", "--config", str(self.config), "--log-format", "json"],
            sockets=[self.agent_socket, self.http_socket],
        )
        wait_until("the control plane to be ready", lambda: server.events("server_ready"), alive=[server])
        return server

    def stop_server(self) -> int | None:
        assert self.server is not None
        return self.server.stop(signal.SIGTERM, timeout=60)

    def start_agent(self, node: str) -> Proc:
        ns = self.namespaces.get(node)
        agent = self._spawn(
            node,
            ["agent", "run", "--config", str(self.root / f"{node}.toml"), "--log-format", "json"],
            env={MARKER_ENV: self.marker(node)},
            prefix=["ip", "netns", "exec", ns.name] if ns else None,
        )
        self.agents[node] = agent
        return agent

    def marker(self, node: str) -> str:
        return f"{self.root}/{node}"

    def engine_pids(self, node: str | None = None) -> set[int]:
        """Live engine processes (of every node, or one): marked processes serving a port."""
        agents = {p.popen.pid for p in self.procs if p.name in self.node_ids}
        nodes = self.node_ids if node is None else (node,)
        return {pid for n in nodes for pid in marked_engines(self.marker(n)) if pid not in agents}

    def kill_agent(self, node: str) -> None:
        self.agents[node].popen.send_signal(signal.SIGKILL)
        self.agents[node].popen.wait(10)

    def kill_node(self, node: str) -> float:
        """SIGKILL `node`'s agent and engines; when its engines died (unix time)."""
        engines = self.engine_pids(node)
        self.kill_agent(node)
        kill_groups(engines)
        return time.time()

    def cut(self, node: str) -> None:
        self.namespaces[node].cut()

    def restore(self, node: str) -> None:
        self.namespaces[node].restore()

    # -- what the control plane says --------------------------------------------------------

    def ctl(self, *args: str) -> Any:
        return json.loads(self._cli("ctl", *args, "--json", "--state-dir", str(self.state)))

    def reload(self) -> Any:
        """`llmgw ctl reload`: the control plane reads server.toml again (`set_catalog`)."""
        return self.ctl("reload")

    def token(self, name: str) -> str:
        return self.ctl("keys", "create", name)["token"]

    # The observations poll these: they ask the admin API in this process, with the AdminClient
    # `llmgw ctl nodes/replicas --json` use, not a `llmgw ctl` process a poll (~0.15 s of CPU
    # each, taken from the machine the cluster runs on).

    def _admin(self) -> AdminClient:
        return AdminClient.locate(server=None, credential=None, state_dir=str(self.state))

    def nodes(self) -> list[dict[str, Any]]:
        """What `llmgw ctl nodes --json` says."""
        return self._admin().nodes()

    def replicas(self) -> list[dict[str, Any]]:
        """What `llmgw ctl replicas --json` says."""
        return self._admin().request("GET", "/admin/v1/replicas")["replicas"]

    def rollout(self, model: str) -> dict[str, Any] | None:
        """`model`'s rollout as `llmgw ctl models --json` says it: None when none is under way or stopped."""
        models = self._admin().request("GET", "/admin/v1/models")["models"]
        return next((m["rollout"] for m in models if m["model"] == model), None)

    def ready_in_gateway(self, model: str) -> int:
        return ready_in_gateway(self.http_port, model)

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()
        for node in self.node_ids:
            kill_groups(marked_pids(self.marker(node)))
        for ns in self.namespaces.values():
            ns.stop()
        self.agent_socket.close()
        self.http_socket.close()


def poll(what: str, check, timeout: float, interval: float = 0.2):
    """`check()` until truthy (its value) or `timeout` (then None); never raises for time."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(interval)
    return None


def ready_in_gateway(port: int, model: str) -> int:
    """Replicas of `model` the gateway on `port` routes to now (its /metrics), -1 while none answers."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
            s.sendall(b"GET /metrics HTTP/1.1\r\nhost: chaos\r\nconnection: close\r\n\r\n")
            s.settimeout(2)
            data = b""
            while chunk := s.recv(65536):
                data += chunk
    except OSError:
        return -1
    # One count per gateway worker (its series carry `worker`, docs/gateway.md): the replicas
    # the gateway routes to are those every worker routes to.
    model_label = f'model="{model}"'.encode()
    ready: dict[bytes, int] = {}
    for line in data.splitlines():
        if line.startswith(b"llmgw_gateway_replica_state{") and model_label in line:
            worker = re.search(rb'worker="([^"]*)"', line)
            key = worker.group(1) if worker else b""
            ready[key] = ready.get(key, 0) + (b'state="ready"' in line and line.endswith(b" 1"))
    return min(ready.values(), default=0)


def report(settings: dict[str, Any], bench: Any, targets: dict[str, bool]) -> dict[str, Any]:
    """A chaos run's JSON result: its settings and the machine's, each fault's figures, the
    processes that exited unasked, and each target (`targets`, and that none exited)."""
    return {
        "settings": {
            **settings,
            "machine": f"{os.cpu_count()} cores, {platform.machine()}, CPython {platform.python_version()}",
        },
        "faults": bench.results,
        "unexpected_process_exits": bench.unexpected_exits,
        "targets_met": {**targets, "no_process_exits": not bench.unexpected_exits},
    }


def run_and_print(run: Callable[..., Any], args: Any, prefix: str) -> int:
    """`trio.run(run, args, root)` in a new directory (removed after unless `args.keep`), its
    result printed as JSON; 0 if every target was met, else 1."""
    import trio

    root = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        result = trio.run(run, args, root)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"chaos: logs kept in {root}", file=sys.stderr)
    print(json.dumps(result, indent=2))
    return 0 if all(result["targets_met"].values()) else 1
