"""llama.cpp's RPC between the nodes of one replica, carried by their agents over mutual TLS.

llama.cpp's RPC (`ggml-rpc-server` on a helper node, `llama-server --rpc host:port,...` on the
node that serves) has no authentication of its own: whoever reaches an rpc-server can have it
allocate memory, read and write it, and run graphs. So the rpc-server listens on 127.0.0.1
only, and the node's agent carries it to the one node allowed, through two ends of a tunnel:

- `TunnelServer`, on the helper: a listener on the node's cluster address at the replica's
  `dist_init_port`. TLS with this node's certificate, a client's required: of the cluster CA
  (OpenSSL checks its chain, dates and purpose) and of the serving node (rank 0's node id, its
  Subject's CN: `agent.peers.client_node`). Anyone else is closed after the handshake, before a
  byte reaches the rpc-server. Its connections are served as every llmgw port's: each in its own
  task, at most `MAX_CONNECTIONS`, one still in its handshake (due within `HANDSHAKE_TIMEOUT_S`)
  shed for a newcomer at the cap (`llmgw.http.listeners.serve_capped`). The helper opens it
  only once its rpc-server accepts connections, and it closes with it: a handshake that
  succeeds means the rpc-server is there.
- `TunnelClient`, on the serving node: one listener on 127.0.0.1 per helper, the ports given to
  llama-server's `--rpc`; each connection to one dials that helper's tunnel with this node's
  certificate, checks that the server's is the helper's (`agent.peers.check_node`), and relays.
  `reach` is one such dial with nothing relayed: rank 0 waits on it for every helper before it
  starts llama-server (`wait_reachable`).

The relay (`relay`) moves bytes both ways in reads of up to `CHUNK` bytes and does nothing
per byte; the first side to end (EOF, reset, a TLS error) ends the connection, and only that
one. An RPC connection idle for hours is an idle llama-server, not a stalled peer: no idle
deadline; one whose peer vanished without a word is ended by the kernel after `SILENT_S`
(keepalive probes, TCP_USER_TIMEOUT). Whose end came first is told (`Ended`): the serving node's `TunnelClient` fires
`lost` when a helper's side ended a relayed connection (its rpc-server or agent gone), so
rank 0's llama-server, which would fail at its next request, is started again at once.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Awaitable, Callable, Sequence

import attrs
import trio
from cryptography import x509

from agent.peers import PeerFailed, check_node, node_connection
from llmgw.errors import LlmgwError
from llmgw.http.listeners import ConnectionStats, Shutdown, open_listeners, peer_host, serve_capped
from llmgw.log import get_logger
from llmgw.pki.ca import CertInfo
from llmgw.wakeup import Wakeup

log = get_logger("llmgw.agent.rpc")

CHUNK = 256 * 1024  # bytes read at once: a tensor of megabytes in few reads
MAX_CONNECTIONS = 64  # llama-server keeps one connection per rpc-server; a few more while it starts
HANDSHAKE_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 10.0  # a dial to a helper (TCP and TLS), or to the local rpc-server
LISTENER = "rpc"
LOCAL_LISTENER = "rpc-local"
LOCAL = "127.0.0.1"
# A tunnel connection whose peer vanished (its node powered off, the network cut: no FIN, no RST)
# would otherwise stay open forever and hold the helper's rpc-server, which serves one client at
# a time, from the next rank 0: after SILENT_S without an answer to keepalive probes, or with
# data unacknowledged, the kernel ends it (tcp(7)).
SILENT_S = 60


class HelperUnreachable(LlmgwError):
    """A helper node's tunnel could not be reached, or is not the helper's."""


@attrs.frozen(kw_only=True)
class Helper:
    """One helper of a replica as the serving node dials it."""

    node: str  # its node id: the CN its certificate must carry
    address: str
    port: int

    @property
    def where(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{host}:{self.port}"


@attrs.frozen
class Ended:
    """How a relayed connection ended: which side ended it first ("a" or "b"), and how."""

    side: str
    how: str  # "eof", or the error's name


async def relay(a: trio.abc.Stream, b: trio.abc.Stream) -> Ended:
    """Bytes from `a` to `b` and from `b` to `a` until either side ends; then both stop (the
    caller closes the streams). What ended it first: `Ended`."""
    ended: list[Ended] = []

    async def pump(src: trio.abc.Stream, dst: trio.abc.Stream, side: str, other: str, done: trio.CancelScope) -> None:
        try:
            while data := await src.receive_some(CHUNK):
                try:
                    await dst.send_all(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                    ended.append(Ended(other, _how(exc)))
                    return
            ended.append(Ended(side, "eof"))
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            ended.append(Ended(side, _how(exc)))
        finally:
            done.cancel()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(pump, a, b, "a", "b", nursery.cancel_scope)
        nursery.start_soon(pump, b, a, "b", "a", nursery.cancel_scope)
    return ended[0] if ended else Ended("a", "cancelled")


def _end_when_silent(stream: trio.abc.Stream) -> None:
    if not isinstance(stream, trio.SocketStream):
        return  # a test's memory stream
    stream.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    settings = (
        ("TCP_USER_TIMEOUT", SILENT_S * 1000),  # milliseconds
        ("TCP_KEEPIDLE", SILENT_S // 2),
        ("TCP_KEEPINTVL", SILENT_S // 6),
        ("TCP_KEEPCNT", 3),
    )
    for name, value in settings:
        if hasattr(socket, name):
            stream.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def _connect_failure(exc: OSError) -> str:
    """What a failed dial met: `trio.open_tcp_stream` raises one OSError for all its attempts,
    whose cause holds each attempt's."""
    cause = exc.__cause__
    causes = cause.exceptions if isinstance(cause, BaseExceptionGroup) else (exc,)
    if causes and all(isinstance(c, ConnectionRefusedError) for c in causes):
        return "connection refused (its rpc-server is not running yet, or its agent is down)"
    first = causes[0] if causes else exc
    return (first.strerror if isinstance(first, OSError) and first.strerror else None) or str(first)


def _how(exc: BaseException) -> str:
    cause = exc.__cause__ or exc
    return type(cause).__name__


# -- the helper's end ------------------------------------------------------------------------


class TunnelServer:
    """A helper's tunnel port: the serving node (`admits`, a node id) alone gets through, to the
    rpc-server at `target` (127.0.0.1:PORT)."""

    def __init__(
        self,
        ssl_context: ssl.SSLContext,
        *,
        admits: str,
        target: tuple[str, int],
        connect: Callable[[str, int], Awaitable[trio.abc.Stream]] = trio.open_tcp_stream,
    ) -> None:
        """`ssl_context`: `agent.peers.peer_ssl_context` (this node's certificate, a client's required)."""
        self.ssl_context = ssl_context
        self.admits = admits
        self.target = target
        self.connect = connect
        self.stats = ConnectionStats()
        self.shutdown = Shutdown()
        self.relayed = 0  # connections that reached the rpc-server
        self.port = 0

    async def serve(
        self, host: str, port: int, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Listen on `host`:`port` (OSError if it cannot) and serve until cancelled."""
        listeners = await open_listeners(port, host=host)
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started(self.port)
        await serve_capped(
            self._connection,
            listeners,
            max_connections=MAX_CONNECTIONS,
            stats=self.stats,
            listener=LISTENER,
            shutdown=self.shutdown,
        )

    async def _connection(self, raw: trio.abc.Stream) -> None:
        try:
            _end_when_silent(raw)
        except OSError:  # a peer gone already: that connection only
            await trio.aclose_forcefully(raw)
            return
        await node_connection(
            raw,
            self.ssl_context,
            self.shutdown,
            self._relay,
            failed_event="rpc_connection_failed",
            handshake_s=HANDSHAKE_TIMEOUT_S,
        )

    async def _relay(self, stream: trio.SSLStream, node: CertInfo | None) -> None:
        """A connection whose handshake is done: relayed to the rpc-server if it is rank 0's node."""
        if node is None or node.common_name != self.admits:
            who = node.common_name if node is not None else "a peer without a node's certificate"
            log.warning("rpc_peer_refused", peer=peer_host(stream.transport_stream), node=who, admits=self.admits)
            return
        try:
            with trio.fail_after(CONNECT_TIMEOUT_S):
                local = await self.connect(*self.target)
        except (OSError, trio.TooSlowError) as exc:
            log.warning("rpc_server_unreachable", target=f"{self.target[0]}:{self.target[1]}", reason=repr(exc))
            return
        self.relayed += 1
        async with local:
            ended = await relay(stream, local)
        log.info(
            "rpc_connection_ended",
            peer=node.common_name,
            by="serving node" if ended.side == "a" else "rpc-server",
            how=ended.how,
        )


# -- the serving node's end ---------------------------------------------------------------------


class TunnelClient:
    """The serving node's local ends of its helpers' tunnels: `serve` opens one listener on
    127.0.0.1 per helper and tells their ports (in the helpers' order), for llama-server's --rpc."""

    def __init__(
        self,
        helpers: Sequence[Helper],
        ssl_context: ssl.SSLContext,
        ca: x509.Certificate,
        *,
        connect: Callable[[str, int], Awaitable[trio.abc.Stream]] = trio.open_tcp_stream,
    ) -> None:
        """`ssl_context`: `agent.peers.peer_client_ssl_context` (this node's certificate); `ca`:
        the cluster CA, which the helpers' certificates must be of."""
        self.helpers = tuple(helpers)
        self.ssl_context = ssl_context
        self.ca = ca
        self.connect = connect
        self.stats = ConnectionStats()
        self.lost = Wakeup()  # a helper's side ended a relayed connection
        self.lost_how = ""  # what happened, for the member's detail

    async def dial(self, helper: Helper) -> trio.SSLStream:
        """A TLS connection to `helper`'s tunnel, its certificate checked; `HelperUnreachable`
        saying what failed otherwise (refused, timed out, TLS refused, not the helper)."""
        if not helper.address:
            raise HelperUnreachable(f"helper node {helper.node}: the control plane named no address for it")
        try:
            with trio.fail_after(CONNECT_TIMEOUT_S):
                raw = await self.connect(helper.address, helper.port)
                _end_when_silent(raw)
                stream = trio.SSLStream(raw, self.ssl_context, server_hostname=None)
                try:
                    await stream.do_handshake()
                    check_node(stream.getpeercert(binary_form=True), self.ca, helper.node)
                except BaseException:
                    await trio.aclose_forcefully(stream)
                    raise
        except trio.TooSlowError:
            raise HelperUnreachable(
                f"helper node {helper.node} at {helper.where}: no answer within {CONNECT_TIMEOUT_S:g} s"
            ) from None
        except PeerFailed as exc:
            raise HelperUnreachable(f"helper node {helper.node} at {helper.where} is not that node: {exc}") from None
        except (trio.BrokenResourceError, ssl.SSLError) as exc:
            raise HelperUnreachable(
                f"helper node {helper.node} at {helper.where} refused the TLS handshake ({_how(exc)}): its agent "
                "does not admit this node (not its replica's serving node?)"
            ) from None
        except OSError as exc:
            raise HelperUnreachable(f"helper node {helper.node} at {helper.where}: {_connect_failure(exc)}") from None
        return stream

    async def reach(self, helper: Helper) -> None:
        """One dial to `helper`, closed at once: its rpc-server runs and its tunnel admits this node."""
        stream = await self.dial(helper)
        await trio.aclose_forcefully(stream)

    async def wait_reachable(
        self, *, within_s: float, on_wait: Callable[[str], None] = lambda text: None, retry_s: float = 1.0
    ) -> None:
        """Until every helper was reached once (they start when this node does, and may take a
        while), dialling each again every `retry_s`; `HelperUnreachable` for the first still
        unreachable after `within_s`, saying why. `on_wait(text)` says whom it waits for."""
        waiting = list(self.helpers)
        last: dict[str, str] = {}

        def said(helper: Helper) -> str:
            return last.get(helper.node, f"helper node {helper.node} at {helper.where}: no answer yet")

        async def look(helper: Helper) -> None:
            try:
                await self.reach(helper)
            except HelperUnreachable as exc:
                last[helper.node] = str(exc)
            else:
                waiting.remove(helper)

        with trio.move_on_after(within_s):
            while waiting:
                async with trio.open_nursery() as nursery:  # all at once: one silent helper delays none
                    for helper in list(waiting):
                        nursery.start_soon(look, helper)
                if waiting:
                    on_wait("waiting for helper nodes: " + "; ".join(said(h) for h in waiting))
                    await trio.sleep(retry_s)
        if waiting:
            raise HelperUnreachable(
                f"helper nodes not reached within {within_s:g} s: " + "; ".join(said(h) for h in waiting)
            )

    async def serve(self, *, task_status: trio.TaskStatus[tuple[int, ...]] = trio.TASK_STATUS_IGNORED) -> None:
        """Open a listener on 127.0.0.1 per helper, tell their ports, serve until cancelled."""
        opened: list[list[trio.SocketListener]] = []
        try:
            for _ in self.helpers:
                opened.append(await open_listeners(0, host=LOCAL))
        except BaseException:
            for listeners in opened:
                for listener in listeners:
                    await listener.aclose()
            raise
        ports = tuple(listeners[0].socket.getsockname()[1] for listeners in opened)
        async with trio.open_nursery() as nursery:
            for helper, listeners in zip(self.helpers, opened, strict=True):
                nursery.start_soon(self._serve_one, helper, listeners)
            task_status.started(ports)

    async def _serve_one(self, helper: Helper, listeners: list[trio.SocketListener]) -> None:
        async def handle(local: trio.abc.Stream) -> None:
            await self._connection(helper, local)

        await serve_capped(
            handle, listeners, max_connections=MAX_CONNECTIONS, stats=self.stats, listener=LOCAL_LISTENER
        )

    async def _connection(self, helper: Helper, local: trio.abc.Stream) -> None:
        try:
            try:
                remote = await self.dial(helper)
            except HelperUnreachable as exc:
                log.warning("rpc_helper_unreachable", helper=helper.node, reason=str(exc))
                self._lose(helper, str(exc))
                return
            async with remote:
                ended = await relay(local, remote)
            if ended.side == "b":
                said = (
                    f"the RPC connection to helper node {helper.node} at {helper.where} ended on its side ({ended.how})"
                )
                log.warning("rpc_helper_lost", helper=helper.node, how=ended.how)
                self._lose(helper, said)
        except (trio.BrokenResourceError, trio.ClosedResourceError, ssl.SSLError, OSError):
            return
        except Exception:  # - one connection's failure must never stop the port
            log.exception("rpc_connection_failed")
        finally:
            await trio.aclose_forcefully(local)

    def _lose(self, helper: Helper, said: str) -> None:
        self.lost_how = said
        self.lost.fire()
