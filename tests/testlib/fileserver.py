"""A file server on loopback for download tests: llmgw's own h11 server, with HTTP Range (which
a test can switch off), recording what each request asked for, and a gate that holds bodies
back so concurrent downloads overlap for sure."""

from __future__ import annotations

import trio

from llmgw.server.http import HTTPError, Request, Response, bound_address, serve_http


class Files:
    def __init__(self) -> None:
        self.content: dict[str, bytes] = {}
        self.gets: list[str] = []
        self.authorizations: list[str] = []
        self.ranges_seen: list[str] = []
        self.honour_range = True
        self.release = trio.Event()  # bodies are sent only once set
        self.release.set()

    async def handle(self, request: Request) -> Response:
        self.gets.append(request.path)
        self.authorizations.append(request.headers.get("authorization", ""))
        body = self.content.get(request.path)
        if body is None:
            raise HTTPError(404, "no such file")
        await self.release.wait()
        wanted = request.headers.get("range")
        if wanted:
            self.ranges_seen.append(wanted)
        if wanted and self.honour_range:
            start = int(wanted.removeprefix("bytes=").rstrip("-"))
            if start >= len(body):
                return Response(status=416)
            return Response(
                status=206,
                body=body[start:],
                headers=(("content-range", f"bytes {start}-{len(body) - 1}/{len(body)}"),),
            )
        return Response(status=200, body=body)


async def serve_files(nursery: trio.Nursery) -> tuple[Files, str]:
    """A running file server and its base URL."""
    files = Files()
    listeners = await nursery.start(serve_http, files.handle, "127.0.0.1", 0)
    host, port = bound_address(listeners)
    return files, f"http://{host}:{port}"
