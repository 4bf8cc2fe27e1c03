"""The real llama-server, started through llmgw's llama.cpp spec on a tiny model made here.

Needs the binary built by tools/llama/build-llama-server, which `./pants test` runs before the
tests (tools/testenv/prepare.py): from LLMGW_LLAMA_SERVER, or the build's cache. Without it these
tests fail rather than skip, so a machine that cannot build llama.cpp is noticed.
"""

from __future__ import annotations

import http.client
import json
import os
import secrets
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import pytest

from llmgw import cli
from llmgw.config import Secret
from llmgw.engines import ReplicaLaunch, build_command
from llmgw.engines.helptext import documented_flags
from testlib.llama import llama_server
from testlib.ports import free_port
from testlib.proc import build_root
from testlib.tinygguf import write_tiny_llama

READY_TIMEOUT_S = 60.0
REQUEST_TIMEOUT_S = 30.0
STRAY_KEY = "stray-key-in-the-agents-environment"


class Server:
    def __init__(self, launch: ReplicaLaunch, proc: subprocess.Popen, log: Path) -> None:
        self.launch, self.proc, self.log = launch, proc, log

    def request(self, method: str, path: str, body: dict | None = None, *, key: str | None = None):
        conn = http.client.HTTPConnection(self.launch.host, self.launch.port, timeout=REQUEST_TIMEOUT_S)
        headers = {"Content-Type": "application/json"}
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        conn.request(method, path, body=json.dumps(body) if body is not None else None, headers=headers)
        return conn, conn.getresponse()

    def call(self, method: str, path: str, body: dict | None = None, *, key: str | None = None) -> tuple[int, dict]:
        conn, resp = self.request(method, path, body, key=key)
        with closing(conn):
            return resp.status, json.loads(resp.read() or b"{}")

    def log_tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])


def wait_ready(server: Server) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            pytest.fail(f"llama-server exited with {server.proc.returncode}:\n{server.log_tail()}")
        try:
            if server.call("GET", "/health")[0] == 200:
                return
        except OSError:
            pass  # not listening yet
        time.sleep(0.05)  # a poll interval, bounded by the deadline
    pytest.fail(f"llama-server did not answer /health 200 within {READY_TIMEOUT_S:.0f} s:\n{server.log_tail()}")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    binary = llama_server()
    work = tmp_path_factory.mktemp("llama")
    model = write_tiny_llama(work / "tiny.gguf", seed=1)
    private = work / "keys"
    private.mkdir(mode=0o700)
    launch = ReplicaLaunch(
        engine="llamacpp",
        model_path=str(model),
        served_name="tiny",
        host="127.0.0.1",
        port=free_port(),
        api_key=Secret(secrets.token_urlsafe(24)),
        context=2048,
        extra_args=("--threads", "2", "--parallel", "2"),
        private_dir=str(private),
    )
    cmd = build_command(launch, binary)
    for f in cmd.files:  # as the agent writes them (agent.key_files)
        fd = os.open(f.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(f.content.reveal())
    log = work / "llama-server.log"
    # A key variable in the environment the engine would inherit: it must not become a second key.
    inherited = {**os.environ, "LLAMA_API_KEY": STRAY_KEY}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd.argv, env=cmd.environment(inherited), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
        )
    srv = Server(launch, proc, log)
    try:
        wait_ready(srv)
        yield srv
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            pytest.fail(f"llama-server ignored SIGTERM for 15 s:\n{srv.log_tail()}")
        if proc.returncode != 0:  # SIGTERM is a clean stop for llama-server
            pytest.fail(f"llama-server exited with {proc.returncode} on SIGTERM:\n{srv.log_tail()}")


def test_models_lists_the_served_name(server: Server) -> None:
    status, body = server.call("GET", "/v1/models", key=server.launch.api_key.reveal())
    assert status == 200
    assert [m["id"] for m in body["data"]] == ["tiny"]


def test_completion(server: Server) -> None:
    request = {"model": "tiny", "prompt": "hello model", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    status, body = server.call("POST", "/v1/completions", request, key=server.launch.api_key.reveal())
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 8
    assert isinstance(body["choices"][0]["text"], str)
    # Greedy decoding of the same weights: the same text again.
    assert (
        server.call("POST", "/v1/completions", request, key=server.launch.api_key.reveal())[1]["choices"]
        == body["choices"]
    )


def test_streamed_chat_completion(server: Server) -> None:
    request = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 6,
        "ignore_eos": True,
        "stream": True,
    }
    conn, resp = server.request("POST", "/v1/chat/completions", request, key=server.launch.api_key.reveal())
    with closing(conn):
        assert resp.status == 200
        assert resp.getheader("Content-Type", "").startswith("text/event-stream")
        events = [line[len(b"data: ") :] for line in resp.read().splitlines() if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    content = [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"]]
    assert sum(1 for piece in content if piece) >= 1
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"


@pytest.mark.parametrize("key", [None, "not-the-key", STRAY_KEY])
def test_the_engine_port_refuses_any_other_key(server: Server, key: str | None) -> None:
    status, body = server.call("POST", "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 1}, key=key)
    assert status == 401, body


def test_the_key_reaches_it_through_its_file_only(server: Server) -> None:
    key = server.launch.api_key.reveal().encode()
    cmdline = Path(f"/proc/{server.proc.pid}/cmdline").read_bytes().split(b"\0")
    assert b"--api-key-file" in cmdline and b"--api-key" not in cmdline
    assert not any(key in arg for arg in cmdline)
    environ = Path(f"/proc/{server.proc.pid}/environ").read_bytes()
    assert key not in environ and b"LLAMA_API_KEY=" not in environ
    [key_file] = [Path(f.path) for f in build_command(server.launch).files]
    assert key_file.read_bytes() == key + b"\n" and key_file.stat().st_mode & 0o777 == 0o600


def test_engine_check_against_the_installed_binary(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["ctl", "engine-check", "llamacpp", "--binary", llama_server()]) == 0
    assert "result: ok (exit 0)" in capsys.readouterr().out


def test_the_recorded_help_is_this_binarys() -> None:
    # tests/fixtures/help/README.md says the recording came from this build: keep them in step.
    done = subprocess.run([llama_server(), "--help"], capture_output=True, text=True, timeout=30, check=True)
    recorded = (build_root() / "tests" / "fixtures" / "help" / "llama-server.txt").read_text()
    assert documented_flags(done.stdout, "column0") == documented_flags(recorded, "column0")


SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
    "required": ["color", "ok"],
    "additionalProperties": False,
}


@pytest.mark.trio
async def test_a_json_schema_through_the_gateway_is_honoured_by_grammar_streamed_and_not(
    server: Server, tmp_path: Path, nursery
) -> None:
    """`response_format` json_schema through the gateway to the real llama-server: llama.cpp
    constrains the tokens by a grammar made from the schema, so even this tiny random model answers
    JSON valid for it — whole and as a stream. And an engine error in the gateway's shape."""
    import trio

    from llmgw.engines import SPECS
    from llmgw.gateway.routing import Endpoint
    from llmgw.wire import gateway_link as g
    from testlib.gateway import request, start_gateway
    from testlib.schemacheck import problems

    launch = server.launch
    endpoint = Endpoint(
        replica_id="tiny-0", model="tiny", host=launch.host, port=launch.port, api_key=launch.api_key.reveal()
    )
    gw = await start_gateway(nursery, tmp_path, (endpoint,))
    # What the control plane would say of the model: its engine's routes, from the spec.
    gw.provider.set(
        (endpoint,), None, (g.ModelInfo(name="tiny", engine="llamacpp", routes=SPECS["llamacpp"].routes(())),)
    )
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "a color, and whether it is ok"}],
        "max_tokens": 400,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}},
    }

    def ask(extra: dict) -> tuple[int, dict, bytes]:
        return request(gw.port, "POST", "/v1/chat/completions", {**body, **extra}, token=gw.token, timeout=60)

    status, headers, raw = await trio.to_thread.run_sync(ask, {})
    assert status == 200, raw
    assert headers["x-llmgw-replica"] == "tiny-0" and headers["x-request-id"]
    answer = json.loads(raw)["choices"][0]
    assert answer["finish_reason"] == "stop", answer
    value = json.loads(answer["message"]["content"])
    assert problems(value, SCHEMA) == [], value

    status, _, raw = await trio.to_thread.run_sync(ask, {"stream": True})
    assert status == 200, raw
    events = [line[len(b"data: ") :] for line in raw.splitlines() if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    text = "".join(
        (c["choices"][0]["delta"].get("content") or "") for c in map(json.loads, events[:-1]) if c["choices"]
    )
    assert problems(json.loads(text), SCHEMA) == [], text

    # The embeddings route: llama-server without --embeddings does not serve it, and the
    # gateway says so itself, naming the engine.
    status, _, raw = await trio.to_thread.run_sync(
        lambda: request(gw.port, "POST", "/v1/embeddings", {"model": "tiny", "input": "x"}, token=gw.token)
    )
    error = json.loads(raw)["error"]
    assert status == 404 and error["code"] == "unsupported_route" and "engine llamacpp" in error["message"]
    # A prompt past the context (2048 here): llama.cpp's own words, OpenAI's code.
    status, _, raw = await trio.to_thread.run_sync(
        lambda: request(
            gw.port,
            "POST",
            "/v1/completions",
            {"model": "tiny", "prompt": "hello " * 3000, "max_tokens": 4},
            token=gw.token,
            timeout=60,
        )
    )
    error = json.loads(raw)["error"]
    assert status == 400 and (error["code"], error["param"]) == ("context_length_exceeded", "messages"), error
