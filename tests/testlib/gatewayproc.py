"""Standalone gateway processes on loopback, for the tests that put several behind a load balancer.

`start_gateway` is the one place such a test starts a gateway: `llmgw gateway --table-file`, the
product's standalone gateway with a fixed table (the test's sim engines as its replicas, the one
API key every gateway of the test takes) instead of a control plane. A gateway started again on
the port of one that died takes that port back at once (the listener binds past TIME_WAIT).
"""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import attrs

from llmgw.gateway.keys import token_hash
from llmgw.gateway.routing import Endpoint
from llmgw.wire.gateway_link import GatewayKey, RouteEndpoint
from testlib.gateway import parse_metrics, summed
from testlib.gatewaytable import write_table
from testlib.proc import llmgw_env
from testlib.procfs import children

READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
POLL_S = 0.05


@attrs.define
class GatewayProcess:
    name: str
    port: int
    token: str
    popen: subprocess.Popen
    log_path: Path

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self) -> None:
        """SIGKILL to its whole process group and to each of its workers (which lead sessions of
        their own), as a crashed machine would: no request is finished, and no worker process of
        it lives on to drain."""
        workers = children(self.popen.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        self.popen.wait(STOP_TIMEOUT_S)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it has not exited within STOP_TIMEOUT_S."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.kill()

    def metrics(self) -> dict[tuple[str, frozenset], float]:
        """Its /metrics, asked directly (not through the balancer)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.request("GET", "/metrics")
            response = conn.getresponse()
            text = response.read().decode()
        finally:
            conn.close()
        assert response.status == 200, text[:200]
        return parse_metrics(text)

    def answered(self, model: str = "chat") -> int:
        """Requests for `model` this gateway answered 200 (its workers' series added up)."""
        return int(summed(self.metrics(), "llmgw_gateway_requests_total", model=model, status="200"))

    def in_flight(self, model: str = "chat") -> int:
        """Requests for `model` it is answering now (its workers' series added up)."""
        return int(summed(self.metrics(), "llmgw_gateway_in_flight", model=model))

    def tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        status = "running" if self.alive else f"exited {self.popen.returncode}"
        return f"--- gateway {self.name} ({status}) {self.log_path} ---\n" + "\n".join(text)


def start_gateway(
    tmp: Path,
    name: str,
    *,
    port: int,
    endpoints: Sequence[Endpoint],
    token: str,
    timeout: float = READY_TIMEOUT_S,
    flags: Sequence[str] = (),
) -> GatewayProcess:
    """`llmgw gateway --table-file` serving `endpoints` on 127.0.0.1:`port` with the API key
    `token`, one worker; returns once its /health answers 200. Each call is a fresh process (a
    restart is another call). `flags`: more of `llmgw gateway`'s (`--telemetry FILE`)."""
    state = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=tmp))
    table = state / "table.json"
    write_table(
        table,
        tuple(
            RouteEndpoint(replica_id=ep.replica_id, model=ep.model, host=ep.host, port=ep.port, api_key=ep.api_key)
            for ep in endpoints
        ),
        models=tuple(sorted({ep.model for ep in endpoints})),
        keys=(GatewayKey(name="tests", token_sha256=token_hash(token)),),
    )
    log_path = state / "gateway.log"
    with log_path.open("wb") as stderr:
        popen = subprocess.Popen(
            [sys.executable, "-m", "llmgw", "gateway", "--table-file", str(table), "--name", name]
            + ["--listen", f"127.0.0.1:{port}", "--workers", "1", *flags],
            stdin=subprocess.DEVNULL,
            stdout=stderr,
            stderr=stderr,
            env=llmgw_env(),
            start_new_session=True,  # its own process group: `kill` takes its workers too
        )
    gateway = GatewayProcess(name=name, port=port, token=token, popen=popen, log_path=log_path)
    deadline = time.monotonic() + timeout
    while not _healthy(port):
        if not gateway.alive or time.monotonic() > deadline:
            gateway.kill()
            raise AssertionError(f"gateway {name} did not serve on port {port} within {timeout:g} s\n{gateway.tail()}")
        time.sleep(POLL_S)
    return gateway


def _healthy(port: int) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()
