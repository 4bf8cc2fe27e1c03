"""`rawhttp load` (`tools/bench/rawhttp.py` says what it sends and prints): the load generator, an
epoll loop over raw sockets keeping its connections busy, and `Answers`, its parser of what comes
back (no I/O: bytes in, finished answers out).
"""

from __future__ import annotations

import resource
import select
import socket
import time
from collections import Counter

from bench.rawhttp import DRAIN_S, MAX_HEAD, RECV, BadMessage, chat_request


class Answers:
    """The answers arriving on one connection, parsed as far as the bench needs: the head's
    status, then the body by its Content-Length or its chunks, counting the events (blank lines)
    in a chunked body. No I/O: bytes in, finished answers out."""

    HEAD, LENGTH, SIZE, DATA, DATA_END, TRAILER = range(6)

    def __init__(self) -> None:
        self.buf = bytearray()
        self.state, self.left, self.head = Answers.HEAD, 0, b""
        self.events, self.newline = 0, False  # events so far in this body; did its data end in \n

    def feed(self, data: bytes) -> list[tuple[bytes, int]]:
        """The answers `data` completes: (head, events) each. BadMessage: not such an answer."""
        buf = self.buf
        buf += data
        pos, done = 0, []
        while True:
            state = self.state
            if state == Answers.HEAD:
                end = buf.find(b"\r\n\r\n", pos)
                if end < 0:
                    if len(buf) - pos > MAX_HEAD:
                        raise BadMessage(f"no end of head within {MAX_HEAD} bytes")
                    break
                self.head = head = bytes(buf[pos:end]).lower()
                pos = end + 4
                self.events, self.newline = 0, False
                at = head.find(b"\r\ncontent-length:")
                if at >= 0:
                    line_end = head.find(b"\r\n", at + 2)
                    try:
                        self.left = int(head[at + 17 : line_end if line_end >= 0 else len(head)])
                    except ValueError:
                        raise BadMessage(f"bad Content-Length in {head[:200]!r}") from None
                    self.state = Answers.LENGTH
                elif b"\r\ntransfer-encoding: chunked" in head:
                    self.state = Answers.SIZE
                else:
                    raise BadMessage(f"an answer with neither a length nor chunks: {head[:200]!r}")
            elif state == Answers.LENGTH:
                take = min(self.left, len(buf) - pos)
                pos += take
                self.left -= take
                if self.left:
                    break
                done.append((self.head, 0))
                self.state = Answers.HEAD
            elif state == Answers.SIZE:
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    if len(buf) - pos > 1024:
                        raise BadMessage("a chunk size line over 1 KiB")
                    break
                try:
                    self.left = int(bytes(buf[pos:end]).split(b";", 1)[0], 16)
                except ValueError:
                    raise BadMessage(f"bad chunk size {bytes(buf[pos:end])[:100]!r}") from None
                pos = end + 2
                self.state = Answers.DATA if self.left else Answers.TRAILER
            elif state == Answers.DATA:
                take = min(self.left, len(buf) - pos)
                if not take:
                    break
                piece = buf[pos : pos + take]
                self.events += piece.count(b"\n\n") + (self.newline and piece[0] == 0x0A)
                self.newline = piece[-1] == 0x0A
                pos += take
                self.left -= take
                if self.left:
                    break
                self.state = Answers.DATA_END
            elif state == Answers.DATA_END:
                if len(buf) - pos < 2:
                    break
                if buf[pos : pos + 2] != b"\r\n":
                    raise BadMessage("a chunk not followed by CRLF")
                pos += 2
                self.state = Answers.SIZE
            else:  # TRAILER: header lines until an empty one
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    break
                empty = end == pos
                pos = end + 2
                if empty:
                    done.append((self.head, self.events))
                    self.state = Answers.HEAD
        del buf[:pos]
        return done


def load(
    port: int,
    token: str,
    connections: int,
    seconds: float,
    max_requests: int,
    *,
    stream: bool = False,
    latencies: bool = False,
    drain_s: float = DRAIN_S,
) -> dict:
    request = chat_request(token, stream=stream)
    poll = select.epoll()
    conns: dict[int, tuple[socket.socket, Answers, list[float]]] = {}
    sent = answered = failed = events = 0
    first = last = 0.0
    latency: Counter[int] = Counter()
    first_failure: list[str] = []

    def send(conn: socket.socket, at: list[float]) -> None:
        nonlocal sent
        at[0] = time.perf_counter()
        conn.sendall(request)  # small: the socket buffer takes it at once
        sent += 1

    def fail(fd: int, why: str) -> None:
        nonlocal failed
        failed += 1
        first_failure[:] = first_failure or [why]
        conn = conns.pop(fd)[0]
        poll.unregister(fd)
        conn.close()

    for _ in range(connections):
        conn = socket.create_connection(("127.0.0.1", port))
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.setblocking(False)
        conns[conn.fileno()] = (conn, Answers(), [0.0])
        poll.register(conn.fileno(), select.EPOLLIN)
    first = time.monotonic()
    stop_at = first + seconds
    for conn, _, at in list(conns.values()):
        if sent < max_requests:
            send(conn, at)
    drain_until = None
    while conns and sent > answered + failed:
        now = time.monotonic()
        if drain_until is None and (now >= stop_at or sent >= max_requests):
            drain_until = now + drain_s
        if drain_until is not None and now >= drain_until:
            missing = sent - answered - failed
            failed += missing  # never answered
            first_failure[:] = first_failure or [f"{missing} answers not in within {drain_s:g} s of the end"]
            break
        for fd, _ in poll.poll(0.5):
            conn, answers, at = conns[fd]
            try:
                data = conn.recv(RECV)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:
                fail(fd, "the connection closed before its answer")  # the answer it waited for will not come
                continue
            try:
                complete = answers.feed(data)
            except BadMessage as exc:
                fail(fd, str(exc))
                continue
            if not complete:
                continue
            ended = time.perf_counter()
            last = time.monotonic()
            for head, got in complete:
                if head.startswith(b"http/1.1 200 "):
                    answered += 1
                    events += got
                    if latencies:
                        latency[round((ended - at[0]) * 1e6)] += 1
                else:
                    failed += 1
                    first_failure[:] = first_failure or [head[:300].decode(errors="replace")]
            if drain_until is None and last < stop_at and sent < max_requests:
                send(conn, at)
    for conn, _, _ in conns.values():
        conn.close()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out = {
        "requests": answered,
        "failed": failed,
        "seconds": round(max(last - first, 1e-9), 4),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 3),
        "events": events,
    }
    if latencies:
        out["latency_us"] = sorted(latency.items())
    if first_failure:
        out["first_failure"] = first_failure[0]
    return out
