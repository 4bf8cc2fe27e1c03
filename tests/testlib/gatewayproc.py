"""Standalone gateway processes on loopback, for the tests that put several behind a load balancer.

`start_gateway` is the one place such a test starts a gateway. Until `llmgw gateway` exists, each
is a `tools/bench/gateway_runner.py` process: the same `Gateway` code over static endpoints (the
test's sim engines as its replicas), its own store holding the one API key every gateway of the
test takes. A gateway started again on the port of one that died takes that port back at once
(SO_REUSEADDR: the old connections' TIME_WAIT does not hold it).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import attrs
from bench import gateway_runner

from llmgw.server.gateway.routing import Endpoint
from testlib.gateway import parse_metrics
from testlib.proc import llmgw_env

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
        """SIGKILL to its whole process group, as a crashed machine would: no request is finished,
        and no worker process of it lives on."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
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
        """Requests for `model` this gateway answered 200."""
        key = ("llmgw_gateway_requests_total", frozenset({("model", model), ("status", "200")}))
        return int(self.metrics().get(key, 0))

    def in_flight(self, model: str = "chat") -> int:
        """Requests for `model` it is answering now."""
        return int(self.metrics().get(("llmgw_gateway_in_flight", frozenset({("model", model)})), 0))

    def tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        status = "running" if self.alive else f"exited {self.popen.returncode}"
        return f"--- gateway {self.name} ({status}) {self.log_path} ---\n" + "\n".join(text)


def start_gateway(
    tmp: Path, name: str, *, port: int, endpoints: Sequence[Endpoint], token: str, timeout: float = READY_TIMEOUT_S
) -> GatewayProcess:
    """A gateway process serving `endpoints` on 127.0.0.1:`port` with the API key `token`; returns
    once it listens. Each call is a fresh process with fresh state (a restart is another call)."""
    state = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=tmp))
    spec = state / "spec.json"
    spec.write_text(
        json.dumps(
            {
                "state_dir": str(state / "state"),
                "token": token,
                "endpoints": [attrs.asdict(ep) for ep in endpoints],
            }
        )
    )
    out, log_path = state / "ready.json", state / "gateway.log"
    with out.open("wb") as stdout, log_path.open("wb") as stderr:
        popen = subprocess.Popen(
            [sys.executable, "-m", gateway_runner.__name__, str(spec), "--port", str(port)],
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
            env=llmgw_env(),
            start_new_session=True,  # its own process group: `kill` takes all of it
        )
    gateway = GatewayProcess(name=name, port=port, token=token, popen=popen, log_path=log_path)
    deadline = time.monotonic() + timeout
    while not out.read_bytes().endswith(b"\n"):  # the runner prints one line once it listens
        if not gateway.alive or time.monotonic() > deadline:
            gateway.kill()
            raise AssertionError(f"gateway {name} did not listen on port {port} within {timeout:g} s\n{gateway.tail()}")
        time.sleep(POLL_S)
    ready = json.loads(out.read_text())
    assert ready["port"] == port, ready
    return gateway
