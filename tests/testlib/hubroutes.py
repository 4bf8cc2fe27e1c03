"""The requests of testlib.hubserver, answered as the Hugging Face Hub answers them: the routing,
the API's JSON (from testlib.hubrepo), resolve and its redirect to the CDN, the CDN's bytes with
Range, and the faults armed on a file (testlib.hubfaults). One handler per connection thread;
what it shares (repos, faults, log) is the `HubServer`'s.
"""

from __future__ import annotations

import base64
import hmac
import json
import logging
import socket
import time
import traceback
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING
from urllib.parse import parse_qs, quote, unquote, urlencode, urlsplit

import attrs

from testlib.hubfaults import Fault, Served
from testlib.hubrepo import Blob, HubError, HubRepo

if TYPE_CHECKING:
    from testlib.hubserver import Listener

log = logging.getLogger(__name__)

CHUNK = 64 * 1024


@attrs.frozen
class _Reply:
    status: int
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""
    content_type: str = "application/json; charset=utf-8"


def _json(value: object, status: int = 200, headers: tuple[tuple[str, str], ...] = ()) -> _Reply:
    return _Reply(status, headers, json.dumps(value).encode())


def _error(e: HubError) -> _Reply:
    headers = (("X-Error-Message", e.message),) + ((("X-Error-Code", e.code),) if e.code else ())
    return _json({"error": e.message}, e.status, headers)


def _take_revision(segments: list[str]) -> tuple[str, list[str]]:
    """The revision at the head of a path, percent-encoded as clients send it ("refs%2Fpr%2F1")
    or not ("refs/pr/1"), and the segments after it."""
    if len(segments) >= 3 and segments[0] == "refs" and segments[1] in ("pr", "convert"):
        return "/".join(segments[:3]), segments[3:]
    return unquote(segments[0]), segments[1:]


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Listener
    timeout = 300  # an idle client's connection ends after this

    def log_message(self, format: str, *args: object) -> None:  # (the stdlib's name)
        log.debug("%s " + format, self.address_string(), *args)

    def do_GET(self) -> None:
        self._handle()

    def do_HEAD(self) -> None:
        self._handle()

    def do_POST(self) -> None:
        self._handle()

    def _handle(self) -> None:
        hub = self.server.hub
        served = hub.log.add(
            Served(
                self.command, "other", range=self.headers.get("Range"), authorization=self.headers.get("Authorization")
            )
        )
        try:
            body = self._read_body()
            reply = self._route(served, body)
            if reply is not None:
                self._send(served, reply)
        except HubError as e:
            self._send(served, _error(e))
        except (BrokenPipeError, ConnectionResetError):
            served.cut = True
            self.close_connection = True
        except Exception:
            hub.errors.append(f"{self.command} {self.path}:\n{traceback.format_exc()}")
            log.exception("hubserver: %s %s", self.command, self.path)
            self.close_connection = True
        finally:
            served.finished.set()

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            self.close_connection = True  # no framing to find the next request by
            return b""
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _send(self, served: Served, reply: _Reply) -> None:
        served.status = reply.status
        self.send_response(reply.status)
        for name, value in reply.headers:
            self.send_header(name, value)
        self.send_header("Content-Type", reply.content_type)
        self.send_header("Content-Length", str(len(reply.body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(reply.body)
            served.body_bytes += len(reply.body)

    def _token(self) -> str | None:
        scheme, _, token = self.headers.get("Authorization", "").partition(" ")
        return token.strip() if scheme.lower() == "bearer" and token.strip() else None

    def _route(self, served: Served, body: bytes) -> _Reply | None:
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        path = url.path
        if self.server.role == "cdn":
            if path.startswith("/cdn/lfs/") and self.command in ("GET", "HEAD"):
                return self._cdn(served, path.removeprefix("/cdn/lfs/"), query)
            return _json({"error": "Not Found"}, 404)
        if path.startswith("/_hubserver/"):
            from testlib.hubspec import admin  # the subprocess's remote control

            return _json(*admin(self.server.hub, self.command, path.removeprefix("/_hubserver/"), body))
        if self.command not in ("GET", "HEAD"):
            return _json({"error": f"{self.command} is not served here"}, 405)
        token = self._token()
        self.server.hub.check_token(token)
        if path.rstrip("/") == "/api/models":
            served.kind = "list"
            return self._list(query, token)
        if path.startswith("/api/models/"):
            return self._api(served, path.removeprefix("/api/models/").split("/"), query, token)
        segments = path.lstrip("/").split("/")
        if "resolve" in segments[1:3]:
            return self._resolve(served, segments, token)
        return _json({"error": "Sorry, we can't find the page you are looking for."}, 404)

    def _split_repo(self, segments: list[str], marks: tuple[str, ...]) -> tuple[str, list[str]]:
        """The repo id ("name" or "namespace/name") at the head of a path, and what follows."""
        two = "/".join(unquote(s) for s in segments[:2])
        if len(segments) >= 2 and (two in self.server.hub.repos or segments[1] not in marks):
            return two, segments[2:]
        return unquote(segments[0]), segments[1:]

    def _list(self, query: dict[str, list[str]], token: str | None) -> _Reply:
        search = (query.get("search") or [""])[0].lower()
        author = (query.get("author") or [None])[0]
        wanted_tags = query.get("filter", [])
        full = (query.get("full") or ["false"])[0].lower() in ("true", "1")
        limit = int((query.get("limit") or ["1000"])[0])
        found = []
        for repo in self.server.hub.repos.values():
            if repo.private and token not in repo.tokens:
                continue
            if search not in repo.repo_id.lower() or (author and repo.author != author):
                continue
            if not set(wanted_tags) <= {*repo.all_tags(repo.resolve("main")), repo.library_name}:
                continue
            found.append(repo.summary_json(full=full))
        return _json(found[:limit])

    def _api(self, served: Served, segments: list[str], query: dict[str, list[str]], token: str | None) -> _Reply:
        repo_id, rest = self._split_repo(segments, ("revision", "tree"))
        served.repo_id = repo_id
        repo = self.server.hub.repo(repo_id, token)
        repo.check_access(token, content=False)
        if not rest or rest == [""]:
            served.kind = "info"
            served.revision = "main"
        elif rest[0] == "revision" and len(rest) >= 2:
            served.kind = "info"
            served.revision = unquote("/".join(rest[1:]))
        elif rest[0] == "tree" and len(rest) >= 2:
            served.kind = "tree"
            served.revision, path_segments = _take_revision(rest[1:])
            served.path = unquote("/".join(path_segments))
            return self._tree(repo, served, query)
        else:
            return _json({"error": "Sorry, we can't find the page you are looking for."}, 404)
        blobs = (query.get("blobs") or ["false"])[0].lower() in ("true", "1")
        return _json(repo.info_json(repo.resolve(served.revision), blobs=blobs))

    def _tree(self, repo: HubRepo, served: Served, query: dict[str, list[str]]) -> _Reply:
        recursive = (query.get("recursive") or ["false"])[0].lower() in ("true", "1")
        entries = repo.tree_json(repo.resolve(served.revision or ""), served.path or "", recursive=recursive)
        cursor = (query.get("cursor") or [""])[0]
        start = int(base64.urlsafe_b64decode(cursor + "==").decode()) if cursor else 0
        end = start + self.server.hub.tree_page_size
        headers: tuple[tuple[str, str], ...] = ()
        if end < len(entries):
            # As the Hub: the next page's URL in a Link header (RFC 8288), with an opaque cursor.
            next_cursor = base64.urlsafe_b64encode(str(end).encode()).decode().rstrip("=")
            next_query = urlencode({"recursive": str(recursive).lower(), "cursor": next_cursor})
            headers = (("Link", f'<{self.server.hub.url}{urlsplit(self.path).path}?{next_query}>; rel="next"'),)
        return _json(entries[start:end], headers=headers)

    def _resolve(self, served: Served, segments: list[str], token: str | None) -> _Reply | None:
        served.kind = "resolve"
        repo_id, rest = self._split_repo(segments, ("resolve",))
        served.repo_id = repo_id
        if not rest or rest[0] != "resolve" or len(rest) < 3:
            return _json({"error": "Sorry, we can't find the page you are looking for."}, 404)
        served.revision, path_segments = _take_revision(rest[1:])
        served.path = unquote("/".join(path_segments))
        hub = self.server.hub
        repo = hub.repo(repo_id, token)
        repo.check_access(token, content=True)
        commit = repo.resolve(served.revision)
        blob = commit.files.get(served.path)
        if blob is None:
            raise HubError(404, "EntryNotFound", "Entry not found")
        if fault := hub.faults.take("fail", repo_id, served.path, blob.sha256, where="resolve"):
            return self._failed(fault)
        headers = (("X-Repo-Commit", commit.sha), ("Accept-Ranges", "bytes"))
        if not blob.lfs:
            self._send_file(served, repo_id, blob, headers + (("ETag", f'"{blob.oid}"'),))
            return None
        location = hub.cdn_location(repo_id, served.path, blob)
        headers += (
            ("ETag", f'"{blob.oid}"'),
            ("X-Linked-Etag", f'"{blob.sha256}"'),
            ("X-Linked-Size", str(blob.size)),
            ("Location", location),
        )
        return _Reply(302, headers, f"Found. Redirecting to {location}".encode(), "text/plain; charset=utf-8")

    def _cdn(self, served: Served, sha256: str, query: dict[str, list[str]]) -> _Reply | None:
        served.kind = "cdn"
        hub = self.server.hub
        fields = {k: v[0] for k, v in query.items()}
        served.repo_id, served.path = fields.get("repo"), fields.get("path")
        if not hmac.compare_digest(hub.sign(sha256, fields), fields.get("signature", "")):
            return _Reply(403, body=b"<Error><Code>AccessDenied</Code></Error>", content_type="application/xml")
        if int(fields.get("expires", "0")) < time.time():
            return _Reply(403, body=b"<Error><Code>AccessDenied</Code><Message>expired</Message></Error>")
        if hub.cdn_refuses_authorization and self.headers.get("Authorization"):
            message = b"<Error><Code>InvalidArgument</Code><Message>Only one auth mechanism allowed</Message></Error>"
            return _Reply(400, body=message, content_type="application/xml")
        repo = hub.repos.get(served.repo_id or "")
        blob = repo.blob_by_sha256(sha256) if repo else None
        if blob is None:
            return _Reply(404, body=b"<Error><Code>NoSuchKey</Code></Error>", content_type="application/xml")
        if fault := hub.faults.take("fail", served.repo_id or "", served.path or "", sha256, where="cdn"):
            return self._failed(fault)
        name = quote((served.path or "").rsplit("/", 1)[-1])
        headers = (
            ("ETag", f'"{sha256}"'),
            ("Accept-Ranges", "bytes"),
            ("Content-Disposition", f"attachment; filename*=UTF-8''{name}; filename=\"{name}\";"),
        )
        self._send_file(served, served.repo_id or "", blob, headers)
        return None

    def _failed(self, fault: Fault) -> _Reply:
        fault.reached.set()
        messages = {500: "Internal Error - We're working hard to fix this as soon as possible!"}
        return _json({"error": messages.get(fault.status, "Service Unavailable")}, fault.status)

    def _send_file(self, served: Served, repo_id: str, blob: Blob, headers: tuple[tuple[str, str], ...]) -> None:
        """The file, or the Range asked of it (RFC 9110 §14), with the faults armed on it."""
        faults = self.server.hub.faults
        path, size = served.path or "", blob.size
        wanted = self.headers.get("Range")
        if wanted and (fault := faults.take("refuse_range", repo_id, path, blob.sha256)):
            fault.reached.set()
            wanted = None
        span = _parse_range(wanted, size) if wanted else None
        if span == "unsatisfiable":
            self._send(served, _Reply(416, (("Content-Range", f"bytes */{size}"),), b"", "text/plain"))
            return
        start, end = span if isinstance(span, tuple) else (0, size - 1)
        status = 206 if isinstance(span, tuple) else 200
        if status == 206:
            headers += (("Content-Range", f"bytes {start}-{end}/{size}"),)
        data = blob.content[start : end + 1]
        content_type = "application/octet-stream" if blob.lfs else "text/plain; charset=utf-8"
        if self.command == "HEAD":
            served.status = status
            self.send_response(status)
            for name, value in (*headers, ("Content-Type", content_type), ("Content-Length", str(len(data)))):
                self.send_header(name, value)
            self.end_headers()
            return
        if fault := faults.take("corrupt", repo_id, path, blob.sha256, since=start, within=end + 1):
            changed = bytearray(data)
            changed[fault.after - start] ^= 0xFF
            data = bytes(changed)
            fault.reached.set()
        stall = faults.take("stall", repo_id, path, blob.sha256, within=len(data))
        cut = faults.take("cut", repo_id, path, blob.sha256, within=len(data))
        served.status = status
        self.send_response(status)
        for name, value in (*headers, ("Content-Type", content_type), ("Content-Length", str(len(data)))):
            self.send_header(name, value)
        self.end_headers()
        sent = 0
        if stall is not None:
            sent = self._write(served, data, sent, stall.after)
            stall.reached.set()
            stall.released.wait()
            if self.server.hub.closing:
                self._cut(served)
                return
        if cut is not None and cut.after >= sent:
            self._write(served, data, sent, cut.after)
            self._cut(served)
            cut.reached.set()
            return
        self._write(served, data, sent, len(data))

    def _write(self, served: Served, data: bytes, start: int, end: int) -> int:
        view = memoryview(data)
        while start < end:
            n = min(CHUNK, end - start)
            self.wfile.write(view[start : start + n])
            start += n
            served.body_bytes += n
        return start

    def _cut(self, served: Served) -> None:
        served.cut = True
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _parse_range(value: str, size: int) -> tuple[int, int] | str | None:
    """One byte range of `size` bytes as (first, last), "unsatisfiable", or None for a header
    this server ignores (another unit, several ranges, bad syntax: the whole file, as RFC 9110
    allows)."""
    unit, _, spec = value.partition("=")
    if unit.strip().lower() != "bytes" or "," in spec:
        return None
    first, dash, last = spec.strip().partition("-")
    if not dash:
        return None
    try:
        if not first:  # bytes=-N: the last N bytes
            n = int(last)
            return (max(size - n, 0), size - 1) if n > 0 and size > 0 else "unsatisfiable"
        start = int(first)
        end = min(int(last), size - 1) if last else size - 1
    except ValueError:
        return None
    if start < 0 or (last and int(last) < start):
        return None
    if start >= size:
        return "unsatisfiable"
    return start, end
