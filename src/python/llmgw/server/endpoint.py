"""The agent endpoint: where agents connect, prove who they are, and keep a link open.

Order of checks on a new connection, each refusal logged here with its reason and told to the
agent in the clearest way the stage allows:

1. TLS handshake with a client certificate from the cluster CA (OpenSSL refuses another CA's,
   an expired one, or none; the agent receives the TLS alert at once).
2. The certificate's serial is not revoked (`llmgw node remove`) -> else HTTP 403 with the reason.
   When the store cannot answer, the check fails closed: HTTP 503 saying so, and the agent retries.
3. The node id the agent claims (`x-llmgw-node-id`) equals the certificate's CN -> else 403.
4. WebSocket upgrade; the first frame is a `Hello` of our protocol version with the same node id
   -> else a `LinkError` frame and close.

Then the link carries heartbeats and inventory from the agent and desired state to it. A
node's newer link replaces an older one; `close_node` ends a node's link (revocation).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path

import attrs
import trio
import trio_websocket

from llmgw import __version__
from llmgw.errors import leaves, only
from llmgw.http import listeners
from llmgw.http import server as http
from llmgw.log import get_logger
from llmgw.pki.ca import CertInfo, cert_info_from_der
from llmgw.pki.tls import send_tls_alert
from llmgw.pki.tlsdiag import describe_tls_failure
from llmgw.server import artifacts
from llmgw.server.asyncstore import AsyncStore
from llmgw.server.registry import Registry
from llmgw.server.store import StoreError
from llmgw.wire import agent_link as w
from llmgw.wire.convert import decode, encode
from llmgw.wire.errors import WireError

log = get_logger("llmgw.endpoint")

_LINK_BROKEN = (trio.BrokenResourceError, trio.ClosedResourceError, trio_websocket.ConnectionClosed)

AGENT_PATH = "/v1/agent"
NODE_ID_HEADER = "x-llmgw-node-id"
LISTENER = "agent"  # the listener's name in /metrics
HANDSHAKE_TIMEOUT_S = 10.0
HELLO_TIMEOUT_S = 10.0
REFUSAL_SEND_S = 1.0  # a refused agent is told why within this, then the connection closes
# A message to an agent must be taken within this; an agent that stops reading is cut off
# (its link is closed) instead of stalling whoever pushes desired state to it.
SEND_TIMEOUT_S = 10.0


@attrs.define(kw_only=True)
class Link:
    node_id: str
    conn_id: int
    ws: trio_websocket.WebSocketConnection
    cancel_scope: trio.CancelScope


class AgentEndpoint:
    def __init__(
        self,
        *,
        registry: Registry,
        store: AsyncStore,
        heartbeat_interval_s: float,
        desired_state: Callable[[str], w.DesiredState],
        on_change: Callable[[], None] = lambda: None,
        artifact_store: artifacts.Artifacts | None = None,
        on_replicas: Callable[[str, tuple[w.ReplicaStatus, ...]], None] = lambda node, statuses: None,
        silence_timeout_s: float = 0.0,
        stats: listeners.ConnectionStats | None = None,
        max_connections: int = 0,
        send_timeout_s: float = artifacts.SEND_TIMEOUT_S,
    ) -> None:
        self.send_timeout_s = send_timeout_s  # each write of a mirrored archive
        # A link silent this long (no heartbeat, no message) is closed: the agent is gone or cut
        # off, and its connection's resources go back. 0 = never (tests of other things).
        self.silence_timeout_s = silence_timeout_s
        self.stats = stats or listeners.ConnectionStats()
        self.max_connections = max_connections  # 0 = sized from the fd limit
        self.on_replicas = on_replicas
        self._log_waiters: dict[int, list[w.LogsReply]] = {}
        self._log_event = trio.Event()
        self._next_request = 0
        self.artifacts = artifact_store or artifacts.Artifacts(Path("/nonexistent"))
        self.registry = registry
        self.store = store
        self.heartbeat_interval_s = heartbeat_interval_s
        self.desired_state = desired_state
        self.on_change = on_change
        self.links: dict[str, Link] = {}

    async def serve(
        self,
        host: str,
        port: int,
        ssl_context,
        *,
        sockets: list[trio.SocketListener] | None = None,
        task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Accept agents on (host, port), or on `sockets` already listening (socket activation)."""
        if sockets:
            bound = [trio.SSLListener(s, ssl_context, https_compatible=True) for s in sockets]
        else:
            bound = await trio.open_ssl_over_tcp_listeners(port, ssl_context, host=host, https_compatible=True)
        task_status.started(bound)
        cap = self.max_connections or listeners.default_max_connections(LISTENER)
        await listeners.serve_capped(self._handle, bound, max_connections=cap, stats=self.stats, listener=LISTENER)

    async def _handle(self, stream: trio.SSLStream) -> None:
        """One connection, contained: whatever the peer does ends this connection only (see
        `llmgw.http.server`'s "Containment"); a bug of ours is logged with its traceback."""
        address = _peer_host(stream)
        cn = "?"
        try:
            cert = await self._handshake(stream, address)
            if cert is None:
                return
            cn = cert.common_name
            await self._serve_authenticated(stream, cert, address)
        except Exception as exc:  # - one link's failure must never stop the endpoint
            reason = http.peer_reason(exc)
            if reason is None and only(exc, _LINK_BROKEN):
                reason = "closed"
            if reason is None:
                self.stats.abort(LISTENER, "internal")
                log.exception("agent_link_failed", address=address, cn=cn)
            else:
                self.stats.abort(LISTENER, reason)
                log.info("agent_link_closed", address=address, cn=cn, reason=reason, detail=repr(leaves(exc)[0]))
        finally:
            await trio.aclose_forcefully(stream)

    async def _handshake(self, stream: trio.SSLStream, address: str) -> CertInfo | None:
        """The TLS handshake with a client certificate of the cluster CA, or None (refused,
        logged, the agent told why by the TLS alert)."""
        try:
            with trio.fail_after(HANDSHAKE_TIMEOUT_S):
                await stream.do_handshake()
        except (trio.BrokenResourceError, trio.TooSlowError) as exc:
            reason = describe_tls_failure(exc, side="server") or f"TLS handshake failed: {exc.__cause__ or exc!r}"
            log.warning("agent_refused", address=address, stage="tls", reason=reason)
            self.stats.abort(LISTENER, "tls")
            await send_tls_alert(stream)  # so the agent learns why, at once
            return None
        return cert_info_from_der(stream.getpeercert(binary_form=True))

    async def _serve_authenticated(self, stream: trio.SSLStream, cert: CertInfo, address: str) -> None:
        # The whole request head within the deadline, however it trickles in.
        with trio.fail_after(HELLO_TIMEOUT_S):
            head, conn, http_request = await artifacts.read_request_head(stream)
        if http_request is not None and http_request.target.startswith(artifacts.PREFIX.encode()):
            refusal = await self._revocation_refusal(cert)
            if refusal is not None:
                log.warning("agent_refused", address=address, stage="identity", cn=cert.common_name, reason=refusal[1])
                self.stats.abort(LISTENER, "refused")
                return
            await artifacts.serve(
                stream, conn, http_request, self.artifacts, cert.common_name, send_timeout_s=self.send_timeout_s
            )
            return
        async with trio.open_nursery() as nursery:
            # trio-websocket reads the connection in a task of this nursery; it ends with the
            # connection, whichever way (the cancel below, for a refusal: not at the peer's leisure).
            try:
                with trio.fail_after(HELLO_TIMEOUT_S):
                    request = await trio_websocket.wrap_server_stream(nursery, artifacts.ReplayStream(stream, head))
                refusal = await self._refusal(request, cert)
                if refusal is not None:
                    status, reason = refusal
                    log.warning("agent_refused", address=address, stage="identity", cn=cert.common_name, reason=reason)
                    self.stats.abort(LISTENER, "refused")
                    with trio.move_on_after(REFUSAL_SEND_S):
                        await request.reject(status, body=reason.encode())
                    return
                ws = await request.accept()
                await self._run_link(ws, cert, address)
            finally:
                nursery.cancel_scope.cancel()

    async def _revocation_refusal(self, cert: CertInfo) -> tuple[int, str] | None:
        try:
            revoked = await self.store.is_revoked(cert.serial)
        except StoreError as exc:
            # Fail closed: a certificate not known to be valid does not get in.
            return 503, (
                f"the control plane's database is busy or failing, so the revocation of certificate {cert.serial:x} "
                f"cannot be checked; this connection is refused and the agent retries by itself ({exc})"
            )
        if revoked:
            return 403, (
                f"the certificate of node {cert.common_name!r} (serial {cert.serial:x}) was revoked by "
                "`llmgw node remove`; add the node again with `llmgw node add USER@HOST --reissue` to issue a new one"
            )
        return None

    async def _refusal(self, request: trio_websocket.WebSocketRequest, cert: CertInfo) -> tuple[int, str] | None:
        if request.path != AGENT_PATH:
            return 404, f"no agent endpoint at {request.path!r}; agents connect to {AGENT_PATH}"
        revoked = await self._revocation_refusal(cert)
        if revoked is not None:
            return revoked
        claimed = dict(request.headers).get(NODE_ID_HEADER.encode(), b"").decode("utf-8", "replace")
        if claimed != cert.common_name:
            return 403, (
                f"node id {claimed!r} does not match its certificate CN {cert.common_name!r}; set node_id in "
                "agent.toml to the certificate's CN, or reissue the certificate with `llmgw node add USER@HOST --reissue`"
            )
        return None

    async def _run_link(self, ws: trio_websocket.WebSocketConnection, cert: CertInfo, address: str) -> None:
        node_id = cert.common_name
        try:
            with trio.fail_after(HELLO_TIMEOUT_S):
                hello = decode(await ws.get_message(), w.AgentMessage)
        except trio.TooSlowError:
            await _close_with(ws, w.LinkError(code=w.BAD_MESSAGE, message=f"no hello within {HELLO_TIMEOUT_S:g} s"))
            return
        except WireError as exc:
            log.warning("agent_refused", address=address, stage="hello", cn=node_id, reason=str(exc))
            await _close_with(ws, w.LinkError(code=exc.code, message=str(exc)))
            return
        if not isinstance(hello, w.Hello) or hello.node_id != node_id:
            what = f"hello for node {hello.node_id!r}" if isinstance(hello, w.Hello) else type(hello).__name__
            message = f"expected a hello from node {node_id!r} (its certificate's CN), got {what}"
            log.warning("agent_refused", address=address, stage="hello", cn=node_id, reason=message)
            code = w.NODE_ID_MISMATCH if isinstance(hello, w.Hello) else w.UNEXPECTED
            await _close_with(ws, w.LinkError(code=code, message=message))
            return

        known = self.registry.nodes.get(node_id)
        try:
            row = await self.store.saw_node(node_id, address)
            cordoned, draining = row.cordoned, row.draining
        except StoreError as exc:
            # Best effort: last_seen and the address are for the operator; the link does not need them.
            log.warning("node_not_recorded", node=node_id, address=address, reason=str(exc))
            cordoned, draining = (known.cordoned, known.draining) if known is not None else (False, False)
        self.registry.know(node_id, address=address, cordoned=cordoned, draining=draining)
        now = trio.current_time()
        not_after = cert.not_after.timestamp()
        conn_id = self.registry.connect(
            hello, address=address, cert_serial=cert.serial, cert_not_after=not_after, now=now
        )
        log.info(
            "agent_connected",
            node=node_id,
            address=address,
            agent_version=hello.agent_version,
            started_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(hello.started_at)),
        )
        with trio.CancelScope() as scope:
            old = self.links.get(node_id)
            link = Link(node_id=node_id, conn_id=conn_id, ws=ws, cancel_scope=scope)
            self.links[node_id] = link
            if old is not None:
                old.cancel_scope.cancel()  # a node has one link; the newest wins
            self.on_change()
            try:
                # A certificate is good until its notAfter, not until the link happens to close.
                with trio.move_on_at(trio.current_time() + (not_after - time.time())) as expiry:
                    await _send(
                        ws,
                        w.Welcome(
                            node_id=node_id, server_version=__version__, heartbeat_interval_s=self.heartbeat_interval_s
                        ),
                    )
                    await _send(ws, self.desired_state(node_id))
                    await self._receive_loop(link)
                if expiry.cancelled_caught:
                    message = (
                        f"the certificate of node {node_id!r} (serial {cert.serial:x}) expired at "
                        f"{cert.not_after:%Y-%m-%d %H:%M:%S} UTC; renew it with `llmgw node add USER@HOST --reissue`"
                    )
                    log.warning("agent_certificate_expired", node=node_id, serial=f"{cert.serial:x}")
                    await _close_with(ws, w.LinkError(code=w.CERT_EXPIRED, message=message))
            finally:
                self.registry.disconnect(node_id, conn_id)
                if self.links.get(node_id) is link:
                    del self.links[node_id]
                self.on_change()

    async def _receive_loop(self, link: Link) -> None:
        while True:
            try:
                with trio.move_on_after(self.silence_timeout_s or math.inf) as silence:
                    text = await link.ws.get_message()
                if silence.cancelled_caught:
                    reason = f"nothing received for {self.silence_timeout_s:g} s (heartbeats stopped); closing the link"
                    log.warning("agent_link_silent", node=link.node_id, after_s=self.silence_timeout_s)
                    await _close_with(link.ws, w.LinkError(code=w.SILENT, message=reason))
                    return
                message = decode(text, w.AgentMessage)
            except WireError as exc:
                log.warning("agent_bad_message", node=link.node_id, code=exc.code, reason=str(exc))
                await _close_with(link.ws, w.LinkError(code=exc.code, message=str(exc)))
                return
            if isinstance(message, w.Heartbeat):
                self.registry.heartbeat(link.node_id, link.conn_id, trio.current_time())
                self.on_change()
            elif isinstance(message, w.InventoryChanged):
                self.registry.inventory_changed(link.node_id, link.conn_id, message.inventory)
                self.on_change()
                await self.push_desired_state(link.node_id)  # e.g. a GPU appeared: vLLM is now wanted
            elif isinstance(message, w.LogsReply):
                waiter = self._log_waiters.get(message.request_id)
                if waiter is not None:
                    waiter.append(message)
                    self._log_event.set()
            elif isinstance(message, w.ReplicasChanged):
                if self.registry.replicas_changed(link.node_id, link.conn_id, message.replicas):
                    self.on_replicas(link.node_id, message.replicas)
                    self.on_change()
            elif isinstance(message, w.EnginesChanged):
                self.registry.engines_changed(link.node_id, link.conn_id, message.engines)
                log.info(
                    "node_engines",
                    node=link.node_id,
                    engines=[f"{e.name}={e.version}" + ("" if e.ok else " (failed)") for e in message.engines],
                )
                self.on_change()
            elif isinstance(message, w.LinkError):
                log.warning("agent_reported_error", node=link.node_id, code=message.code, reason=message.message)
                return
            else:
                reason = f"unexpected {type(message).__name__} after hello"
                await _close_with(link.ws, w.LinkError(code=w.UNEXPECTED, message=reason))
                return

    async def push_desired_state(self, node_id: str) -> None:
        link = self.links.get(node_id)
        if link is not None:
            try:
                await _send(link.ws, self.desired_state(node_id))
            except trio_websocket.ConnectionClosed:
                pass
            except trio.TooSlowError:
                # It does not read what we send: a link in name only. Its agent reconnects.
                log.warning("agent_link_not_reading", node=node_id, after_s=SEND_TIMEOUT_S)
                link.cancel_scope.cancel()

    async def request_logs(self, node_id: str, replica_id: str, lines: int, timeout_s: float = 10.0) -> w.LogsReply:
        """Ask a node's agent for the tail of a replica's log; the reply, or one saying why not."""
        self._next_request += 1
        rid = self._next_request
        link = self.links.get(node_id)
        if link is None:
            return w.LogsReply(request_id=rid, replica_id=replica_id, error=f"node {node_id} is not connected")
        box: list[w.LogsReply] = []
        self._log_waiters[rid] = box
        try:
            with trio.move_on_after(timeout_s):
                await _send(link.ws, w.LogsRequest(request_id=rid, replica_id=replica_id, lines=lines))
                while not box:
                    event = self._log_event
                    await event.wait()
                    if event is self._log_event:
                        self._log_event = trio.Event()
        except (trio_websocket.ConnectionClosed, trio.TooSlowError):
            pass  # the answer says it did not reply
        finally:
            self._log_waiters.pop(rid, None)
        return (
            box[0]
            if box
            else w.LogsReply(
                request_id=rid, replica_id=replica_id, error=f"node {node_id} did not answer within {timeout_s:g} s"
            )
        )

    async def close_node(self, node_id: str, code: str, message: str) -> bool:
        """End a node's open link, telling the agent why; False if it had none."""
        link = self.links.pop(node_id, None)
        if link is None:
            return False
        with trio.move_on_after(1):  # tell it why; a hung agent is not waited for
            await _close_with(link.ws, w.LinkError(code=code, message=message))
        link.cancel_scope.cancel()
        return True


async def _send(ws: trio_websocket.WebSocketConnection, message) -> None:
    """One message to the agent; `TooSlowError` if it is not taken within SEND_TIMEOUT_S."""
    with trio.fail_after(SEND_TIMEOUT_S):
        await ws.send_message(encode(message))


async def _close_with(ws: trio_websocket.WebSocketConnection, error: w.LinkError) -> None:
    """Tell the agent why, then close; bounded, since the agent may be the reason."""
    with trio.move_on_after(REFUSAL_SEND_S):
        try:
            await ws.send_message(encode(error))
            await ws.aclose(code=1008, reason=error.code)
        except (trio_websocket.ConnectionClosed, trio.BrokenResourceError, trio.ClosedResourceError):
            pass


def _peer_host(stream: trio.SSLStream) -> str:
    try:
        return stream.transport_stream.socket.getpeername()[0]
    except (OSError, AttributeError):
        return "?"
