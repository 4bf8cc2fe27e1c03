"""Listening sockets handed over by whoever started us (systemd's socket activation protocol).

With a `llmgw-server.socket` unit, systemd owns the listening sockets and passes them to each
`llmgw server` it starts as file descriptors 3, 4, ... (`LISTEN_FDS`, for `LISTEN_PID`). The
sockets outlive the process: while the control plane restarts, connections wait in the
kernel's backlog and the next process accepts them, so a restart refuses no client and no
agent (sd_listen_fds(3)). Anything else that starts llmgw the same way (a test, a benchmark)
gets the same.

`take()` claims them once and removes the variables, so that no child process (an engine of
`llmgw up`) believes they are its own; `for_ports` takes them and sorts them between the
control plane's two ports.
"""

from __future__ import annotations

import os
import socket
import stat
from collections.abc import MutableMapping

import trio

from llmgw.errors import MachineError
from llmgw.log import get_logger

log = get_logger("llmgw.server")

FIRST_FD = 3  # SD_LISTEN_FDS_START
_VARIABLES = ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")


def take(environ: MutableMapping[str, str] | None = None, pid: int | None = None) -> list[socket.socket]:
    """The listening sockets passed to this process, if any (then forgotten by the environment)."""
    env = os.environ if environ is None else environ
    mine = env.get("LISTEN_PID") == str(os.getpid() if pid is None else pid)
    count = env.get("LISTEN_FDS", "")
    for name in _VARIABLES:
        env.pop(name, None)
    if not mine or not count:
        return []
    if not count.isdigit():
        raise MachineError(f"LISTEN_FDS={count!r} is not a number of file descriptors; check the .socket unit")
    socks = []
    for fd in range(FIRST_FD, FIRST_FD + int(count)):
        try:
            mode = os.fstat(fd).st_mode
        except OSError as exc:
            raise MachineError(f"socket activation passed file descriptor {fd}, which is not open: {exc}") from None
        if not stat.S_ISSOCK(mode):
            raise MachineError(f"socket activation passed file descriptor {fd}, which is not a socket")
        sock = socket.socket(fileno=fd)
        if sock.type != socket.SOCK_STREAM or not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            raise MachineError(
                f"socket activation passed file descriptor {fd}, which is not a listening TCP socket; "
                "use ListenStream= in the .socket unit"
            )
        socks.append(sock)
    return socks


def for_ports(
    agent: tuple[str, int], http: tuple[str, int]
) -> tuple[list[trio.SocketListener], list[trio.SocketListener]]:
    """The sockets passed to this process (`take`) for `agent_listen` and for `http_listen`; any
    other is said in the log, with the fix, and left unused."""
    passed = take()
    agent_sockets, http_sockets = matching(passed, *agent), matching(passed, *http)
    if passed:
        log.warning(
            "activation_sockets_unused",
            sockets=describe(passed),
            fix="make the .socket unit's ListenStream= match agent_listen and http_listen in server.toml",
        )
    return agent_sockets, http_sockets


def matching(socks: list[socket.socket], host: str, port: int) -> list[trio.SocketListener]:
    """The passed sockets bound to (host, port) — a wildcard host matches any address on the
    port — as trio listeners; removed from `socks`."""
    found = []
    for sock in list(socks):
        bound_host, bound_port = sock.getsockname()[:2]
        if bound_port == port and (host in ("", "0.0.0.0", "::") or _same_host(bound_host, host)):
            socks.remove(sock)
            found.append(trio.SocketListener(trio.socket.from_stdlib_socket(sock)))
    return found


def describe(socks: list[socket.socket]) -> list[str]:
    out = []
    for sock in socks:
        host, port = sock.getsockname()[:2]
        out.append(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    return out


def _same_host(a: str, b: str) -> bool:
    return a == b or a in ("0.0.0.0", "::") or a.removeprefix("::ffff:") == b
