"""Request bodies dropped at every stage, on real sockets: what a client that gives up (or means
harm) leaves a server holding. Each `drop` opens one connection, sends a request head declaring a
large body and part of it — or nothing of it, or a whole small request first — and closes, then
waits for the server to close its side, so that whatever the server read it has read; `rounds` does
that on many connections at once, across several credentials. Blocking and bounded: every socket
has a timeout, every loop a count.

Used by tests/integration/test_body_memory.py against every HTTP listener llmgw runs (the
gateway, the admin routes, the agent port, a standalone gateway).
"""

from __future__ import annotations

import concurrent.futures
import socket
import ssl
from collections.abc import Sequence

import attrs

from testlib.hostile import read_all

TIMEOUT_S = 10.0
MIB = 1 << 20
DECLARED = 8 * MIB  # every body declares the largest size a listener takes by default
SENT = 6 * MIB  # of which this much is sent, where a stage sends part of it
CHUNK = 1 * MIB  # a chunked body's chunk
STAGES = (
    "head only",
    "part of a content-length body",
    "part of a chunked body",
    "in the middle of a chunk",
    "after a finished request",
)


@attrs.frozen(kw_only=True)
class Listener:
    """Where to drop bodies: the address, the path a body is sent to, the credentials to send
    them with (one per connection in turn; "" for none), a request that is answered whole on a
    kept-alive connection (for "after a finished request"), and TLS (for the agent port: no
    client certificate, as any peer may connect)."""

    host: str
    port: int
    path: str
    credentials: Sequence[str] = ("",)
    finished: bytes = b"GET /health HTTP/1.1\r\nhost: t\r\n\r\n"
    tls: bool = False


def _connect(listener: Listener) -> socket.socket:
    sock = socket.create_connection((listener.host, listener.port), timeout=TIMEOUT_S)
    if not listener.tls:
        return sock
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context.wrap_socket(sock)


def _head(listener: Listener, credential: str, framing: bytes) -> bytes:
    auth = f"authorization: Bearer {credential}\r\n".encode() if credential else b""
    return (
        f"POST {listener.path} HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n".encode()
        + auth
        + framing
        + b"\r\n"
    )


def _sendable(stage: str) -> tuple[bytes, bytes]:
    """(framing header lines, the part of the body sent) of a stage."""
    length = b"content-length: %d\r\n" % DECLARED
    chunked = b"transfer-encoding: chunked\r\n"
    if stage == "head only" or stage == "after a finished request":
        return length, b"" if stage == "head only" else b"x" * (SENT // 2)
    if stage == "part of a content-length body":
        return length, b"{" + b" " * (SENT - 1)
    if stage == "part of a chunked body":
        return chunked, (b"%x\r\n" % CHUNK + b" " * CHUNK + b"\r\n") * (SENT // CHUNK)
    if stage == "in the middle of a chunk":
        return chunked, b"%x\r\n" % DECLARED + b" " * SENT
    raise ValueError(f"no stage {stage!r}: one of {', '.join(STAGES)}")


def drop(listener: Listener, stage: str, credential: str = "") -> bytes:
    """One connection that drops a body at `stage`; what the server answered, if anything."""
    framing, part = _sendable(stage)
    answer = b""
    try:
        with _connect(listener) as sock:
            if stage == "after a finished request":
                sock.sendall(listener.finished)
                answer = sock.recv(65536)  # the answer to it (a kept-alive connection stays open)
            sock.sendall(_head(listener, credential, framing) + part)
            if not listener.tls:
                sock.shutdown(socket.SHUT_WR)
            answer += read_all(sock)  # until the server closes: it has read what it will read
    except OSError:
        pass  # the server answered and closed while the body was still being sent: as it may
    return answer


def rounds(listener: Listener, *, connections: int, count: int = 1) -> list[bytes]:
    """`count` rounds of `connections` drops at once, the stages and credentials in turn."""
    answers: list[bytes] = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=connections) as pool:
        for _ in range(count):
            jobs = [
                pool.submit(
                    drop,
                    listener,
                    STAGES[i % len(STAGES)],
                    listener.credentials[i % len(listener.credentials)],
                )
                for i in range(connections)
            ]
            answers += [job.result(timeout=4 * TIMEOUT_S) for job in jobs]
    return answers
