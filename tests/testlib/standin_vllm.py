"""A stand-in for the `vllm` command where vLLM cannot run (no GPU here): what llmgw asks of an
operator's vLLM, what the agent starts and the gateway serves through, and vLLM's sleep mode.

- `vllm --version` prints the version llmgw pins (DEFAULT_VLLM_VERSION), as vLLM 0.32 prints
  its own: the agent's check of an operator's vllm (`vllm_bin`) runs it and takes its first line.
- `vllm serve --help=all` prints the recorded help of vLLM 0.32.0 (tests/fixtures/help/vllm.txt),
  which `llmgw ctl engine-check vllm` and an install's flag check read; another `--help` prints
  the recorded summary (vllm-summary.txt), as vLLM does. Both whatever VLLM_TARGET_DEVICE says:
  it stands in for a vLLM on a GPU node, which infers its device.
- `vllm serve MODEL --served-model-name NAME --host H --port P ...` serves HTTP/1.1 on H:P:
  `GET /health` (503 for $STANDIN_LOAD_S after the start, as an engine loading its weights;
  200 after, asleep too), `GET /v1/models`, `POST /v1/chat/completions` and `/v1/completions`
  (the key in $VLLM_API_KEY or --api-key guards /v1 as vLLM's does; the answer is the words of
  a fixed reply, max_tokens of them, default 8, streamed as SSE chunks when asked, one each
  $STANDIN_TOKEN_MS ms). With --enable-sleep-mode and VLLM_SERVER_DEV_MODE=1 (else 404, as in
  vLLM): `POST /sleep?level=N` ($STANDIN_SLEEP_S, default 0.05 s), `POST /wake_up`
  ($STANDIN_WAKE_S, default 0.2 s), `GET /is_sleeping`; completions answer 503 unless awake.
  $STANDIN_FAIL=/sleep or /wake_up: that route answers 500 and changes nothing. A chat with
  `continue_final_message` (and `add_generation_prompt: false`, else 400 as vLLM) goes on from its
  final assistant message: the reply from that many words on.
  `--headless` (a worker rank) serves nothing, as vLLM's.
- Given `--kv-events-config`, it publishes KV-cache events as vLLM does (`testlib.kvpublisher`'s
  encoding; a real libzmq PUB socket bound where the config says): a block stored every 0.1 s,
  numbered from 0.
- $STANDIN_ARGS_FILE: its arguments, as JSON, written there. $STANDIN_EVENTS_FILE: one JSON line
  appended per event ({"event": "start"|"sleep"|"wake"|"request", "t", "pid", "level", and for a
  request its "path" and "status"}); a sleep or wake is one only when the state changed.
- SIGTERM ends it at once.

Run as `python -m testlib.standin_vllm ...`, or as an executable `write_executable` makes.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from llmgw.config import DEFAULT_VLLM_VERSION

HELP_DIR = Path(os.path.abspath(__file__)).parent.parent / "fixtures" / "help"
REPLY = "the stand-in engine answers with these words one token at a time until told to stop".split()
DEFAULT_MAX_TOKENS = 8

AWAKE, FALLING_ASLEEP, ASLEEP, WAKING = "awake", "falling asleep", "asleep", "waking"


def write_executable(path: Path) -> Path:
    """An executable shell script at `path` that runs this stand-in with this interpreter, for a
    node's agent.toml `vllm_bin`. Its PYTHONPATH is set, not inherited: testlib's and llmgw's
    directories first, then this process's path (where zmq and llmgw's requirements are, a
    Pants sandbox's too), so it runs alike whoever starts it."""
    import llmgw
    import testlib

    dirs = [os.path.abspath(Path(m.__file__).parent.parent) for m in (testlib, llmgw)]
    dirs += [os.path.abspath(p) for p in sys.path if p and os.path.abspath(p) not in dirs]
    path.write_text(
        "#!/bin/sh\n"
        "# A stand-in for vLLM's `vllm` (tests/testlib/standin_vllm.py), written by write_executable.\n"
        f"PYTHONPATH={shlex.quote(os.pathsep.join(dirs))}\n"
        "export PYTHONPATH\n"
        f'exec {shlex.quote(sys.executable)} -m testlib.standin_vllm "$@"\n'
    )
    path.chmod(0o755)
    return path


class Events:
    """Appends one JSON line per event to a file, if given one (a test reads what happened, when)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.lock = threading.Lock()

    def record(self, event: str, *, level: int | None = None, **extra: Any) -> None:
        if not self.path:
            return
        line = json.dumps({"event": event, "t": time.time(), "pid": os.getpid(), "level": level, **extra})
        with self.lock, open(self.path, "a") as f:
            f.write(line + "\n")


class Engine:
    """The engine's state: loading until `load_s` after its start, then awake, asleep or between.

    One sleep or wake at a time (`transition`); each takes its time, then changes the state.
    is_sleeping is true from the end of a sleep to the end of the wake; completions are served
    only when awake (an in-flight stream runs to its end)."""

    def __init__(
        self,
        *,
        names: list[str],
        api_key: str,
        sleep_mode: bool,
        load_s: float,
        sleep_s: float,
        wake_s: float,
        token_s: float,
        events: Events,
    ) -> None:
        self.names = names
        self.api_key = api_key
        self.sleep_mode = sleep_mode
        self.load_s, self.sleep_s, self.wake_s, self.token_s = load_s, sleep_s, wake_s, token_s
        self.events = events
        self.started = time.monotonic()
        self.state = AWAKE
        self.transition = threading.Lock()

    def loading(self) -> bool:
        return time.monotonic() - self.started < self.load_s

    def is_sleeping(self) -> bool:
        return self.state in (ASLEEP, WAKING)

    def sleep(self, level: int) -> None:
        with self.transition:
            if self.state == ASLEEP:
                return
            self.state = FALLING_ASLEEP
            time.sleep(self.sleep_s)  # the engine's work of offloading its weights
            self.state = ASLEEP
            self.events.record("sleep", level=level)

    def wake(self) -> None:
        with self.transition:
            if self.state == AWAKE:
                return
            self.state = WAKING
            time.sleep(self.wake_s)  # the engine's work of reloading its weights
            self.state = AWAKE
            self.events.record("wake")


def error_body(status: int, message: str, kind: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def words(n: int, start: int = 0) -> list[str]:
    return [REPLY[(start + i) % len(REPLY)] for i in range(n)]


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    engine: Engine  # set on the subclass `main` makes
    completion: str | None = None  # the path of the completion being answered
    continued = 0  # the words of a final assistant message continued (continue_final_message)

    def log_message(self, *args: Any) -> None:
        pass

    def send_json(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def send_empty(self, status: int) -> None:
        self.send_response(status)
        self.send_header("content-length", "0")
        self.end_headers()

    def read_body(self) -> bytes:
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            parts = []
            while size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16):
                parts.append(self.rfile.read(size))
                self.rfile.readline()
            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                pass  # trailers
            return b"".join(parts)
        return self.rfile.read(int(self.headers.get("content-length") or 0))

    def do_GET(self) -> None:  # - http.server's name
        engine, path = self.engine, urlsplit(self.path).path
        if path == "/health":
            self.send_empty(503 if engine.loading() else 200)
        elif path == "/version":
            self.send_json(200, {"version": DEFAULT_VLLM_VERSION})
        elif path == "/is_sleeping" and engine.sleep_mode:
            self.send_json(200, {"is_sleeping": engine.is_sleeping()})
        elif path == "/v1/models":
            if self.authorized():
                created = int(time.time())
                models = [{"id": n, "object": "model", "created": created, "owned_by": "vllm"} for n in engine.names]
                self.send_json(200, {"object": "list", "data": models})
        else:
            self.send_json(404, {"detail": "Not Found"})

    def do_POST(self) -> None:  # - http.server's name
        engine, url = self.engine, urlsplit(self.path)
        body = self.read_body()
        if url.path in ("/v1/chat/completions", "/v1/completions"):
            self.complete(url.path, body)
        elif url.path in ("/sleep", "/wake_up") and engine.sleep_mode and os.environ.get("STANDIN_FAIL") == url.path:
            # An engine whose sleep mode breaks (out of host memory, say): 500, its state as it was.
            self.send_json(500, error_body(500, f"{url.path} failed (STANDIN_FAIL)", "InternalServerError"))
        elif url.path == "/sleep" and engine.sleep_mode:
            try:
                level = int(parse_qs(url.query).get("level", ["1"])[0])
            except ValueError:
                level = 0
            if level not in (1, 2):
                self.send_json(400, error_body(400, f"sleep level must be 1 or 2, got {url.query}", "BadRequestError"))
                return
            engine.sleep(level)
            self.send_empty(200)
        elif url.path == "/wake_up" and engine.sleep_mode:
            engine.wake()
            self.send_empty(200)
        else:
            self.send_json(404, {"detail": "Not Found"})

    def authorized(self) -> bool:
        key = self.engine.api_key
        if key and self.headers.get("authorization", "") != f"Bearer {key}":
            self.send_json(401, error_body(401, "Unauthorized", "AuthenticationError"))
            return False
        return True

    def send_response(self, code: int, message: str | None = None) -> None:
        # A completion's event is on file before its answer goes out: a test that has the answer
        # finds the event.
        if self.completion is not None:
            self.engine.events.record("request", path=self.completion, status=code, continued=self.continued)
            self.completion = None
        super().send_response(code, message)

    def complete(self, path: str, raw: bytes) -> None:
        self.completion = path
        self.continued = 0
        try:
            self.answer(path, raw)
        finally:
            self.completion = None  # the next request on this connection is its own

    def answer(self, path: str, raw: bytes) -> None:
        engine = self.engine
        if not self.authorized():
            return
        if engine.loading():
            self.send_json(503, error_body(503, "the model is still loading", "ServiceUnavailableError"))
            return
        if engine.state != AWAKE:
            why = f"the model is sleeping ({engine.state}); wake it with POST /wake_up"
            self.send_json(503, error_body(503, why, "ServiceUnavailableError"))
            return
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError(f"the body must be a JSON object, got {type(body).__name__}")
            n = int(body.get("max_completion_tokens") or body.get("max_tokens") or DEFAULT_MAX_TOKENS)
            if n < 1:
                raise ValueError(f"max_tokens must be at least 1, got {n}")
        except (ValueError, TypeError) as exc:
            self.send_json(400, error_body(400, f"bad request body: {exc}", "BadRequestError"))
            return
        model = body.get("model") or engine.names[0]
        if model not in engine.names:
            self.send_json(404, error_body(404, f"The model `{model}` does not exist.", "NotFoundError"))
            return
        chat = path == "/v1/chat/completions"
        prompt = body.get("messages") if chat else body.get("prompt")
        # vLLM's continue_final_message: the final (assistant) message is the start of the answer,
        # which goes on from there (the stand-in's reply from that many words on).
        start = 0
        if chat and body.get("continue_final_message"):
            if body.get("add_generation_prompt", True):
                why = "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
                self.send_json(400, error_body(400, why, "BadRequestError"))
                return
            last = prompt[-1] if isinstance(prompt, list) and prompt and isinstance(prompt[-1], dict) else {}
            start = len(str(last.get("content") or "").split()) if last.get("role") == "assistant" else 0
        self.continued = start
        usage = {"prompt_tokens": len(json.dumps(prompt).split()), "completion_tokens": n}
        usage["total_tokens"] = usage["prompt_tokens"] + n
        reply = words(n, start)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        if body.get("stream"):
            options = body.get("stream_options") or {}
            self.stream(chat, rid, created, model, reply, usage if options.get("include_usage") else None, start)
            return
        time.sleep(max(0, n - 1) * engine.token_s)  # the time of its tokens, as a streamed one takes
        text = (" " if start else "") + " ".join(reply)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}
        obj = "chat.completion" if chat else "text_completion"
        self.send_json(
            200,
            {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice], "usage": usage},
        )

    def stream(
        self, chat: bool, rid: str, created: int, model: str, reply: list[str], usage: dict | None, start: int = 0
    ) -> None:
        """SSE events in chunked transfer encoding: a chunk per token (the last with the finish
        reason), the usage if asked, then [DONE]."""
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        obj = "chat.completion.chunk" if chat else "text_completion"
        try:
            for i, word in enumerate(reply):
                if i:
                    time.sleep(self.engine.token_s)
                piece = word if i == 0 and not start else f" {word}"
                finish = "length" if i == len(reply) - 1 else None
                if chat:
                    delta = {"role": "assistant", "content": piece} if i == 0 else {"content": piece}
                    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
                else:
                    choice = {"index": 0, "text": piece, "logprobs": None, "finish_reason": finish}
                self.send_chunk({"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]})
            if usage is not None:
                self.send_chunk(
                    {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage}
                )
            self.send_chunk(None)
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client went away: so does its answer

    def send_chunk(self, obj: dict | None) -> None:
        event = b"data: " + (json.dumps(obj).encode() if obj is not None else b"[DONE]") + b"\n\n"
        self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
        self.wfile.flush()


def print_help(argv: list[str]) -> int:
    whole = "--help=all" in argv
    sys.stdout.write((HELP_DIR / ("vllm.txt" if whole else "vllm-summary.txt")).read_text())
    return 0


def env_seconds(name: str, default: float) -> float:
    value = os.environ.get(name, "")
    return float(value) if value else default


def main(argv: list[str]) -> int:
    if argv[:1] in (["--version"], ["-v"]):
        print(DEFAULT_VLLM_VERSION)
        return 0
    if argv[:1] == ["serve"] and any(a == "-h" or a.startswith("--help") for a in argv):
        return print_help(argv)
    parser = argparse.ArgumentParser(prog="vllm")
    parser.add_argument("command", choices=["serve"])
    parser.add_argument("model")
    parser.add_argument("--served-model-name", nargs="+", default=None)
    parser.add_argument("--host", default="")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default="")
    parser.add_argument("--headless", action="store_true")
    parser.add_argument("--enable-sleep-mode", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument("--kv-events-config", default="")
    args, _ = parser.parse_known_args(argv)
    if os.environ.get("STANDIN_ARGS_FILE"):
        with open(os.environ["STANDIN_ARGS_FILE"], "w") as f:
            json.dump(argv, f)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    events = Events(os.environ.get("STANDIN_EVENTS_FILE", ""))
    # Bound before the API answers, as vLLM's engine binds it before its server starts: whoever
    # sees /health answer may subscribe at once.
    publisher = Publisher(json.loads(args.kv_events_config)) if args.kv_events_config else None
    if not args.headless:  # a worker rank serves no API, as vLLM's
        engine = Engine(
            names=args.served_model_name or [args.model],
            api_key=args.api_key or os.environ.get("VLLM_API_KEY", ""),
            # vLLM's dev routes: VLLM_SERVER_DEV_MODE is read as an integer.
            sleep_mode=args.enable_sleep_mode and bool(int(os.environ.get("VLLM_SERVER_DEV_MODE") or "0")),
            load_s=env_seconds("STANDIN_LOAD_S", 0.0),
            sleep_s=env_seconds("STANDIN_SLEEP_S", 0.05),
            wake_s=env_seconds("STANDIN_WAKE_S", 0.2),
            token_s=env_seconds("STANDIN_TOKEN_MS", 0.0) / 1000,
            events=events,
        )
        handler = type("EngineHandler", (Handler,), {"engine": engine})
        server = ThreadingHTTPServer((args.host, args.port), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        print(f"standin_vllm serving on {args.host}:{args.port}", flush=True)
    events.record("start")
    if publisher is not None:
        publisher.run()
    while True:
        signal.pause()  # until SIGTERM


class Publisher:
    """KV-cache events on a libzmq PUB socket, in vLLM's encoding (testlib.kvpublisher)."""

    def __init__(self, config: dict[str, Any]) -> None:
        import zmq

        assert config["publisher"] == "zmq" and config.get("enable_kv_cache_events") is True, config
        self.sock = zmq.Context().socket(zmq.PUB)
        endpoint = config["endpoint"]
        assert "*" in endpoint, f"vLLM binds only an endpoint with a wildcard host, got {endpoint}"
        self.sock.bind(endpoint)
        self.topic = config.get("topic", "").encode()
        print(f"standin_vllm publishing on {endpoint}", flush=True)

    def run(self) -> None:
        from testlib import kvpublisher as vp

        seq = 0
        while True:
            payload = vp.encode([vp.stored([seq * 2 + 1], parent=seq * 2 - 1 if seq else None)])
            self.sock.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
            seq += 1
            time.sleep(0.1)  # the publisher's pace: a batch each 0.1 s, as an engine at work sends them


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
