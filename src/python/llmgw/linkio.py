"""The trio half of the links that both ends share (the agent link and the gateway link): a
link's one writer, and the stream under its WebSocket, which the link runtimes of both ends use
(`llmgw.server.links.linkserver` on the control plane, `llmgw.linkclient` on an agent or a gateway).
The protocols are `llmgw.wire.agent_session`'s and `llmgw.wire.gateway_session`'s; this module
only moves their frames.

`Writer` is the only task that writes a link's frames. Every sender queues its message in the
session (which coalesces and bounds what waits, `llmgw.wire.outbox`) and rings `wake`; `serve`
takes the frames in order and writes each within `send_timeout_s`. A peer that takes nothing
for that long is cut (`trio.TooSlowError` out of `serve`) and its senders never wait on it:
only a bounded kind waits, for room (`wait_room`). trio-websocket would serialise several
writers itself, but then the order of frames, and who waits on a slow peer, would be an
accident of scheduling.

`Replies` holds the callers waiting for the replies to their requests (the control plane's
LogsRequests), until the reply comes, their deadline passes or the link ends.

`Target` is where a link dials, and `Targets` every control plane it may dial, in turn, when
several share one store: a standby answers with where the leader is, which is dialled next.

`LinkStream` is the TLS stream as each side hands it to trio-websocket:
- the control plane has read the upgrade request's head already (to route and check it), and
  trio-websocket reads it again from `prefix`: it has no public way to start from a parsed
  request, and its internals are not ours to call;
- the agent needs its first failure (`on_failure`, `failure`). In TLS 1.3 the control plane
  judges the node's certificate after the client's side of the handshake is done, so a refusal
  arrives as an alert on the first read, inside trio-websocket's reader task, which does not
  wake the upgrade waiting for its response (trio-websocket issue 199): the agent would hang
  until its timeout. The agent cancels that wait when told, and keeps the error for the reason.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

import attrs
import trio
import trio_websocket

from llmgw.errors import UsageError
from llmgw.wire.session import Decoded, LinkSession

CLOSE_TIMEOUT_S = 1.0  # the WebSocket's closing handshake after a LinkError: the peer may be why
POLICY_VIOLATION = 1008  # RFC 6455 §7.4.1: the close code after a LinkError
# A frame at least this long is decoded off the event loop (`readable`): a gateway's heartbeat with
# a series per replica, a rotation of thousands of replicas (tens of ms to read at 5,000).
OFF_LOOP_BYTES = 64 * 1024


async def readable(session: Any, frame: str | bytes) -> str | bytes | Decoded:
    """`frame` as `session.receive` takes it: a long one decoded in a thread, so that the event
    loop goes on meanwhile (CPython hands it the interpreter every few ms), a short one as it is."""
    if len(frame) < OFF_LOOP_BYTES:
        return frame
    return await trio.to_thread.run_sync(session.decode, frame)


class Writer:
    """The one writer of a link: senders queue in `session` and `wake` it."""

    def __init__(self, session: LinkSession, *, send_timeout_s: float) -> None:
        self.session = session
        self.send_timeout_s = send_timeout_s
        self.finished = trio.Event()  # `serve` returned
        self._work = trio.lowlevel.ParkingLot()  # the writer, when nothing waits
        self._room = trio.lowlevel.ParkingLot()  # senders of a bounded kind, when it is full

    def wake(self) -> None:
        """Something was queued, or the session closed: the writer looks again."""
        self._work.unpark_all()

    def send(self, message: Any) -> bool:
        """Queue `message` if the session may send it now; False if not (a link not yet open,
        or closed: both sides resend everything when the next one opens)."""
        if not self.session.can_send(type(message)):
            return False
        self.session.send(message)
        self.wake()
        return True

    async def wait_room(self, kind: type) -> None:
        """Return once a message of `kind` fits in the outbox (a frame written makes room)."""
        while not self.session.outbox.room(kind):
            await self._room.park()

    async def close(
        self, code: str, message: str, *, timeout_s: float, ws: trio_websocket.WebSocketConnection | None = None
    ) -> None:
        """End the link with a LinkError (dropping what is unsent), and wait at most
        `timeout_s` for `serve` to write it and close the WebSocket; given `ws`, `serve` is not
        running yet (a refused hello) and runs here for that."""
        self.session.close(code, message)
        self.wake()
        self._room.unpark_all()
        with trio.move_on_after(timeout_s):
            await (self.serve(ws) if ws is not None else self.finished.wait())

    async def serve(
        self,
        ws: trio_websocket.WebSocketConnection,
        *,
        on_first: Callable[[], None] = lambda: None,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Write what the session queues until it is done: its LinkError written, then the
        WebSocket closed. Started (and `on_first` called, before the next frame is made) once
        the first frame, the hello or the welcome, is written; `trio.TooSlowError` if a frame
        is not taken within `send_timeout_s`."""
        started = False
        try:
            while True:
                frame = self.session.next_frame()
                if frame is None:
                    if self.session.done:
                        break
                    await self._work.park()
                    continue
                self._room.unpark_all()
                with trio.fail_after(self.send_timeout_s):
                    await ws.send_message(frame)
                if not started:
                    started = True
                    on_first()
                    task_status.started()
            if self.session.goodbye is not None:
                with trio.move_on_after(CLOSE_TIMEOUT_S):
                    await ws.aclose(code=POLICY_VIOLATION, reason=self.session.goodbye.code)
        finally:
            self.finished.set()
        if not started:
            task_status.started()  # closed before a frame: nothing to wait for


class _Waiting:
    def __init__(self) -> None:
        self.done = trio.Event()
        self.reply: Any = None


class Replies:
    """The callers waiting on one link for the replies to their requests, by request id (which
    reply answers which request is the session's to check: `give` only hands it over)."""

    def __init__(self) -> None:
        self.ended = False  # the link ended: no reply will come
        self._waiting: dict[int, _Waiting] = {}

    def give(self, request_id: int, reply: Any) -> None:
        waiting = self._waiting.get(request_id)
        if waiting is not None:  # else its caller gave up waiting
            waiting.reply = reply
            waiting.done.set()

    def end(self) -> None:
        self.ended = True
        for waiting in self._waiting.values():
            waiting.done.set()

    async def wait(self, request_id: int, timeout_s: float) -> Any:
        """The reply to `request_id`; None if none came within `timeout_s` or the link ended."""
        waiting = self._waiting[request_id] = _Waiting()
        try:
            with trio.move_on_after(timeout_s):
                await waiting.done.wait()
        finally:
            del self._waiting[request_id]
        return waiting.reply


class LinkStream(trio.abc.Stream):
    """`inner` with `prefix` given again first, and its first failure kept and told."""

    def __init__(
        self,
        inner: trio.abc.Stream,
        *,
        prefix: bytes = b"",
        on_failure: Callable[[], None] | None = None,
        eof: str = "the peer closed the connection",
    ) -> None:
        self.inner = inner
        self.eof = eof  # the failure's words when the peer closes instead
        self.failure: BaseException | None = None  # the first failure to read or write
        self.on_failure = on_failure  # called once, at that failure, while set
        self._prefix = prefix

    def _failed(self, exc: BaseException) -> None:
        if self.failure is None:
            self.failure = exc
            if self.on_failure is not None:
                self.on_failure()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if self._prefix:
            n = len(self._prefix) if max_bytes is None else max_bytes
            data, self._prefix = self._prefix[:n], self._prefix[n:]
            return data
        try:
            data = await self.inner.receive_some(max_bytes)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self._failed(exc)
            raise
        if not data:
            self._failed(trio.BrokenResourceError(self.eof))
        return data

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        try:
            await self.inner.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self._failed(exc)
            raise

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def aclose(self) -> None:
        await self.inner.aclose()


@attrs.frozen(kw_only=True)
class Target:
    """Where a link dials: the control plane's agent port (`wss://HOST:PORT`), for the agent's
    link and a gateway's alike."""

    host: str
    port: int

    @classmethod
    def parse(cls, url: str) -> Target:
        parts = urlsplit(url)
        if parts.scheme != "wss" or not parts.hostname:
            raise UsageError(f"control plane URL {url!r} must look like wss://HOST:PORT (its agent_listen)")
        return cls(host=parts.hostname, port=parts.port or 443)

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"wss://{self}"


class Targets:
    """The control planes a link dials (agent.toml's `server`, a gateway's `--server`s): each
    attempt takes the next in turn, round and round; the leader a standby named (`lead_to`) is
    dialled next, out of turn, once. `current` is the one dialled last."""

    def __init__(self, targets: Sequence[Target]) -> None:
        if not targets:
            raise UsageError("a link needs the address of at least one control plane")
        self.configured = tuple(targets)
        self.current = self.configured[0]
        self._turn = 0
        self._leader: Target | None = None

    @classmethod
    def parse(cls, urls: str | Sequence[str]) -> Targets:
        return cls([Target.parse(u) for u in ([urls] if isinstance(urls, str) else urls)])

    def next(self) -> Target:
        if self._leader is not None:
            self.current, self._leader = self._leader, None
        else:
            self.current = self.configured[self._turn % len(self.configured)]
            self._turn += 1
        return self.current

    def peek(self) -> Target:
        """The one `next` will give."""
        return self._leader or self.configured[self._turn % len(self.configured)]

    def lead_to(self, url: str) -> bool:
        """A standby said the leader is at `url`: dial it next. False if `url` is no control
        plane's address (a wss:// URL), and then nothing changes."""
        try:
            self._leader = Target.parse(url)
        except UsageError:
            return False
        return True

    def __str__(self) -> str:
        return ", ".join(str(t) for t in self.configured)
