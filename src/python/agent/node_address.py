"""Where this node's engines listen: the address the gateway reaches the node at.

The gateway dials a replica at its rank 0 node's address as the control plane sees it: the
peer address of that node's agent link. Without address translation in between, that is the
local address of the link's own socket, which the link records here after each connect
(127.0.0.N for `llmgw up`'s agents, which dial from there; the node's address on the cluster
network otherwise). An engine listens on that one address, not on 0.0.0.0, so it is not
reachable on the node's other networks.

The address is known from the first connect on, and kept while the link is down. An engine
keeps the address it was started with for as long as it runs; only a start (first, or after
an exit) takes the current one, and an engine whose address has left the machine is started
again (`agent.replica_watch`).
"""

from __future__ import annotations

import errno
import socket

import trio

from llmgw.wakeup import Wakeup

WILDCARDS = ("", "0.0.0.0", "::")


class NodeAddress:
    """The link's local address ("" until the first connect), and a wake-up when it changes."""

    def __init__(self, fixed: str = "") -> None:
        """`fixed`: an address known from the start (tests, a supervisor without a link)."""
        self._value = fixed
        self._known = trio.Event()  # set once, at the first address
        self.changed = Wakeup()
        if fixed:
            self._known.set()

    @property
    def current(self) -> str:
        return self._value

    def set(self, address: str) -> None:
        if not address or address == self._value:
            return
        self._value = address
        self._known.set()
        self.changed.fire()

    async def wait_known(self) -> str:
        await self._known.wait()
        return self._value

    async def wait_changed(self) -> None:
        """Until the next change (the caller looks at `current` after it)."""
        await self.changed.wait()


def local_host(sock: socket.socket) -> str:
    """The local address of a connected socket, as an engine's --host takes it."""
    host = sock.getsockname()[0]
    if host.startswith("::ffff:") and "." in host:
        return host[len("::ffff:") :]  # an IPv4 peer on a dual-stack socket: the IPv4 address is what binds
    return host


def is_wildcard(host: str) -> bool:
    return host in WILDCARDS


def address_present(host: str) -> bool:
    """Whether `host` is still an address of this machine (it can be bound). Wildcards always are;
    so is anything whose absence cannot be told (then nothing is restarted for it)."""
    if is_wildcard(host):
        return True
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, 0))
        except OSError as exc:
            return exc.errno != errno.EADDRNOTAVAIL
    return True
