"""The cheap ends of `tools/bench/gateway.py`: a canned-response upstream and a load generator,
each a plain epoll loop over raw sockets (no trio, no h11), so that on a 2-core machine neither
takes the CPU the gateway is measured on.

    python3 -m bench.rawhttp upstream --port P [--processes N] [--events E] [--event-gap-ms G]
    python3 -m bench.rawhttp load --port P --token T [--connections C] [--seconds S]
        [--max-requests N] [--stream] [--latencies] [--drain-s D]

`upstream` answers every request (any method and path, its body skipped by its Content-Length),
HTTP/1.1 keep-alive, from N processes sharing the port (SO_REUSEPORT). A request whose body says
`"stream": true` gets a server-sent event stream of E events (chunked, `text/event-stream`,
each event a chat completion chunk in a chunk of its own, the last `data: [DONE]`): the first
at once, then with a gap of G ms the next event of every stream under way every G ms, all in
the same moment, as a batching engine's decode step gives each running sequence its next token;
with 0, all of a stream's events at once, each in a `send()` of its own. Any other request gets
one fixed chat completion. It prints `{"pids": [...]}` once all listen and runs
until SIGTERM.

`load` keeps C keep-alive connections busy with one chat request each (`--stream`: a streamed
one), the next sent as soon as the answer is in, for S seconds or N requests, whichever comes
first, then waits for the answers still out (at most D seconds) and prints one JSON object:
`requests` (answers with status 200), `failed` (any other status, or a connection closed or
unparsable before its answer), `seconds` (from the first request sent to the last answer),
`cpu_s` (its own CPU time), `events` (server-sent events in the answers' bodies), and with
`--latencies` `latency_us`: each answer's time from its request sent to its last byte, as
[microseconds, count] pairs in ascending order; with failures, `first_failure` (the first failed
answer's head, or why). Both parse only what they must: the end of the head, the Content-Length
or the chunked framing; anything else is a failure that ends the connection.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import select
import signal
import socket
import sys
import time
from collections import Counter

BACKLOG = 4096
RECV = 65536
DRAIN_S = 10.0
MAX_DRAIN_S = 600.0
MAX_HEAD = 16384  # a head longer than this is not an answer this bench expects
MAX_EVENTS = 100_000
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
STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
TOKEN_EVENT = (
    b"data: "
    + json.dumps(
        {
            "id": "chatcmpl-bench",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": "chat",
            "choices": [{"index": 0, "delta": {"content": "tok"}, "finish_reason": None}],
        }
    ).encode()
    + b"\n\n"
)
DONE_EVENT = b"data: [DONE]\n\n"
# Whatever spacing the gateway forwards the client's body with.
STREAMED = re.compile(rb'"stream"\s*:\s*true')


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


TOKEN_CHUNK = chunk(TOKEN_EVENT)
LAST_CHUNK = chunk(DONE_EVENT) + b"0\r\n\r\n"


def stream_chunks(events: int) -> list[bytes]:
    """A streamed answer's writes after its head: `events` events, the last `[DONE]` and the end."""
    return [TOKEN_CHUNK] * (events - 1) + [LAST_CHUNK]


class BadMessage(Exception):
    """Bytes that are not the HTTP/1.1 message this bench expects."""


def framed(buf: bytes | bytearray, start: int) -> tuple[bytes, int, int] | None:
    """The head of the request at `buf[start:]`, where its body starts and the offset just past
    it (by its Content-Length; none: no body), or None while it is incomplete."""
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
    return (head, end + 4, past) if past <= len(buf) else None


# -- the upstream -----------------------------------------------------------------------------


def listen(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(BACKLOG)
    sock.setblocking(False)
    return sock


class Upstream:
    """One process's epoll loop. A connection answers its requests in order; while it streams,
    further requests wait in its buffer (a client here never pipelines behind a stream). What
    the kernel does not take at once waits in the connection's `out` for EPOLLOUT."""

    class Conn:
        __slots__ = ("sock", "fd", "buf", "out", "pending", "closed")

        def __init__(self, sock: socket.socket) -> None:
            self.sock, self.fd = sock, sock.fileno()
            self.buf, self.out = bytearray(), bytearray()
            self.pending: list[bytes] = []  # the stream's writes still due, last first
            self.closed = False

    def __init__(self, sock: socket.socket, events: int, gap_s: float) -> None:
        self.sock, self.events, self.gap_s = sock, events, gap_s
        self.poll = select.epoll()
        self.poll.register(sock.fileno(), select.EPOLLIN)
        self.conns: dict[int, Upstream.Conn] = {}
        # The streams between their first event and their last, in the order they began, and
        # when they next write: all at once, as a batching engine's decode step gives every
        # running sequence its next token.
        self.streaming: dict[int, Upstream.Conn] = {}
        self.next_step = 0.0

    def serve(self) -> None:
        """Forever."""
        while True:
            timeout = -1.0 if not self.streaming else max(0.0, self.next_step - time.monotonic())
            for fd, mask in self.poll.poll(timeout):
                if fd == self.sock.fileno():
                    self.accept()
                    continue
                conn = self.conns.get(fd)
                if conn is None:
                    continue
                if mask & select.EPOLLOUT:
                    self.write(conn, b"")
                if mask & (select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR) and not conn.closed:
                    self.read(conn)
            if self.streaming and time.monotonic() >= self.next_step:
                self.next_step = time.monotonic() + self.gap_s
                for conn in list(self.streaming.values()):
                    self.next_event(conn)

    def accept(self) -> None:
        try:
            while True:
                sock, _ = self.sock.accept()
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conn = Upstream.Conn(sock)
                self.conns[conn.fd] = conn
                self.poll.register(conn.fd, select.EPOLLIN)
        except BlockingIOError:
            pass

    def close(self, conn: Upstream.Conn) -> None:
        if not conn.closed:
            conn.closed = True
            del self.conns[conn.fd]
            self.streaming.pop(conn.fd, None)
            self.poll.unregister(conn.fd)
            conn.sock.close()

    def read(self, conn: Upstream.Conn) -> None:
        try:
            data = conn.sock.recv(RECV)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.close(conn)
            return
        conn.buf += data
        self.answer(conn)

    def answer(self, conn: Upstream.Conn) -> None:
        """Answer the complete requests in `conn.buf`, up to the first streamed one."""
        start, answers = 0, 0
        try:
            while not conn.pending and (message := framed(conn.buf, start)) is not None:
                _, body, past = message
                streamed = STREAMED.search(conn.buf, body, past) is not None
                start = past
                if not streamed:
                    answers += 1
                    continue
                out = ANSWER * answers + STREAM_HEAD
                answers = 0
                conn.pending = stream_chunks(self.events)[::-1]
                if self.gap_s:
                    self.write(conn, out + conn.pending.pop())
                    if conn.pending and not conn.closed:
                        if not self.streaming:
                            self.next_step = time.monotonic() + self.gap_s
                        self.streaming[conn.fd] = conn
                else:
                    self.write(conn, out)
                    while conn.pending and not conn.closed:
                        self.write(conn, conn.pending.pop())  # each a send() of its own
        except BadMessage:
            self.close(conn)
            return
        del conn.buf[:start]
        if answers:
            self.write(conn, ANSWER * answers)

    def next_event(self, conn: Upstream.Conn) -> None:
        if conn.closed:
            return  # by an error of its own earlier in this step
        self.write(conn, conn.pending.pop())
        if conn.closed or conn.pending:
            return
        del self.streaming[conn.fd]
        if conn.buf:
            self.answer(conn)  # a request that came in while it streamed

    def write(self, conn: Upstream.Conn, data: bytes) -> None:
        """Send `data` after what is waiting; keep what the kernel does not take."""
        if conn.out:
            conn.out += data
            data = bytes(conn.out)
        if not data:
            return
        try:
            sent = conn.sock.send(data)
        except BlockingIOError:
            sent = 0
        except OSError:
            self.close(conn)
            return
        waiting = bool(conn.out)
        conn.out = bytearray(data[sent:])
        if conn.out and not waiting:
            self.poll.modify(conn.fd, select.EPOLLIN | select.EPOLLOUT)
        elif waiting and not conn.out:
            self.poll.modify(conn.fd, select.EPOLLIN)


def upstream(port: int, processes: int, events: int, gap_s: float) -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # thousands of open streams
    socks = [listen(port) for _ in range(processes)]  # all bound before any is announced
    pids = []
    for sock in socks[1:]:
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            Upstream(sock, events, gap_s).serve()
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
    Upstream(socks[0], events, gap_s).serve()
    return 0


# -- the load ---------------------------------------------------------------------------------


def chat_body(*, stream: bool) -> bytes:
    return json.dumps({**CHAT, "stream": True} if stream else CHAT).encode()


def chat_request(token: str, *, stream: bool = False) -> bytes:
    body = chat_body(stream=stream)
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
        f"authorization: Bearer {token}\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("upstream", help="serve the canned answers")
    up.add_argument("--port", type=int, required=True)
    up.add_argument("--processes", type=int, default=1)
    up.add_argument("--events", type=int, default=16, help="events in a streamed answer, [DONE] included")
    up.add_argument("--event-gap-ms", type=float, default=0.0, help="between a stream's events (0: all at once)")
    gen = sub.add_parser("load", help="send chat requests")
    gen.add_argument("--port", type=int, required=True)
    gen.add_argument("--token", required=True)
    gen.add_argument("--connections", type=int, default=32)
    gen.add_argument("--seconds", type=float, default=10.0)
    gen.add_argument("--max-requests", type=int, default=1_000_000)
    gen.add_argument("--stream", action="store_true", help='ask for streamed answers ("stream": true)')
    gen.add_argument("--latencies", action="store_true", help="report each answer's latency (latency_us)")
    gen.add_argument("--drain-s", type=float, default=DRAIN_S, help="wait this long for the answers still out")
    args = parser.parse_args(argv)
    if args.command == "upstream":
        if not 1 <= args.processes <= 64:
            parser.error("--processes must be 1..64")
        if not 1 <= args.events <= MAX_EVENTS or not 0 <= args.event_gap_ms <= 60_000:
            parser.error(f"--events must be 1..{MAX_EVENTS} and --event-gap-ms 0..60000")
        return upstream(args.port, args.processes, args.events, args.event_gap_ms / 1000)
    if not 1 <= args.connections <= 4096 or not 0 < args.seconds <= 600 or args.max_requests < 1:
        parser.error("--connections must be 1..4096, --seconds 0..600 and --max-requests at least 1")
    if not 0 < args.drain_s <= MAX_DRAIN_S:
        parser.error(f"--drain-s must be 0..{MAX_DRAIN_S:g}")
    result = load(
        args.port,
        args.token,
        args.connections,
        args.seconds,
        args.max_requests,
        stream=args.stream,
        latencies=args.latencies,
        drain_s=args.drain_s,
    )
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
