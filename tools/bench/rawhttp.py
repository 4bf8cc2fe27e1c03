"""The two cheap ends of `tools/bench/gateway.py --workers`: a canned-response upstream and a load
generator, each a plain epoll loop over raw sockets (no trio, no h11), so that on a 2-core machine
neither takes the CPU the gateway workers are measured on.

    python3 -m bench.rawhttp upstream --port P [--processes N]
    python3 -m bench.rawhttp load --port P --token T [--connections C] [--seconds S] [--max-requests N]

`upstream` answers every request (any method and path, its body skipped by its Content-Length)
with one fixed chat completion, HTTP/1.1 keep-alive, from N processes sharing the port
(SO_REUSEPORT); it prints `{"pids": [...]}` once all listen and runs until SIGTERM. `load` keeps C
keep-alive connections busy with one non-streamed chat request each (the next sent as soon as
the answer is in) for S seconds or N requests, whichever comes first, then waits for the answers
still out (at most DRAIN_S) and prints `{"requests", "failed", "seconds", "cpu_s"}`: answers
counted (a non-200 answer counts as failed), the time from the first request sent to the last
answer, and its own CPU time. Both parse only what they must: the end of the head and the
Content-Length; anything they cannot parse is a failure that ends the connection.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import select
import signal
import socket
import sys
import time

BACKLOG = 4096
RECV = 65536
DRAIN_S = 10.0
MAX_HEAD = 16384  # a head longer than this is not an answer this bench expects
CHAT = {"model": "chat", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}
COMPLETION = json.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 0,
        "model": "chat",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
).encode()
ANSWER = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(COMPLETION) + COMPLETION
)


class BadMessage(Exception):
    """Bytes that are not the HTTP/1.1 message this bench expects."""


def framed(buf: bytes | bytearray, start: int) -> tuple[bytes, int] | None:
    """The head of the message at `buf[start:]` and the offset just past its body (by its
    Content-Length; none: no body), or None while it is incomplete."""
    end = buf.find(b"\r\n\r\n", start)
    if end < 0:
        if len(buf) - start > MAX_HEAD:
            raise BadMessage(f"no end of head within {MAX_HEAD} bytes")
        return None
    head = bytes(buf[start:end]).lower()
    at = head.find(b"\r\ncontent-length:")
    length = 0
    if at >= 0:
        line_end = head.find(b"\r\n", at + 2)
        try:
            length = int(head[at + 17 : line_end if line_end >= 0 else len(head)])
        except ValueError:
            raise BadMessage(f"bad Content-Length in {head[:200]!r}") from None
    past = end + 4 + length
    return (head, past) if past <= len(buf) else None


# -- the upstream -----------------------------------------------------------------------------


def listen(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(BACKLOG)
    sock.setblocking(False)
    return sock


def serve_upstream(sock: socket.socket) -> None:
    """Answer every request on every connection with ANSWER, forever."""
    poll = select.epoll()
    poll.register(sock.fileno(), select.EPOLLIN)
    conns: dict[int, tuple[socket.socket, bytearray]] = {}

    def close(fd: int) -> None:
        conn, _ = conns.pop(fd)
        poll.unregister(fd)
        conn.close()

    while True:
        for fd, _ in poll.poll():
            if fd == sock.fileno():
                try:
                    while True:
                        conn, _ = sock.accept()
                        conn.setblocking(False)
                        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                        conns[conn.fileno()] = (conn, bytearray())
                        poll.register(conn.fileno(), select.EPOLLIN)
                except BlockingIOError:
                    pass
                continue
            conn, buf = conns[fd]
            try:
                data = conn.recv(RECV)
            except ConnectionError:
                data = b""
            if not data:
                close(fd)
                continue
            buf += data
            start, answers = 0, 0
            try:
                while (message := framed(buf, start)) is not None:
                    start = message[1]
                    answers += 1
            except BadMessage:
                close(fd)
                continue
            if answers:
                del buf[:start]
                try:
                    conn.sendall(ANSWER * answers)  # a few hundred bytes: the socket buffer takes them
                except (BlockingIOError, ConnectionError):
                    close(fd)


def upstream(port: int, processes: int) -> int:
    socks = [listen(port) for _ in range(processes)]  # all bound before any is announced
    pids = []
    for sock in socks[1:]:
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            serve_upstream(sock)
        pids.append(pid)
        sock.close()

    def stop(signum: int, frame: object) -> None:
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
        for pid in pids:
            os.waitpid(pid, 0)
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    print(json.dumps({"pids": [os.getpid(), *pids]}), flush=True)
    serve_upstream(socks[0])
    return 0


# -- the load ---------------------------------------------------------------------------------


def chat_request(token: str) -> bytes:
    body = json.dumps(CHAT).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
        f"authorization: Bearer {token}\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def load(port: int, token: str, connections: int, seconds: float, max_requests: int) -> dict:
    request = chat_request(token)
    poll = select.epoll()
    conns: dict[int, tuple[socket.socket, bytearray]] = {}
    sent = answered = failed = 0
    first = last = 0.0

    def send(conn: socket.socket) -> None:
        nonlocal sent
        conn.sendall(request)  # small: the socket buffer takes it at once
        sent += 1

    for _ in range(connections):
        conn = socket.create_connection(("127.0.0.1", port))
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.setblocking(False)
        conns[conn.fileno()] = (conn, bytearray())
        poll.register(conn.fileno(), select.EPOLLIN)
    first = time.monotonic()
    stop_at = first + seconds
    for conn, _ in list(conns.values()):
        send(conn)
    drain_until = None
    while conns and sent > answered + failed:
        now = time.monotonic()
        if drain_until is None and (now >= stop_at or sent >= max_requests):
            drain_until = now + DRAIN_S
        if drain_until is not None and now >= drain_until:
            failed += sent - answered - failed  # never answered
            break
        for fd, _ in poll.poll(0.5):
            conn, buf = conns[fd]
            try:
                data = conn.recv(RECV)
            except ConnectionError:
                data = b""
            if not data:
                failed += 1  # the answer it was waiting for will not come
                poll.unregister(fd)
                del conns[fd]
                conn.close()
                continue
            buf += data
            try:
                message = framed(buf, 0)
            except BadMessage:
                failed += 1
                poll.unregister(fd)
                del conns[fd]
                conn.close()
                continue
            if message is None:
                continue
            head, past = message
            del buf[:past]
            last = time.monotonic()
            if head.startswith(b"http/1.1 200 "):
                answered += 1
            else:
                failed += 1
            if drain_until is None and last < stop_at and sent < max_requests:
                send(conn)
    for conn, _ in conns.values():
        conn.close()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "requests": answered,
        "failed": failed,
        "seconds": round(max(last - first, 1e-9), 4),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("upstream", help="serve the canned answer")
    up.add_argument("--port", type=int, required=True)
    up.add_argument("--processes", type=int, default=1)
    gen = sub.add_parser("load", help="send chat requests")
    gen.add_argument("--port", type=int, required=True)
    gen.add_argument("--token", required=True)
    gen.add_argument("--connections", type=int, default=32)
    gen.add_argument("--seconds", type=float, default=10.0)
    gen.add_argument("--max-requests", type=int, default=1_000_000)
    args = parser.parse_args(argv)
    if args.command == "upstream":
        if not 1 <= args.processes <= 64:
            parser.error("--processes must be 1..64")
        return upstream(args.port, args.processes)
    if not 1 <= args.connections <= 4096 or not 0 < args.seconds <= 600:
        parser.error("--connections must be 1..4096 and --seconds 0..600")
    print(json.dumps(load(args.port, args.token, args.connections, args.seconds, args.max_requests)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
