"""The control plane as a mirror: engine archives served to agents over the mTLS link's port.

An archive is available when a file in `STATE_DIR/artifacts/` has its sha256 — whatever the
file is called, so an operator can drop in a download by hand. Agents ask for
`GET /v1/artifacts/SHA256` on the agent endpoint (the same TLS port and client certificate as
the link) and may resume with `Range: bytes=N-`; anything else of HTTP is not offered here.
"""

from __future__ import annotations

import re
from pathlib import Path

import h11
import trio

from llmgw.download import sha256_of
from llmgw.log import get_logger

log = get_logger("llmgw.artifacts")

PREFIX = "/v1/artifacts/"
CHUNK = 1 << 20
SEND_TIMEOUT_S = 30.0
_SHA = re.compile(r"^[0-9a-f]{64}$")


def artifacts_dir(state_dir: Path) -> Path:
    return state_dir / "artifacts"


class Artifacts:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._hashes: dict[tuple[str, int, int], str] = {}  # (name, size, mtime_ns) -> sha256

    def _index(self) -> dict[str, Path]:
        found: dict[str, Path] = {}
        try:
            entries = list(self.directory.iterdir())
        except FileNotFoundError:
            return found
        for path in entries:
            if not path.is_file() or path.name.startswith("."):
                continue
            st = path.stat()
            key = (path.name, st.st_size, st.st_mtime_ns)
            digest = self._hashes.get(key)
            if digest is None:
                digest = path.name if _SHA.match(path.name) else sha256_of(path)
                self._hashes[key] = digest
            found[digest] = path
        return found

    def available(self) -> set[str]:
        return set(self._index())

    def path_for(self, sha256: str) -> Path | None:
        return self._index().get(sha256)


async def serve(
    stream: trio.abc.Stream,
    conn: h11.Connection,
    request: h11.Request,
    artifacts: Artifacts,
    node: str,
    *,
    send_timeout_s: float = SEND_TIMEOUT_S,
) -> None:
    """Answer one artifact request on an h11 connection whose request head has been read.
    Every write must drain within `send_timeout_s` (`TooSlowError` otherwise): an agent that
    stops reading does not hold the connection and the file open."""
    target = request.target.decode("latin-1")
    sha256 = target.removeprefix(PREFIX)
    ok = _SHA.match(sha256) and request.method == b"GET"
    # Listing the directory (and hashing a file dropped in by hand) is disk work: off the loop.
    path = await trio.to_thread.run_sync(artifacts.path_for, sha256) if ok else None

    async def send(data: bytes) -> None:
        with trio.fail_after(send_timeout_s):
            await stream.send_all(data)

    if path is None:
        await _send(send, conn, 404, b"no such artifact on this control plane\n")
        return
    size = path.stat().st_size
    start = 0
    headers = dict((k.lower(), v) for k, v in request.headers)
    wanted = headers.get(b"range", b"").decode("latin-1")
    m = re.fullmatch(r"bytes=(\d+)-", wanted)
    if m:
        start = int(m.group(1))
        if start >= size:
            await _send(send, conn, 416, b"", [(b"content-range", f"bytes */{size}".encode())])
            return
    status = 206 if start else 200
    extra = [(b"content-range", f"bytes {start}-{size - 1}/{size}".encode())] if start else []
    log.info("artifact_served", node=node, sha256=sha256, offset=start, size=size)
    response = h11.Response(status_code=status, headers=[(b"content-length", str(size - start).encode()), *extra])
    await send(conn.send(response))
    with path.open("rb") as f:
        f.seek(start)
        while True:
            block = await trio.to_thread.run_sync(f.read, CHUNK)
            if not block:
                break
            await send(conn.send(h11.Data(data=block)))
    await send(conn.send(h11.EndOfMessage()))


async def _send(send, conn: h11.Connection, status: int, body: bytes, headers=()) -> None:
    data = conn.send(h11.Response(status_code=status, headers=[(b"content-length", str(len(body)).encode()), *headers]))
    await send(data + (conn.send(h11.Data(data=body)) if body else b"") + conn.send(h11.EndOfMessage()))


class ReplayStream(trio.abc.Stream):
    """A stream whose first bytes were already read (to route the request): replays them."""

    def __init__(self, inner: trio.abc.Stream, prefix: bytes) -> None:
        self.inner = inner
        self._prefix = prefix

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if self._prefix:
            n = len(self._prefix) if max_bytes is None else max_bytes
            data, self._prefix = self._prefix[:n], self._prefix[n:]
            return data
        return await self.inner.receive_some(max_bytes)

    async def send_all(self, data) -> None:
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def aclose(self) -> None:
        await self.inner.aclose()


async def read_request_head(
    stream: trio.abc.Stream, max_bytes: int = 16384
) -> tuple[bytes, h11.Connection, h11.Request | None]:
    """Read until one HTTP request head has arrived; returns the raw bytes read, the h11
    connection holding it, and the request (None if the peer closed or sent no HTTP)."""
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=max_bytes)
    raw = bytearray()
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError:
            return bytes(raw), conn, None
        if isinstance(event, h11.Request):
            return bytes(raw), conn, event
        if event is not h11.NEED_DATA:
            return bytes(raw), conn, None
        data = await stream.receive_some(65536)
        if not data:
            return bytes(raw), conn, None
        raw += data
        conn.receive_data(data)
