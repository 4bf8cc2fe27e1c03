"""Standalone gateways (`llmgw gateway --server`) in front of a `testlib.cluster.Cluster`: each a
process of its own with a certificate of its own (`llmgw ca issue --gateway NAME`), its workers
sharing one port; what a test asks them (/health, /metrics, a chat completion); and the
control plane's admin API, called as `llmgw ctl` would.

A worker is reached on a fresh connection, which the kernel hands to one of the workers at
random (SO_REUSEPORT): `every_worker` asks often enough that all of them answered.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from llmgw import paths
from testlib.cluster import Cluster, free_port, wait_until
from testlib.gateway import chat, parse_metrics, request
from testlib.proc import Proc, llmgw_here

READY_S = 60.0  # the gateway's workers up and each holding the cluster's table, on a loaded machine
SAMPLES = 20  # fresh connections in a row all reaching one of two workers: once in half a million


@attrs.define
class Standalone:
    name: str
    proc: Proc
    port: int
    host: str = "127.0.0.1"

    def health(self) -> dict[str, Any]:
        """/health's body, with its status as `http_status`."""
        status, _, body = request(self.port, "GET", "/health", host=self.host)
        answer = json.loads(body)
        answer["http_status"] = status
        return answer

    def metrics(self) -> dict[tuple[str, frozenset], float]:
        return parse_metrics(request(self.port, "GET", "/metrics", host=self.host)[2].decode())

    def ask(self, token: str, content: str = "hello", **extra: Any) -> tuple[int, dict[str, str], bytes]:
        """One chat completion on a fresh connection: (status, headers, body)."""
        return request(
            self.port, "POST", "/v1/chat/completions", chat(content, **extra), token=token, host=self.host, timeout=60
        )

    def serves(self) -> bool:
        """Whether /health says 200 now (False while it does not listen yet)."""
        try:
            return self.health()["http_status"] == 200
        except OSError:
            return False

    def every_worker(self, check: Callable[[dict[str, Any]], bool], samples: int = SAMPLES) -> bool:
        """Whether `check(health)` holds on `samples` fresh connections in a row."""
        return all(check(self.health()) for _ in range(samples))

    def accepts(self, token: str, status: int, samples: int = SAMPLES) -> bool:
        """Whether `samples` requests in a row with `token` were answered `status`."""
        return all(self.ask(token)[0] == status for _ in range(samples))

    def wait_serving(self, share_count: int | None = None, timeout: float = READY_S) -> None:
        """Until every worker holds the cluster's table with a replica ready and its link up
        (and, if given, a share of `share_count` instances)."""

        def serving(h: dict[str, Any]) -> bool:
            shared = share_count is None or h["share"]["count"] == share_count
            return h["http_status"] == 200 and h["link_up"] and bool(h["ready"]) and shared

        wait_until(
            f"gateway {self.name} ready",
            lambda: self.proc.events("gateway_ready"),
            alive=[self.proc],
            timeout=timeout,
        )
        wait_until(
            f"every worker of {self.name} serving the cluster's table",
            lambda: self.every_worker(serving),
            alive=[self.proc],
            timeout=timeout,
            last_seen=self.health,
        )


def issue_certificate(cluster: Cluster, name: str) -> Path:
    """A gateway certificate named `name` from the cluster's CA, in a pki directory of its own."""
    pki = cluster.root / f"{name}-pki"
    llmgw_here("ca", "issue", "--gateway", name, "--config", str(cluster.server_config), "--out", str(pki))
    return pki


def start(
    cluster: Cluster,
    name: str,
    pki: Path,
    *,
    workers: int = 1,
    server: str | list[str] | None = None,
    host: str = "127.0.0.1",
) -> Standalone:
    """`llmgw gateway --server` (the cluster's agent port, or `server`: one, or every control
    plane's) on a port of its own, owned by the cluster (which kills it in `close`); does not
    wait for it."""
    port = free_port(host)
    servers = [server] if isinstance(server, str) else server or [cluster.agent_url]
    args = [
        "--log-format",
        "json",
        "gateway",
        *(a for url in servers for a in ("--server", url)),
        "--pki-dir",
        str(pki),
    ]
    args += ["--listen", f"{host}:{port}", "--workers", str(workers)]
    proc = Proc(name, args, cluster.root / f"{name}.log")
    cluster.procs.append(proc)
    return Standalone(name=name, proc=proc, port=port, host=host)


def admin(cluster: Cluster, method: str, path: str) -> dict[str, Any]:
    """One admin API call, with the credential the control plane's state directory holds."""
    url = paths.admin_url_path(cluster.state).read_text().strip()
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    token = paths.read_admin_token(paths.admin_token_path(cluster.state))
    conn = http.client.HTTPConnection(host, int(port.strip("/")), timeout=10)
    try:
        conn.request(method, path, headers={"authorization": f"Bearer {token}"})
        response = conn.getresponse()
        body = response.read()
        assert response.status < 300, (response.status, body)
        return json.loads(body)
    finally:
        conn.close()
