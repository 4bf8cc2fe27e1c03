"""HTTP on a Unix-domain socket: a private listening socket at a path (`serve_http_unix`, on the
one HTTP server, `llmgw.http.server`), and connecting to one (`connect_unix`).

Private: the socket is made in a directory only its owner may enter (0700, made so by
`llmgw.private.make_dir`, and refused when found open to others), and is itself 0600. Reaching
it takes being its owner (or root): the directory is what keeps others out, so the moment
between bind and chmod, in which the socket has the umask's mode, gives nobody else a way in.

A socket file left behind by a process that died without removing it would make bind fail
(EADDRINUSE) for ever: it is removed and bound again. But one that a live server still
answers on is refused (`SocketInUse`), never taken over: two servers on one path would each
lose the other's clients. A server that stops removes the file, if it is still the one it
bound (a successor may have bound its own meanwhile).

A path longer than a socket address holds (sun_path: 107 bytes and a NUL on Linux) is reached
through its directory, opened and named /proc/self/fd/N/NAME, so a state directory deep in a
test's temporary directory works as one in /var/lib does.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shlex
import socket
import stat
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import trio

from llmgw import private
from llmgw.errors import MachineError
from llmgw.http.errors import SocketInUse
from llmgw.http.limits import Limits
from llmgw.http.listeners import ConnectionStats, Shutdown
from llmgw.http.messages import ErrorBody, Handler, plain_error
from llmgw.http.server import serve_http
from llmgw.log import get_logger

log = get_logger("llmgw.http")

MAX_PATH_BYTES = 107
SOCKET_MODE = 0o600
BACKLOG = 128  # a private socket's clients are few: the gateway workers of one machine


@contextlib.contextmanager
def _address(path: Path) -> Iterator[str]:
    """An address for `path` that fits a socket address: the path itself, or, when it is too
    long, /proc/self/fd/N/NAME while its directory is held open as N."""
    if len(os.fsencode(path)) <= MAX_PATH_BYTES:
        yield str(path)
        return
    fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)


def _answers(path: Path) -> bool:
    """Whether a server listens on the socket at `path` now (a connection is taken or queued)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.setblocking(False)  # a Unix connect never waits: it is taken, queued, refused or EAGAIN
    try:
        with _address(path) as address:
            probe.connect(address)
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except BlockingIOError:
        return True  # its backlog is full: someone listens, and is busy
    except OSError as exc:
        raise MachineError(f"cannot tell whether a server listens on {path}: {exc.strerror or exc}") from None
    finally:
        probe.close()
    return True


def _clear_stale(path: Path) -> None:
    """Remove a socket file no server listens on; refuse a live one, or a file of another kind."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        quoted = shlex.quote(str(path))
        raise MachineError(
            f"{path} exists and is not a socket, where llmgw binds its private socket; "
            f"move it aside (`mv {quoted} {quoted}.aside`) and start again"
        )
    if _answers(path):
        raise SocketInUse(path)
    os.unlink(path)
    log.info("stale_socket_removed", path=str(path))


def open_unix_listener(path: Path, *, what: str = "a private socket's directory") -> trio.SocketListener:
    """A listener on the Unix socket `path`, private as the module docstring says: its directory
    made 0700 (or checked), a stale socket there removed, a live one refused (`SocketInUse`)."""
    private.make_dir(path.parent, what)
    _clear_stale(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with _address(path) as address:
            try:
                sock.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise SocketInUse(path) from None  # bound since we looked: another server starts
                raise
            os.chmod(address, SOCKET_MODE)
        sock.listen(BACKLOG)
    except BaseException:
        sock.close()
        raise
    return trio.SocketListener(trio.socket.from_stdlib_socket(sock))


def _remove_if_same(path: Path, bound: os.stat_result) -> None:
    """Remove the socket file at `path` if it is still the one bound (same inode and device)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if (st.st_ino, st.st_dev) == (bound.st_ino, bound.st_dev):
        path.unlink(missing_ok=True)


async def serve_http_unix(
    handler: Handler,
    path: Path,
    *,
    limits: Limits = Limits(),
    errors: ErrorBody = plain_error,
    stats: ConnectionStats | None = None,
    listener: str = "unix",
    shutdown: Shutdown | None = None,
    task_status: trio.TaskStatus[Path] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve HTTP on the private Unix socket `path` (`open_unix_listener`) until cancelled, then
    remove the socket file; `task_status` gets `path` once connections are accepted."""
    sock_listener = open_unix_listener(path)
    bound = os.stat(path)
    serve = partial(
        serve_http,
        handler,
        "",
        0,
        limits=limits,
        errors=errors,
        stats=stats,
        listener=listener,
        shutdown=shutdown,
        sockets=[sock_listener],
    )
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(serve)
            task_status.started(path)
    finally:
        sock_listener.socket.close()  # closed already once served; not if cancelled before
        _remove_if_same(path, bound)


async def connect_unix(path: Path) -> trio.SocketStream:
    """A connection to the Unix socket at `path` (any length, see the module docstring);
    OSError as connect(2) gives it (FileNotFoundError: no socket; ConnectionRefusedError: none
    listens). While the listener's backlog is full this waits for room: bound it with a deadline."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        with _address(path) as address:
            await _connect(sock, address)
    except BaseException:
        sock.close()
        raise
    return trio.SocketStream(trio.socket.from_stdlib_socket(sock))


async def _connect(sock: socket.socket, address: str) -> None:
    # A Unix connect is done at once or refused; EAGAIN means the listener's backlog is full
    # (unix(7)), with nothing in progress — trio's connect takes it for a TCP connect under way
    # and reports a connection that is none. No event says when room frees, so: try again,
    # backing off to 50 ms, until the caller's deadline.
    wait = 0.001
    while True:
        try:
            sock.connect(address)
            return
        except BlockingIOError:
            await trio.sleep(wait)
            wait = min(wait * 2, 0.05)
