"""The internet's side of the weights benchmark: one file served over HTTP with Range, counting
the bytes it sends (tools/bench/weights.py runs it in the "source" namespace).

    python -m bench.rangeserver FILE --port PORT --stats STATS.json

GET /NAME (the file's name) answers 200 with the whole file or 206 with `Range: bytes=A-B` /
`bytes=A-`; every other path is 404. The body goes out with sendfile(2). After each response
STATS.json holds {"requests": N, "bytes_sent": B}, rewritten atomically; it is first written
once the server listens.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

_RANGE = re.compile(r"bytes=(\d+)-(\d*)")


class Stats:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock = threading.Lock()
        self.requests = 0
        self.bytes_sent = 0

    def add(self, sent: int) -> None:
        with self.lock:
            self.requests += 1
            self.bytes_sent += sent
            self.write()

    def write(self) -> None:
        fresh = self.path.with_name(self.path.name + ".new")
        fresh.write_text(json.dumps({"requests": self.requests, "bytes_sent": self.bytes_sent}))
        os.replace(fresh, self.path)


def handler_for(path: Path, stats: Stats) -> type[BaseHTTPRequestHandler]:
    size = path.stat().st_size

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:  # - the stdlib's name
            if self.path != "/" + path.name:
                self.send_error(404)
                return
            start, end, status = 0, size - 1, 200
            m = _RANGE.fullmatch(self.headers.get("Range", "").strip())
            if m:
                start = int(m[1])
                end = min(int(m[2]), size - 1) if m[2] else size - 1
                if start > end:
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{size}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                status = 206
            self.send_response(status)
            self.send_header("Content-Length", str(end - start + 1))
            self.send_header("Accept-Ranges", "bytes")
            if status == 206:
                self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
            self.end_headers()
            sent = 0
            try:
                with path.open("rb") as f:
                    sent = self.connection.sendfile(f, start, end - start + 1)
            except OSError:
                self.close_connection = True
            finally:
                stats.add(sent)

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", type=Path)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--stats", type=Path, required=True)
    parser.add_argument("--host", default="0.0.0.0")
    args = parser.parse_args()
    stats = Stats(args.stats)
    server = ThreadingHTTPServer((args.host, args.port), handler_for(args.file, stats))
    stats.write()  # once it listens: the bench waits for this file
    server.daemon_threads = True
    server.serve_forever()


if __name__ == "__main__":
    main()
