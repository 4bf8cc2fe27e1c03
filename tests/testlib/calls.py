"""A client of a cluster's gateway in the integration tests: one OpenAI request on a connection of
its own (`post`), several at once in threads (`together`), a streamed answer's checks
(`streamed_whole`) and the gateway's /metrics text (`metrics_text`). Plain http.client: what a
client on the network sends."""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Callable
from typing import Any

CHAT = "/v1/chat/completions"


def post(
    port: int, token: str, body: dict[str, Any], *, path: str = CHAT, timeout: float = 90
) -> tuple[int, dict[str, str], bytes]:
    """(status, headers with lower-case names, body) of one request to the gateway on `port`."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(
            "POST",
            path,
            body=json.dumps(body),
            headers={"authorization": f"Bearer {token}", "content-type": "application/json"},
        )
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


def together(
    call: Callable[..., tuple[int, dict[str, str], bytes]], calls: list[dict[str, Any]], *, within_s: float = 120
) -> list[tuple[int, dict[str, str], bytes, float]]:
    """`call(**kwargs)` for each of `calls` in a thread of its own, all at once: (status, headers,
    body, seconds) each, in order; a connection error is status 0 with the error as the body."""
    out: list[Any] = [None] * len(calls)

    def one(i: int) -> None:
        started = time.monotonic()
        try:
            status, headers, body = call(**calls[i])
        except OSError as exc:
            status, headers, body = 0, {}, str(exc).encode()
        out[i] = (status, headers, body, time.monotonic() - started)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(within_s)
    assert all(o is not None for o in out), f"a request did not end within {within_s:g} s"
    return out


def streamed_whole(body: bytes, tokens: int) -> bool:
    """A streamed chat answer ended with [DONE] after `tokens` pieces of content."""
    events = [line[6:] for line in body.decode().splitlines() if line.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        return False
    pieces = [json.loads(e)["choices"][0]["delta"].get("content", "") for e in events[:-1] if json.loads(e)["choices"]]
    return sum(1 for p in pieces if p) == tokens


def metrics_text(port: int) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/metrics")
        return conn.getresponse().read().decode()
    finally:
        conn.close()
