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

The upstream is `rawupstream.py`, the load `rawload.py`; this module holds what both speak (the
canned answers, a request's framing, the chat request) and the command line, which imports the
end it runs when it runs it (each end imports this module).
"""

from __future__ import annotations

import argparse
import json
import re
import sys

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


# -- a chat request, as the load sends it ----------------------------------------------------


def chat_body(*, stream: bool) -> bytes:
    return json.dumps({**CHAT, "stream": True} if stream else CHAT).encode()


def chat_request(token: str, *, stream: bool = False) -> bytes:
    body = chat_body(stream=stream)
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
        f"authorization: Bearer {token}\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


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
        from bench.rawupstream import upstream

        return upstream(args.port, args.processes, args.events, args.event_gap_ms / 1000)
    if not 1 <= args.connections <= 4096 or not 0 < args.seconds <= 600 or args.max_requests < 1:
        parser.error("--connections must be 1..4096, --seconds 0..600 and --max-requests at least 1")
    if not 0 < args.drain_s <= MAX_DRAIN_S:
        parser.error(f"--drain-s must be 0..{MAX_DRAIN_S:g}")
    from bench.rawload import load

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
