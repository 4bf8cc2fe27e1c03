"""Hostile peers on real sockets: what a broken or malicious client does to a server.

Each function opens its own connection(s) to (host, port), misbehaves in one way and returns
what the server said, if anything. They are blocking and bounded (every socket has a timeout),
for tests and benchmarks that then check the server still serves. Used against llmgw's HTTP
listener (gateway + admin API), its agent port, the sim engine, the artifact mirror, a node's
weights port and its llama.cpp RPC tunnel.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import ssl
import struct
import time
from collections.abc import Iterable

TIMEOUT_S = 5.0


def connect(host: str, port: int, timeout: float = TIMEOUT_S) -> socket.socket:
    return socket.create_connection((host, port), timeout=timeout)


def reset(sock: socket.socket) -> None:
    """Close with a TCP RST instead of a FIN (SO_LINGER with a zero timeout)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def read_all(sock: socket.socket, limit: int = 1 << 20) -> bytes:
    """Everything until the server closes (or the timeout, or `limit` bytes)."""
    out = b""
    try:
        while len(out) < limit:
            chunk = sock.recv(65536)
            if not chunk:
                break
            out += chunk
    except (TimeoutError, ConnectionError):
        pass
    return out


def cut_at(host: str, port: int, data: bytes, offset: int, *, how: str) -> bytes:
    """Send `data[:offset]`, then FIN (`how="fin"`: shut down our side, read the answer) or
    RST (`how="rst"`: nothing read). Returns what was read."""
    sock = connect(host, port)
    try:
        if offset:
            sock.sendall(data[:offset])
        if how == "rst":
            reset(sock)
            return b""
        sock.shutdown(socket.SHUT_WR)
        return read_all(sock)
    finally:
        sock.close()


def offsets(head: bytes, body: bytes = b"") -> list[int]:
    """Interesting places to cut a request: inside the request line, inside and at the end
    of the head, and inside the body."""
    h, b = len(head), len(body)
    picks = {1, 3, h // 4, h // 2, h - 3, h - 1, h}
    if b:
        picks |= {h + 1, h + b // 2, h + b - 1}
    return sorted(p for p in picks if 0 < p <= h + b)


def request_bytes(
    method: str, path: str, *, body: bytes = b"", headers: Iterable[tuple[str, str]] = (), host: str = "x"
) -> tuple[bytes, bytes]:
    """(head, body) of an HTTP/1.1 request."""
    lines = [f"{method} {path} HTTP/1.1", f"host: {host}", f"content-length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode(), body


def chat_body(model: str, *, stream: bool = False, max_tokens: int = 16, nested: int = 0) -> bytes:
    if nested:
        return b'{"model": "' + model.encode() + b'", "messages": ' + b"[" * nested + b"]" * nested + b"}"
    return json.dumps(
        {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": max_tokens, "stream": stream}
    ).encode()


def trickle(host: str, port: int, data: bytes, *, interval_s: float, limit_s: float) -> tuple[bytes, float]:
    """Send `data` a byte every `interval_s` (a slowloris) for at most `limit_s`, reading what
    the server says meanwhile; (its answer, seconds until the server closed or limit_s)."""
    return trickle_on(connect(host, port, timeout=interval_s), data, interval_s=interval_s, limit_s=limit_s)


def trickle_on(sock: socket.socket, data: bytes, *, interval_s: float, limit_s: float) -> tuple[bytes, float]:
    """`trickle` on a connection already open (a TLS one, its handshake done: each byte its
    own record); closes it."""
    sock.settimeout(interval_s)
    started = time.monotonic()
    answer = b""
    try:
        for i in range(len(data)):
            if time.monotonic() - started > limit_s:
                break
            try:
                sock.sendall(data[i : i + 1])
            except (BrokenPipeError, ConnectionResetError):
                break
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                continue
            except ConnectionError:
                break
            if not chunk:
                break
            answer += chunk
        sock.settimeout(TIMEOUT_S)
        answer += read_all(sock)
    finally:
        sock.close()
    return answer, time.monotonic() - started


def idle(host: str, port: int, count: int) -> list[socket.socket]:
    """`count` connections that send nothing (the caller closes them)."""
    return [connect(host, port) for _ in range(count)]


def closed_by_server(sock: socket.socket, timeout: float) -> bool:
    sock.settimeout(timeout)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionError:
        return True


def status_of(answer: bytes) -> int:
    """The status code of the first response in `answer`, 0 if none."""
    if not answer.startswith(b"HTTP/1."):
        return 0
    return int(answer.split(b" ", 2)[1])


def tls_client(
    host: str, port: int, *, ca: str, cert: str | None = None, key: str | None = None, server_name: str = ""
) -> ssl.SSLSocket:
    """A TLS connection (handshake done) with an optional client certificate."""
    ctx = ssl.create_default_context(cafile=ca)
    ctx.check_hostname = False
    if cert:
        ctx.load_cert_chain(cert, key)
    return ctx.wrap_socket(connect(host, port), server_hostname=server_name or host)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Cut:
    handshake: int  # bytes of the TLS handshake sent
    request: int  # bytes of the encrypted request sent
    answer: bytes  # what the server said, decrypted (after a FIN)


def tls_cut(
    host: str,
    port: int,
    ctx: ssl.SSLContext,
    request: bytes,
    *,
    in_handshake: int | None = None,
    in_request: int | None = None,
    plain: int | None = None,
    how: str,
) -> Cut:
    """A TLS client (`ctx`, with its certificate) whose TLS runs in memory, so the test decides what
    reaches the wire: the first `in_handshake` bytes of its handshake (all: None; nothing after
    it then), else the handshake and the first `in_request` bytes (all: None) of the record(s)
    of `request`'s first `plain` bytes (all: None). Then FIN (`how="fin"`: the answer is read,
    and decrypted when the handshake was done) or RST. The handshake's length varies by a
    byte or two (an ECDSA signature's), so a cut is counted within its part."""
    sock = connect(host, port)
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    conn = ctx.wrap_bio(incoming, outgoing)
    shaken = sent = 0
    done = False
    try:
        while True:
            try:
                conn.do_handshake()
                done = True
            except ssl.SSLWantReadError:
                pass
            data = outgoing.read()
            if in_handshake is not None:
                data = data[: max(0, in_handshake - shaken)]
            sock.sendall(data)
            shaken += len(data)
            if done or in_handshake is not None and shaken >= in_handshake:
                break
            data = sock.recv(65536)
            if not data:
                break  # refused
            incoming.write(data)
        if done and in_handshake is None:
            conn.write(request[:plain] if plain is not None else request)
            data = outgoing.read()
            if in_request is not None:
                data = data[:in_request]
            sock.sendall(data)
            sent = len(data)
        if how == "rst":
            reset(sock)
            return Cut(handshake=shaken, request=sent, answer=b"")
        sock.shutdown(socket.SHUT_WR)
        raw = read_all(sock, limit=4 << 20)
    finally:
        sock.close()
    answer = b""
    if done:
        incoming.write(raw)
        try:
            while chunk := conn.read(65536):
                answer += chunk
        except ssl.SSLError:
            pass  # the end of what came: the server closes without a close_notify
    return Cut(handshake=shaken, request=sent, answer=answer)
