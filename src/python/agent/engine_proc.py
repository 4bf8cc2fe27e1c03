"""One engine process's plumbing: its process group, its health probe, its port, and the one
interface (`EngineProcess`) through which the supervisor watches an engine it started (`Child`)
or adopted from an earlier agent (`agent.adoption.Adopted`).

The engine leads its own session (`start_new_session=True`), so its process group id is its
pid and a signal to the group reaches every process it started (vLLM's workers, a shell's
children). A process group id is not reused while any member of the group lives.
"""

from __future__ import annotations

import os
import signal
import socket
from typing import Protocol

import trio

from llmgw.h1 import NEED_DATA, Head, ProtocolError, ResponseParser, request_bytes
from llmgw.log import get_logger

log = get_logger("llmgw.agent.replicas")

HEALTH_TIMEOUT_S = 2.0


class EngineProcess(Protocol):
    """A running engine: started by this agent (`Child`) or by an earlier one (`adoption.Adopted`)."""

    pid: int
    pgid: int

    @property
    def exited(self) -> bool: ...

    @property
    def returncode(self) -> int | None: ...  # None while it runs, or when the status is not ours to know

    async def wait(self) -> None: ...

    def close(self) -> None: ...


class Child:
    """An engine this agent started: `trio.Process` seen as `adoption.Adopted` is, so that one
    supervision loop watches both."""

    def __init__(self, proc: trio.Process) -> None:
        self.proc = proc
        self.pid = proc.pid
        self.pgid = proc.pid  # it leads its own session

    @property
    def exited(self) -> bool:
        return self.proc.returncode is not None

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    async def wait(self) -> None:
        await self.proc.wait()

    def close(self) -> None:
        pass


def signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass  # nothing left in the group
    except PermissionError as exc:
        log.error("replica_signal_refused", pid=pid, signal=sig.name, reason=str(exc))


def probe_host(listen_host: str) -> str:
    return "127.0.0.1" if listen_host in ("", "0.0.0.0") else ("::1" if listen_host == "::" else listen_host)


def pick_port(host: str, preferred: int = 0) -> int:
    """`preferred` if it can be bound on `host` now, else a free port the kernel picks.

    Another process may take it before the engine binds it; the engine then exits saying so and
    the next start picks another."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for candidate in (preferred, 0) if preferred else (0,):
        with socket.socket(family, socket.SOCK_STREAM) as s:
            # As the engines' servers do: a port in TIME_WAIT after a crash is still ours.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, candidate))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError(f"no free TCP port on {host}")


async def probe_health(host: str, port: int, *, timeout_s: float = HEALTH_TIMEOUT_S) -> int | None:
    """The status of `GET /health` on the engine, or None if nothing answered within `timeout_s`."""
    answer = await call_engine(host, port, "GET", "/health", timeout_s=timeout_s, body_limit=None)
    return None if answer is None else answer[0]


ENGINE_ANSWER_MAX_BYTES = 1 << 16  # the most of an engine's answer `call_engine` reads


async def call_engine(
    host: str,
    port: int,
    method: str,
    target: str,
    *,
    timeout_s: float,
    bearer: str = "",
    body_limit: int | None = ENGINE_ANSWER_MAX_BYTES,
    json_body: bytes = b"",
) -> tuple[int, bytes] | None:
    """One request to an engine's API port (`json_body`, or an empty body), on a connection of its own: the
    answer's status and body (up to `body_limit` bytes; None: the status alone, the body not
    read), or None if nothing answered within `timeout_s` or the answer was not HTTP. `bearer`:
    the replica's key, sent as `Authorization: Bearer`."""
    headers = [(b"connection", b"close")]
    if bearer:
        headers.append((b"authorization", b"Bearer " + bearer.encode()))
    if json_body:
        headers.append((b"content-type", b"application/json"))  # request_bytes says its length
    elif method != "GET":
        headers.append((b"content-length", b"0"))
    with trio.move_on_after(timeout_s):
        try:
            stream = await trio.open_tcp_stream(host, port)
        except OSError:
            return None
        async with stream:
            # The codec's client role, as the gateway talks to an engine (`llmgw.gateway.upstream`).
            parser = ResponseParser(request_method=method)
            try:
                await stream.send_all(request_bytes(method, target, f"{host}:{port}", headers, json_body) + json_body)
                status, body = 0, bytearray()
                while True:
                    event = parser.next_event()
                    if event is NEED_DATA:
                        parser.receive_data(await stream.receive_some(1 << 14))
                    elif isinstance(event, Head):
                        status = event.status
                        if body_limit is None:
                            return status, b""
                    elif isinstance(event, bytes):
                        if len(body) + len(event) > (body_limit or 0):
                            return status, bytes(body)  # enough of it: the rest is not read
                        body += event
                    else:  # END
                        return status, bytes(body)
            except (trio.BrokenResourceError, trio.ClosedResourceError, ProtocolError):
                return None  # closed before answering, or not HTTP
    return None
