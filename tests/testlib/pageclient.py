"""A browser's side of the cluster page's admin API, in the test's threads (http.client): its
session cookie, the page's Origin and CSRF token for a change, and the live feed
(/admin/v1/events) read event by event. Used by test_page and test_audit."""

from __future__ import annotations

import http.client
import json
from typing import Any
from urllib.parse import urlsplit

FEED_EVENTS = ("cluster", "changes")


class Browser:
    """What a browser sends: the cookie it was given, and for a change the page's Origin and the
    session's CSRF token (`session()` reads it, with the session's id)."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname, parts.port
        self.origin = f"http://{self.host}:{self.port}"
        self.cookie = ""
        self.csrf = ""
        self.id = ""

    def request(self, method: str, path: str, headers: dict[str, str] | None = None) -> tuple[int, dict, bytes]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=10)
        sent = {**(headers or {}), **({"cookie": self.cookie} if self.cookie else {})}
        try:
            conn.request(method, path, headers=sent)
            response = conn.getresponse()
            return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
        finally:
            conn.close()

    def login(self, login_path: str) -> tuple[int, dict, bytes]:
        """The login link followed: its cookie kept when it signs in (303)."""
        status, headers, body = self.request("GET", login_path)
        if status == 303:
            self.cookie = headers["set-cookie"].split(";")[0]
        return status, headers, body

    def sign_in(self, login_path: str) -> None:
        """`login`, which must succeed, then the session's CSRF token and id."""
        status, _, _ = self.login(login_path)
        assert status == 303, status
        status, _, body = self.request("GET", "/admin/v1/page/session")
        session = json.loads(body)
        self.csrf, self.id = session["csrf"], session["id"]

    def change(self, method: str, path: str) -> int:
        return self.request(method, path, {"origin": self.origin, "x-llmgw-csrf": self.csrf})[0]

    def json(self, method: str, path: str, **headers: str) -> tuple[int, Any]:
        status, _, body = self.request(method, path, headers)
        return status, json.loads(body)


class Feed:
    """The page's live feed on one connection: `open()` it, then `next()` each cluster or changes
    event (bounded by the socket's timeout); `close()` at the end."""

    def __init__(self, browser: Browser) -> None:
        self.conn = http.client.HTTPConnection(browser.host, browser.port, timeout=10)
        self.cookie = browser.cookie
        self.response: http.client.HTTPResponse | None = None

    def open(self) -> http.client.HTTPResponse:
        self.conn.request("GET", "/admin/v1/events", headers={"cookie": self.cookie})
        self.response = self.conn.getresponse()
        return self.response

    def next(self) -> tuple[str, dict[str, Any]]:
        assert self.response is not None
        event = None
        while True:  # bounded by the socket's timeout
            line = self.response.readline().decode()
            if line.startswith("event: "):
                event = line[7:].strip()
            elif line.startswith("data: ") and event in FEED_EVENTS:
                return event, json.loads(line[6:])

    def close(self) -> None:
        self.conn.close()
