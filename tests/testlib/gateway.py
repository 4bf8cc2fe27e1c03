"""Building blocks of gateway tests: real sim engine processes on loopback (or inside a network
namespace), a gateway in front of them (a static endpoint provider, no control plane), a blocking
HTTP client run in a thread, and a parser of Prometheus text."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import attrs
import trio

from llmgw.config import GatewaySection
from llmgw.gateway.app import Gateway
from llmgw.gateway.routing import Endpoint
from llmgw.gateway.services import serve_services
from llmgw.http.limits import Limits
from llmgw.http.openai import error_body
from llmgw.http.server import bound_address, serve_http
from llmgw.server.state.keys import KeyRing
from llmgw.server.store.asyncstore import AsyncStore
from testlib.cluster import free_port
from testlib.endpoints import StaticEndpoints
from testlib.netns import NetNS
from testlib.proc import llmgw_env


class Sim:
    def __init__(self, name: str, model: str = "chat", *extra: str, netns: NetNS | None = None) -> None:
        """A sim engine on loopback, or inside `netns` on its address."""
        self.name, self.model, self.port, self.key = name, model, free_port(), f"key-{name}"
        self.netns = netns
        self.host = netns.node_addr if netns else "127.0.0.1"
        argv = [sys.executable, "-m", "llmgw", "engine", "sim", "--model", model, "--port", str(self.port)]
        argv += ["--host", self.host, "--api-key", self.key, *extra]
        # What it says of itself, for a failure's message (one that could not listen says why).
        self.log = tempfile.TemporaryFile()
        io = dict(env=llmgw_env(), stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT)
        self.proc = netns.popen(argv, **io) if netns else subprocess.Popen(argv, **io)

    def tail(self, limit: int = 2000) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-limit:]

    def endpoint(self, **kw) -> Endpoint:
        return Endpoint(replica_id=self.name, model=self.model, host=self.host, port=self.port, api_key=self.key, **kw)

    def wait_serving(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"sim {self.name} exited with {self.proc.returncode}:\n{self.tail()}"
            try:
                conn = http.client.HTTPConnection(self.host, self.port, timeout=2)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"sim {self.name} did not serve within {timeout:g} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self.log.close()


@attrs.define
class GW:
    url_host: str
    port: int
    gateway: Gateway
    provider: StaticEndpoints
    token: str
    keys: KeyRing  # the keys' admin side: the gateway authenticates with its table

    async def call(self, method: str, path: str, body=None, *, token: str | None = "", headers=None, timeout=15.0):
        """(status, headers, body) of one request on a fresh connection."""
        token = self.token if token == "" else token
        return await trio.to_thread.run_sync(
            lambda: request(self.port, method, path, body, token=token, headers=headers, timeout=timeout)
        )


def request(
    port: int, method: str, path: str, body=None, *, token=None, headers=None, timeout=15.0, host: str = "127.0.0.1"
):
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        hdrs = dict(headers or {})
        if token:
            hdrs["authorization"] = f"Bearer {token}"
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        if data is not None:
            hdrs.setdefault("content-type", "application/json")
        conn.request(method, path, body=data, headers=hdrs)
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


async def start_gateway(
    nursery: trio.Nursery,
    tmp_path: Path,
    endpoints: tuple[Endpoint, ...],
    *,
    models: frozenset[str] | None = None,
    limits: Limits = Limits(),
    **options,
) -> GW:
    keys = KeyRing(AsyncStore.open(tmp_path / "cp"))
    _, token = await keys.create("tests")
    provider = StaticEndpoints(endpoints, models)
    gateway = Gateway(provider, keys.table, options=GatewaySection(**options))
    await nursery.start(serve_services, gateway)
    listeners = await nursery.start(
        lambda task_status: serve_http(
            gateway.handle, "127.0.0.1", 0, limits=limits, errors=error_body, task_status=task_status
        )
    )
    host, port = bound_address(listeners)
    return GW(url_host=host, port=port, gateway=gateway, provider=provider, token=token, keys=keys)


def chat(content: str = "hello", **extra) -> dict:
    return {"model": "chat", "messages": [{"role": "user", "content": content}], "max_tokens": 8, **extra}


def parse_metrics(text: str) -> dict[tuple[str, frozenset], float]:
    """Prometheus text as {(name, labels): value}; checks each line is well formed."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            assert line.startswith(("# HELP ", "# TYPE ")) or not line, line
            continue
        name_labels, _, value = line.rpartition(" ")
        labels: frozenset = frozenset()
        if "{" in name_labels:
            name, _, rest = name_labels.partition("{")
            assert rest.endswith("}"), line
            pairs = [p for p in rest[:-1].split(",") if p]
            labels = frozenset((k, v.strip('"')) for k, _, v in (p.partition("=") for p in pairs))
        else:
            name = name_labels
        out[(name, labels)] = float(value)
    return out


def by_worker(figures: dict[tuple[str, frozenset], float], name: str, **labels: str) -> dict[str, float]:
    """Series `name` with `labels` in a /metrics labelled by worker (a gateway of its own's, or
    http_listen's): each worker's value, by its instance."""
    wanted = set(labels.items())
    return {
        dict(have)["worker"]: value
        for (found, have), value in figures.items()
        if found == name and "worker" in dict(have) and set(have) - {("worker", dict(have)["worker"])} == wanted
    }


def summed(figures: dict[tuple[str, frozenset], float], name: str, **labels: str) -> float:
    """Series `name` with `labels`, added up over the workers (`by_worker`)."""
    return sum(by_worker(figures, name, **labels).values())
