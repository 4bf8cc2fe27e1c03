"""A Hugging Face Hub on loopback: the API calls and downloads llmgw makes of huggingface.co (or
a mirror of it), answered as the Hub answers them, from `HubRepo`s a test defines in code.

    with HubServer([HubRepo("org/model", files={...})]) as hub:
        fetch(f"{hub.url}/org/model/resolve/main/model.gguf")

Routes (GET and HEAD): /api/models (list_models), /api/models/{id}[/revision/{rev}] (model_info),
/api/models/{id}/tree/{rev}[/{path}] (list_repo_tree, paginated by a Link header as the Hub's),
/{id}/resolve/{rev}/{path} (a small file: 200 with its git blob sha1 as ETag; an LFS file: 302
to a signed URL on the CDN listener, with X-Linked-Etag and X-Linked-Size), and on the CDN
listener /cdn/lfs/{sha256}?...&signature= (the bytes; no Authorization needed, as the Hub's
signed CDN URLs). The CDN is a second port, so it is another origin, as cdn-lfs.hf.co is to
huggingface.co: clients drop Authorization on that redirect as they do for the real one.

Tokens: a token the server does not know at all (`users` plus every repo's) is refused with 401
"Invalid credentials in Authorization header", as the Hub refuses a malformed or revoked token
even for public repos. Faults and counters: `hub.faults`, `hub.log` (testlib.hubfaults); the
requests' handling: testlib.hubroutes; the repos: testlib.hubrepo (makers: testlib.hubrepos).

HTTP/1.1 keep-alive, every response with a Content-Length; a cut closes the connection. Each
connection is a thread of a stdlib ThreadingHTTPServer; `close` ends them all (stalls too).

Run alone (integration tests with real llmgw processes):
    python -m testlib.hubserver --spec FILE.json --port-file F   (testlib.hubspec)
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import secrets
import socket
import threading
import time
from collections.abc import Collection, Iterable
from http.server import ThreadingHTTPServer
from urllib.parse import urlencode

from testlib.hubfaults import Faults, HubLog
from testlib.hubrepo import Blob, HubError, HubRepo
from testlib.hubroutes import Handler

log = logging.getLogger(__name__)

INVALID_TOKEN = "Invalid credentials in Authorization header"


class HubServer:
    """The Hub on two loopback ports: `url` (API and resolve) and `cdn_url` (LFS bytes)."""

    def __init__(
        self,
        repos: Iterable[HubRepo] = (),
        *,
        users: Collection[str] = (),
        host: str = "127.0.0.1",
        port: int = 0,
        tree_page_size: int = 1000,
        url_ttl_s: int = 3600,
        cdn_refuses_authorization: bool = False,
    ) -> None:
        self.repos: dict[str, HubRepo] = {}
        for repo in repos:
            self.add(repo)
        self.users = set(users)  # tokens valid on the Hub that no repo grants
        self.tree_page_size = tree_page_size
        self.url_ttl_s = url_ttl_s
        # As an S3 presigned URL, which answers 400 to a request that also carries Authorization.
        self.cdn_refuses_authorization = cdn_refuses_authorization
        self.faults = Faults()
        self.log = HubLog()
        self.errors: list[str] = []  # the handler's own bugs, with tracebacks; close() raises them
        self.closing = False
        self._key = secrets.token_bytes(16)
        self._host, self._port = host, port
        self._listeners: list[Listener] = []
        self._threads: list[threading.Thread] = []

    def add(self, repo: HubRepo) -> HubRepo:
        if not repo.commits:
            raise ValueError(f"repo {repo.repo_id} has no commit: give it files")
        self.repos[repo.repo_id] = repo
        return repo

    @property
    def url(self) -> str:
        return self._base(0)

    @property
    def cdn_url(self) -> str:
        return self._base(1)

    def _base(self, i: int) -> str:
        if not self._listeners:
            raise RuntimeError("HubServer is not started: use `with HubServer(...) as hub` or start()")
        host, port = self._listeners[i].server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> HubServer:
        for role, port in (("hub", self._port), ("cdn", 0)):
            listener = Listener((self._host, port), Handler, hub=self, role=role)
            self._listeners.append(listener)
            # serve_forever looks for shutdown() between polls: a short poll makes close() quick.
            thread = threading.Thread(target=listener.serve_forever, args=(0.05,), name=f"hubserver-{role}")
            thread.start()
            self._threads.append(thread)
        return self

    def close(self) -> None:
        """Stops listening, ends every connection (a stalled body is cut) and joins the threads."""
        self.closing = True
        for listener in self._listeners:
            listener.shutdown()
        self.faults.release_all()
        for listener in self._listeners:
            listener.drop_connections()
            listener.server_close()
        for thread in self._threads:
            thread.join()
        if self.errors:
            raise AssertionError("hubserver's handler failed:\n" + "\n".join(self.errors))

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- what handlers ask

    def check_token(self, token: str | None) -> None:
        if token is not None and token not in self.users and not any(token in r.tokens for r in self.repos.values()):
            raise HubError(401, None, INVALID_TOKEN)

    def repo(self, repo_id: str, token: str | None) -> HubRepo:
        repo = self.repos.get(repo_id)
        if repo is None:
            # Unknown and private look the same: 401 to the anonymous, 404 to a user.
            raise HubError(404 if token else 401, "RepoNotFound", "Repository not found")
        return repo

    def cdn_location(self, repo_id: str, path: str, blob: Blob) -> str:
        expires = str(int(time.time()) + self.url_ttl_s)
        query = {"repo": repo_id, "path": path, "expires": expires}
        query["signature"] = self.sign(blob.sha256, query)
        return f"{self.cdn_url}/cdn/lfs/{blob.sha256}?{urlencode(query)}"

    def sign(self, sha256: str, query: dict[str, str]) -> str:
        message = "\n".join([sha256, query.get("repo", ""), query.get("path", ""), query.get("expires", "")])
        digest = hmac.new(self._key, message.encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).decode().rstrip("=")


class Listener(ThreadingHTTPServer):
    daemon_threads = False  # joined in server_close
    block_on_close = True

    def __init__(self, address: tuple[str, int], handler: type, *, hub: HubServer, role: str) -> None:
        self.hub = hub
        self.role = role
        self._open: set[socket.socket] = set()
        self._open_lock = threading.Lock()
        super().__init__(address, handler)

    def process_request(self, request, client_address) -> None:  # (socketserver's)
        with self._open_lock:
            self._open.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request) -> None:
        with self._open_lock:
            self._open.discard(request)
        super().shutdown_request(request)

    def drop_connections(self) -> None:
        """Wakes every handler thread waiting on its client (an idle keep-alive connection)."""
        with self._open_lock:
            for sock in self._open:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


if __name__ == "__main__":
    from testlib.hubspec import main

    raise SystemExit(main())
