"""A socket's read or write done at once when it can be, before the waiting kind.

trio's `SocketStream.send_all` and `receive_some` are built for the general case: each goes
through a conflict detector and a checkpoint (a trip through the scheduler), a read first tries
`recv` and on EAGAIN registers with epoll and tries again, and the callers here wrap each in a
cancel scope for its deadline. On the gateway's request path most writes fit the socket's
buffer and a request's bytes are often already there, so that machinery was a large part of a
request's CPU (issue 30's profile, docs/performance.md). These try the system call itself on a
plain TCP or Unix socket (`trio.SocketStream`, non-blocking as trio keeps it), and say when it
would have to wait; the caller then waits the usual way, under its deadline.

Only the task that owns the stream's direction may call them (as with trio's own calls, which
would refuse a second reader or writer: these cannot tell). They do not checkpoint: a loop that
may find data every time must checkpoint itself (`llmgw.http.server` does, per request). Errors
are trio's: `BrokenResourceError` for a connection reset or broken, `ClosedResourceError` for a
stream already closed.
"""

from __future__ import annotations

import errno
import os

import trio

_WOULD_BLOCK = (BlockingIOError, InterruptedError)


def plain(stream: object) -> bool:
    """Whether `stream` is a plain socket's (these calls do their work on it)."""
    return type(stream) is trio.SocketStream


def send_now(stream: object, data: bytes | bytearray | memoryview) -> int:
    """Write what the socket takes now, without waiting: how many bytes (0: none, or not a
    plain socket: the caller writes it all the usual way)."""
    if type(stream) is not trio.SocketStream:
        return 0
    try:
        return os.write(_fd(stream), data)
    except _WOULD_BLOCK:
        return 0
    except OSError as exc:
        raise _translated(exc) from exc


def receive_now(stream: object, max_bytes: int) -> bytes | None:
    """What the socket holds now, up to `max_bytes` (b"": the peer closed), or None when
    nothing is there yet (or it is not a plain socket): then wait the usual way."""
    if type(stream) is not trio.SocketStream:
        return None
    try:
        return os.read(_fd(stream), max_bytes)
    except _WOULD_BLOCK:
        return None
    except OSError as exc:
        raise _translated(exc) from exc


def _fd(stream: trio.SocketStream) -> int:
    fd = stream.socket.fileno()
    if fd < 0:
        raise trio.ClosedResourceError("the stream is closed")
    return fd


def _translated(exc: OSError) -> trio.ClosedResourceError | trio.BrokenResourceError:
    """A system call's failure as trio's own calls say it."""
    if exc.errno == errno.EBADF:
        return trio.ClosedResourceError("the stream is closed")
    return trio.BrokenResourceError(f"socket connection broken: {exc.strerror or exc}")


async def receive(stream: trio.abc.ReceiveStream, max_bytes: int, *, waits: bool = False) -> bytes:
    """`receive_some`, trying the socket at once first, unless the caller knows nothing can be
    there yet (`waits`: a request just written, its answer not yet come). A checkpoint either
    way, as `receive_some` is: a peer that always has data ready (an engine streaming fast)
    must not keep the reading task from ever yielding."""
    if type(stream) is not trio.SocketStream:
        return await stream.receive_some(max_bytes)
    data = None if waits else receive_now(stream, max_bytes)
    if data is not None:
        await trio.lowlevel.checkpoint()
    while data is None:
        await trio.lowlevel.wait_readable(stream.socket)
        data = receive_now(stream, max_bytes)
    return data


async def send_all(stream: trio.abc.SendStream, data: bytes | bytearray | memoryview) -> None:
    """`send_all`, writing what the socket takes at once first."""
    sent = send_now(stream, data)
    if sent < len(data):
        await stream.send_all(memoryview(data)[sent:] if sent else data)
