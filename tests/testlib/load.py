"""A steady trickle of non-streamed requests through the gateway, in a thread, for tests that
break something underneath and then check that no request failed.

Bounded in count and in time (`max_requests`, `max_s`), one request each `interval_s` at most;
every answer is kept in `answers` as (sent at, status, seconds it took), status 0 for a request
that failed without one, so a test can say what happened in each phase. With `keep_alive`, the client reuses its connection and follows
the one rule every HTTP client follows: a request on a *reused* connection that fails before
any byte of an answer is sent once more on a fresh one (the server may close an idle
connection at any moment, RFC 9112 §9.3.1). Nothing else is retried.
"""

from __future__ import annotations

import http.client
import json
import threading
import time

import attrs

INTERVAL_S = 0.05
MAX_REQUESTS = 2000
MAX_S = 60.0
CLIENT_TIMEOUT_S = 30.0


def chat_body(model: str, max_tokens: int = 8) -> bytes:
    return json.dumps(
        {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}
    ).encode()


@attrs.define
class Load:
    port: int
    token: str
    model: str = "chat"
    keep_alive: bool = False
    host: str = "127.0.0.1"
    interval_s: float = INTERVAL_S
    max_requests: int = MAX_REQUESTS
    max_s: float = MAX_S
    ok: int = 0
    failures: list[str] = attrs.Factory(list)
    answers: list[tuple[float, int, float]] = attrs.Factory(list)
    slowest_s: float = 0.0
    stop: threading.Event = attrs.Factory(threading.Event)
    _conn: http.client.HTTPConnection | None = None
    _thread: threading.Thread | None = None

    def start(self) -> Load:
        self._thread = threading.Thread(target=self.run, daemon=True)
        self._thread.start()
        return self

    def finish(self) -> None:
        self.stop.set()
        if self._thread is not None:
            self._thread.join(CLIENT_TIMEOUT_S + 5)

    def run(self) -> None:
        deadline = time.monotonic() + self.max_s
        for _ in range(self.max_requests):
            if self.stop.is_set() or time.monotonic() > deadline:
                break
            started = time.monotonic()
            status = 0
            try:
                status, body = self._once()
            except (OSError, http.client.HTTPException) as exc:
                self.failures.append(repr(exc))
            else:
                if status == 200:
                    self.ok += 1
                else:
                    self.failures.append(f"HTTP {status}: {body[:200]!r}")
            took = time.monotonic() - started
            self.answers.append((started, status, took))
            self.slowest_s = max(self.slowest_s, took)
            self.stop.wait(self.interval_s)
        if self._conn is not None:
            self._conn.close()

    def _once(self) -> tuple[int, bytes]:
        reused = self._conn is not None
        if self._conn is None:
            self._conn = http.client.HTTPConnection(self.host, self.port, timeout=CLIENT_TIMEOUT_S)
        try:
            self._conn.request(
                "POST",
                "/v1/chat/completions",
                body=chat_body(self.model),
                headers={"authorization": f"Bearer {self.token}", "content-type": "application/json"},
            )
            response = self._conn.getresponse()
            body = response.read()
        except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
            self._conn.close()
            self._conn = None
            if reused:
                return self._once()  # closed while idle: nothing was answered, so try again
            raise
        except BaseException:
            self._conn.close()
            self._conn = None
            raise
        if not self.keep_alive or response.getheader("connection", "").lower() == "close":
            self._conn.close()
            self._conn = None
        return response.status, body
