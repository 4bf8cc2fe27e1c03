"""A stand-in for `vllm serve` where vLLM cannot run (no GPU here), for the agent's tests of KV-cache
events: it takes the command line llmgw gives vLLM, answers `GET /health` on --host/--port, and,
given `--kv-events-config`, publishes KV-cache events as vLLM does (`testlib.kvpublisher`'s
encoding; a real libzmq PUB socket bound where the config says) — a block stored every 0.1 s,
numbered from 0. It writes its arguments, as JSON, to $STANDIN_ARGS_FILE when set.

Run as `python -m testlib.standin_vllm serve MODEL ...`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import zmq

from testlib import kvpublisher as vp


class Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # - http.server's name
        code = 200 if self.path == "/health" else 404
        self.send_response(code)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="vllm")
    parser.add_argument("command")
    parser.add_argument("model")
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--kv-events-config", default="")
    args, _ = parser.parse_known_args(argv)
    if os.environ.get("STANDIN_ARGS_FILE"):
        with open(os.environ["STANDIN_ARGS_FILE"], "w") as f:
            json.dump(argv, f)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    server = ThreadingHTTPServer((args.host, args.port), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print(f"standin_vllm serving on {args.host}:{args.port}", flush=True)
    if not args.kv_events_config:
        while True:
            time.sleep(3600)
    config = json.loads(args.kv_events_config)
    assert config["publisher"] == "zmq" and config.get("enable_kv_cache_events") is True, config
    sock = zmq.Context().socket(zmq.PUB)
    endpoint = config["endpoint"]
    assert "*" in endpoint, f"vLLM binds only an endpoint with a wildcard host, got {endpoint}"
    sock.bind(endpoint)
    topic = config.get("topic", "").encode()
    print(f"standin_vllm publishing on {endpoint}", flush=True)
    seq = 0
    while True:
        payload = vp.encode([vp.stored([seq * 2 + 1], parent=seq * 2 - 1 if seq else None)])
        sock.send_multipart([topic, seq.to_bytes(8, "big"), payload])
        seq += 1
        time.sleep(0.1)  # the publisher's pace: a batch each 0.1 s, as an engine at work sends them


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
