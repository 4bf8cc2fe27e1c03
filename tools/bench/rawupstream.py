"""`rawhttp upstream` (`tools/bench/rawhttp.py` says what it answers and how): the canned-response
upstream, an epoll loop over raw sockets in each of its processes, which share the port.
"""

from __future__ import annotations

import json
import os
import resource
import select
import signal
import socket
import time

from bench.rawhttp import ANSWER, BACKLOG, RECV, STREAM_HEAD, STREAMED, BadMessage, framed, stream_chunks


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
