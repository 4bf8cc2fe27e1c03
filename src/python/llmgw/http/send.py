"""Writing responses on a connection (`llmgw.h1.server_role`), each write within `send_timeout_s` (a
client that stops reading is cut: `trio.TooSlowError`).

A whole `Response` goes out with its Content-Length; to a HEAD, its head alone (RFC 9110
§9.3.2). A `StreamingResponse` goes out chunk by chunk as it is produced, with
`transfer-encoding: chunked` unless it gives its `length` (RFC 9112 §6.3; an HTTP/1.0 client
gets a body delimited by closing the connection), while the connection is read
(`wait_for_disconnect`), so a client that goes away cancels the producer at once rather than at
its next chunk.

After an error answer that closes the connection, what the client still sends is read and
dropped for a moment (`linger`), so that closing does not reset the connection before the
client has read the answer (RFC 9112 §9.6, "tear-down"). A connection the listener has no room
for gets `busy_answer`, written before its request is read.
"""

from __future__ import annotations

from collections.abc import AsyncIterable

import trio

from llmgw.h1 import ServerConnection
from llmgw.http import fastio
from llmgw.http.errors import Abort, BodyAborted, peer_reason
from llmgw.http.limits import Limits
from llmgw.http.messages import Response, StreamingResponse
from llmgw.log import get_logger

log = get_logger("llmgw.http")

RECEIVE_SIZE = 65536
LINGER_S = 1.0
LINGER_BYTES = 256 * 1024
BUSY_SEND_S = 1.0
CHECKPOINT_CHUNKS = 16  # a streamed body yields to the loop at least once in this many chunks


async def send(stream, data: bytes, limits: Limits) -> None:
    """Write, or `TooSlowError` when the peer has not taken it within `send_timeout_s`. What
    the socket takes at once is written without a deadline or a trip through the scheduler
    (`fastio`); only the rest waits, under the deadline."""
    sent = fastio.send_now(stream, data)
    if sent == len(data):
        return
    with trio.fail_after(limits.send_timeout_s):
        await stream.send_all(memoryview(data)[sent:] if sent else data)


async def send_response(
    conn: ServerConnection, stream, response: Response, limits: Limits, close: bool = False, head: bool = False
) -> None:
    """Send a whole response; to a HEAD, its head alone, with the length the body would have."""
    data = conn.send_head(response.status, response.headers, length=len(response.body), close=close, head_only=head)
    if response.body and not head:
        data += conn.send_data(response.body)
    await send(stream, data + conn.send_end(), limits)


async def send_streaming(
    conn: ServerConnection,
    stream,
    response: StreamingResponse,
    limits: Limits,
    close: bool = False,
    head: bool = False,
) -> None:
    """Send a streamed response. The client going away, or the producer failing, ends the
    connection (`Abort` or the stream's error). To a HEAD: the head alone, the producer closed
    unstarted."""
    gone: list[bool] = []
    try:
        start = conn.send_head(response.status, response.headers, length=response.length, close=close, head_only=head)
        if head:
            await send(stream, start + conn.send_end(), limits)
            return
        # Inside the try: a client gone before the head still gets the producer closed.
        await send(stream, start, limits)
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                await wait_for_disconnect(conn, stream, limits)
                gone.append(True)
                nursery.cancel_scope.cancel()  # the client is gone: stop the producer now

            nursery.start_soon(watch)
            try:
                await send_body(conn, stream, response.body, limits)
            finally:
                nursery.cancel_scope.cancel()
        if gone:
            raise Abort("closed", message="the client closed the connection during a streamed response")
    finally:
        aclose = getattr(response.body, "aclose", None)
        if aclose is not None:
            with trio.move_on_after(1) as cleanup:
                cleanup.shield = True
                await aclose()


async def send_body(conn: ServerConnection, stream, body: AsyncIterable[bytes], limits: Limits) -> None:
    # The producer's failures and the client's are told apart: only the first is a bug to log,
    # and neither is answered (the head is out): the connection closes without the last chunk.
    chunks = aiter(body)
    sent = 0
    while True:
        if sent % CHECKPOINT_CHUNKS == CHECKPOINT_CHUNKS - 1:
            # A write the socket takes at once does not yield (`send`): a producer that never
            # waits either (an engine answering as fast as it can) must not hold the loop.
            await trio.lowlevel.checkpoint()
        sent += 1
        try:
            chunk = await anext(chunks)
        except StopAsyncIteration:
            break
        except BodyAborted as exc:
            raise Abort("body_aborted", message=str(exc)) from None  # said where it was raised
        except Exception:
            log.exception("http_stream_failed")
            raise Abort("producer_failed", message="the streamed body's producer failed") from None
        if not chunk:
            continue  # an empty chunk would end a chunked body (RFC 9112 §7.1)
        await send(stream, conn.send_data(chunk), limits)
    await send(stream, conn.send_end(), limits)


async def wait_for_disconnect(conn: ServerConnection, stream, limits: Limits) -> None:
    """Read the connection while a response is made; return when the client has closed it.
    Bytes that arrive meanwhile (a pipelined request) go to the parser's buffer for the next
    cycle; past one head's worth of them this stops reading and lets TCP push back (what is
    buffered here is outside the body budget, so it stays small)."""
    while conn.buffered < limits.max_head_bytes:
        try:
            data = await stream.receive_some(RECEIVE_SIZE)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return
        if not data:
            return
        conn.receive_data(data)
    await trio.sleep_forever()


async def answer_and_close(conn: ServerConnection, stream, limits: Limits, response: Response) -> None:
    """Answer an error on a connection about to close, if no response has begun; whatever
    the peer does meanwhile is ignored (it ends the connection either way)."""
    if conn.answer_begun:
        return  # the response has begun: cutting the connection is the only signal left
    try:
        await send_response(conn, stream, response, limits, close=True)
        await linger(stream)
    except Exception as exc:  # - the connection ends either way; nothing may escape it
        if peer_reason(exc) is None:
            log.exception("http_error_answer_failed", status=response.status)


async def linger(stream) -> None:
    """Half-close and read what is still coming for a moment, so the answer just sent is not
    destroyed by a reset when we close with unread data."""
    send_eof = getattr(stream, "send_eof", None)
    if send_eof is not None:
        await send_eof()
    read = 0
    with trio.move_on_after(LINGER_S):
        while read < LINGER_BYTES:
            data = await stream.receive_some(RECEIVE_SIZE)
            if not data:
                return
            read += len(data)


def busy_answer(response: Response) -> bytes:
    """`response` as the bytes of a whole answer that closes its connection, for a connection
    turned away before its request is read (a client reads this as the answer to the request
    it sends, RFC 9112 §9.6)."""
    conn = ServerConnection(max_head_bytes=0)
    return conn.send_head(response.status, response.headers, length=len(response.body), close=True) + response.body


async def answer_busy(answer: bytes, stream: trio.abc.Stream) -> None:
    """Turn away a connection the listener has no room for: `answer` (`busy_answer`), written
    within BUSY_SEND_S, then a half-close and a short linger so the client reads it rather than
    a reset. Never raises (but Cancelled); the caller closes the stream."""
    try:
        with trio.fail_after(BUSY_SEND_S):
            await stream.send_all(answer)
        await linger(stream)
    except Exception as exc:  # - a refusal's failure ends that connection only
        if peer_reason(exc) is None:
            log.exception("http_busy_answer_failed")
