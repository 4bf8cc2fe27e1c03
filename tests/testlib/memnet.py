"""A network in memory for gateway tests on trio's MockClock: sim engines are `SimEngine.handle`
served by `llmgw.http.server.serve_connection` over `trio.testing.memory_stream_pair`, reached
through the gateway's connect factory (`MemoryNet.connect`, the `UpstreamPool`'s `connect`),
and the gateway itself is called the same way (`MemGateway.call`). No process, no socket, no
thread: a test waits on what happens, and fake time passes only while everything waits.

An engine can be killed (`MemoryNet.kill`): its connections are closed under the gateway as a
dead process's kernel resets them, and a connect to its address is refused, as it would be.
"""

from __future__ import annotations

import errno
import json
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import h11
import trio
import trio.testing

from llmgw.config import GatewaySection
from llmgw.gateway.app import Gateway
from llmgw.gateway.routing import Endpoint
from llmgw.gateway.services import serve_services
from llmgw.http.limits import Limits
from llmgw.http.messages import Request, Response, StreamingResponse
from llmgw.http.openai import error_body
from llmgw.http.server import serve_connection
from llmgw.server.state.keys import KeyRing
from llmgw.server.store.asyncstore import AsyncStore
from llmgw.simengine.app import SimEngine
from llmgw.simengine.options import SimOptions
from testlib.endpoints import StaticEndpoints

Handler = Callable[[Request], Awaitable[Response | StreamingResponse]]
Address = tuple[str, int]


class _Host:
    """One engine's listening address: its handler, and the connections it serves now."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.serving: set[trio.CancelScope] = set()  # one per connection (each is one task)


class MemoryNet:
    """Addresses served by handlers, in the test's nursery. `connect` is a connect factory."""

    def __init__(self, nursery: trio.Nursery, *, limits: Limits = Limits()) -> None:
        self.nursery = nursery
        self.limits = limits
        self._hosts: dict[Address, _Host] = {}
        self.connects: list[Address] = []  # every connect asked for, refused ones too

    def serve(self, address: Address, handler: Handler) -> None:
        self._hosts[address] = _Host(handler)

    def kill(self, address: Address) -> None:
        """The engine at `address` is gone: its connections close at once, new ones are refused."""
        host = self._hosts.pop(address)
        for scope in host.serving:
            scope.cancel()

    def connections(self, address: Address) -> int:
        """Connections the engine at `address` is serving now."""
        host = self._hosts.get(address)
        return len(host.serving) if host else 0

    async def connect(self, host: str, port: int) -> trio.abc.Stream:
        self.connects.append((host, port))
        served = self._hosts.get((host, port))
        if served is None:
            raise OSError(errno.ECONNREFUSED, "Connection refused")
        client, server = trio.testing.memory_stream_pair()
        self.nursery.start_soon(self._serve, served, server)
        await trio.lowlevel.checkpoint()
        return client

    async def _serve(self, host: _Host, stream: trio.abc.Stream) -> None:
        scope = trio.CancelScope()
        host.serving.add(scope)
        try:
            with scope:
                await serve_connection(host.handler, stream, limits=self.limits, errors=error_body)
        finally:
            host.serving.discard(scope)
            await trio.aclose_forcefully(stream)  # killed: the client reads the end, as after a reset


@attrs.define
class MemSim:
    """A sim engine serving "`model`" at `host:port` on a `MemoryNet`."""

    engine: SimEngine
    name: str
    model: str
    host: str
    port: int
    key: str

    @property
    def address(self) -> Address:
        return (self.host, self.port)

    def endpoint(self, **kw: Any) -> Endpoint:
        return Endpoint(replica_id=self.name, model=self.model, host=self.host, port=self.port, api_key=self.key, **kw)


def start_sims(net: MemoryNet, n: int, *, model: str = "chat", first: int = 0, **options: Any) -> list[MemSim]:
    """`n` sim engines of `model`, serving at once, named and addressed like the real ones
    (`model-i` on 10.0.0.(i+1):8000); `options` are `SimOptions`' (e.g. `output_token_ms`)."""
    sims = []
    for i in range(first, first + n):
        name, key = f"{model}-{i}", f"key-{model}-{i}"
        engine = SimEngine(SimOptions(model=model, api_key=key, **options))
        engine.serving = True
        sim = MemSim(engine=engine, name=name, model=model, host=f"10.0.0.{i + 1}", port=8000, key=key)
        net.serve(sim.address, engine.handle)
        sims.append(sim)
    return sims


class Client:
    """One HTTP/1.1 connection to a handler served in memory, spoken with h11."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.h11 = h11.Connection(h11.CLIENT)

    async def send_head(self, method: str, path: str, headers: list[tuple[str, str]]) -> None:
        request = h11.Request(method=method, target=path, headers=[("host", "gateway"), *headers])
        await self.stream.send_all(self.h11.send(request))

    async def send_body(self, data: bytes) -> None:
        if data:
            await self.stream.send_all(self.h11.send(h11.Data(data=data)))
        await self.stream.send_all(self.h11.send(h11.EndOfMessage()))

    async def head(self) -> tuple[int, dict[str, str]]:
        event = await self._next()
        assert isinstance(event, h11.Response), event
        return event.status_code, {k.decode().lower(): v.decode() for k, v in event.headers}

    async def chunk(self) -> bytes | None:
        """The next piece of the body as it arrives; None at its end."""
        event = await self._next()
        if isinstance(event, h11.EndOfMessage):
            return None
        assert isinstance(event, h11.Data), event
        return bytes(event.data)

    async def _next(self):
        while True:
            event = self.h11.next_event()
            if event is h11.NEED_DATA:
                self.h11.receive_data(await self.stream.receive_some(65536))
            elif not isinstance(event, h11.InformationalResponse):
                return event


@attrs.define
class MemGateway:
    """A gateway with a fixed rotation (no control plane) whose engines are on `net`."""

    gateway: Gateway
    provider: StaticEndpoints
    token: str
    net: MemoryNet
    limits: Limits
    keys: KeyRing  # the keys' admin side: the gateway authenticates with its table

    async def open(self) -> Client:
        """A new connection to the gateway."""
        client, server = trio.testing.memory_stream_pair()
        self.net.nursery.start_soon(
            partial(serve_connection, self.gateway.handle, server, limits=self.limits, errors=error_body)
        )
        await trio.lowlevel.checkpoint()
        return Client(client)

    async def call(
        self, method: str, path: str, body: Any = None, *, token: str | None = "", headers: dict | None = None
    ) -> tuple[int, dict[str, str], bytes]:
        """(status, headers, body) of one request on a fresh connection; `token` "" is the
        gateway's own key, None none."""
        client = await self.open()
        return await request(
            client.stream, method, path, body, token=self.token if token == "" else token, headers=headers
        )


async def request(
    stream: trio.abc.Stream,
    method: str,
    path: str,
    body: Any = None,
    *,
    token: str | None = None,
    headers: dict | None = None,
) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of one request on `stream` (then closed): JSON unless `body` is bytes."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    hdrs = [(k.lower(), v) for k, v in (headers or {}).items()]
    if token:
        hdrs.append(("authorization", f"Bearer {token}"))
    if data is not None:
        hdrs.append(("content-type", "application/json"))
    hdrs.append(("content-length", str(len(data or b""))))
    client = Client(stream)
    try:
        await client.send_head(method, path, hdrs)
        await client.send_body(data or b"")
        status, got = await client.head()
        answer = bytearray()
        while (piece := await client.chunk()) is not None:
            answer += piece
        return status, got, bytes(answer)
    finally:
        await stream.aclose()


async def start_gateway(
    nursery: trio.Nursery,
    tmp_path: Path,
    net: MemoryNet,
    endpoints: tuple[Endpoint, ...],
    *,
    models: frozenset[str] | None = None,
    limits: Limits = Limits(),
    details: tuple = (),
    **options: Any,
) -> MemGateway:
    """A gateway in front of `endpoints` on `net`, its rotation and prober running in `nursery`,
    with one API key ("tests") whose token is `MemGateway.token`."""
    keys = KeyRing(AsyncStore.open(tmp_path / "cp"))
    _, token = await keys.create("tests")
    provider = StaticEndpoints(endpoints, models, details)
    gateway = Gateway(provider, keys.table, options=GatewaySection(**options), connect=net.connect)
    await nursery.start(serve_services, gateway)
    return MemGateway(gateway=gateway, provider=provider, token=token, net=net, limits=limits, keys=keys)
