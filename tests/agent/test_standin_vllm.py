"""The stand-in for `vllm` (testlib.standin_vllm), run as a node's operator-installed executable
would be (`write_executable`): it answers the agent's check of an operator's vllm and
engine-check's help, serves health, models and completions with vLLM's key rule, loads before
it is healthy, and sleeps and wakes in vLLM's sleep mode only where vLLM would offer it."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import trio

from agent.engines import wanted_from
from agent.install.flags import help_run
from agent.install.installer import EngineStore, check_flags, check_runs
from llmgw.config import DEFAULT_VLLM_VERSION, AgentConfig
from llmgw.wire import agent_link as w
from testlib.ports import free_port
from testlib.proc import run_llmgw
from testlib.standin_vllm import HELP_DIR, write_executable

T = TypeVar("T")
KEY = "sk-standin-key-0001"
TIMEOUT_S = 20.0  # each wait's bound: a loaded CI machine starts a Python process in seconds


@pytest.fixture
def vllm(tmp_path: Path) -> Path:
    return write_executable(tmp_path / "vllm")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "STANDIN_"))}
    return {**env, **extra}


class Engine:
    """One running stand-in on 127.0.0.1, asked over HTTP/1.1."""

    def __init__(self, vllm: Path, tmp_path: Path, *flags: str, **env: str) -> None:
        self.port = free_port()
        self.events_file = tmp_path / f"events-{self.port}.jsonl"
        self.log = tmp_path / f"vllm-{self.port}.log"
        argv = [str(vllm), "serve", str(tmp_path), "--served-model-name", "q"]
        argv += ["--host", "127.0.0.1", "--port", str(self.port), *flags]
        with self.log.open("wb") as log:
            self.popen = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=clean_env(STANDIN_EVENTS_FILE=str(self.events_file), **env),
            )

    def call(
        self, method: str, path: str, body: Any = None, *, key: str | None = KEY
    ) -> tuple[int, http.client.HTTPResponse, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=TIMEOUT_S)
        try:
            headers = {"content-type": "application/json"}
            if key is not None:
                headers["authorization"] = f"Bearer {key}"
            conn.request(method, path, body=json.dumps(body) if body is not None else None, headers=headers)
            response = conn.getresponse()
            return response.status, response, response.read()
        finally:
            conn.close()

    def health(self) -> int | None:
        try:
            return self.call("GET", "/health")[0]
        except OSError:
            return None  # not listening yet

    def events(self) -> list[dict[str, Any]]:
        if not self.events_file.exists():
            return []
        return [json.loads(line) for line in self.events_file.read_text().splitlines()]

    def wait(self, what: str, check: Callable[[], T]) -> T:
        """Until `check()` gives something true, polled, for at most TIMEOUT_S."""
        deadline = time.monotonic() + TIMEOUT_S
        while not (value := check()):
            if self.popen.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{what}: not within {TIMEOUT_S:g} s\n{self.log.read_text(errors='replace')}")
            time.sleep(0.01)
        return value

    def stop(self) -> int:
        """SIGTERM; it exits at once."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
        try:
            return self.popen.wait(5)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(5)
            raise


@pytest.fixture
def start(vllm: Path, tmp_path: Path) -> Iterator[Callable[..., Engine]]:
    engines: list[Engine] = []

    def start(*flags: str, **env: str) -> Engine:
        engine = Engine(vllm, tmp_path, *flags, **env)
        engines.append(engine)
        return engine

    yield start
    for engine in engines:
        engine.stop()


def chat(max_tokens: int | None = 5, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "q", "messages": [{"role": "user", "content": "hello there"}], **extra}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return body


def sse(raw: bytes) -> list[Any]:
    events = [e for e in raw.decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events), raw
    return [e[len("data: ") :] if e == "data: [DONE]" else json.loads(e[len("data: ") :]) for e in events]


def test_version_and_help_as_vllm_0_32_prints_them(vllm: Path) -> None:
    said = subprocess.run([str(vllm), "--version"], capture_output=True, text=True, timeout=TIMEOUT_S, check=True)
    assert said.stdout == f"{DEFAULT_VLLM_VERSION}\n"
    whole = subprocess.run(
        [str(vllm), "serve", "--help=all"], capture_output=True, text=True, timeout=TIMEOUT_S, check=True
    )
    assert whole.stdout == (HELP_DIR / "vllm.txt").read_text()
    summary = subprocess.run([str(vllm), "serve", "--help"], capture_output=True, text=True, timeout=TIMEOUT_S)
    assert summary.stdout == (HELP_DIR / "vllm-summary.txt").read_text()
    # The operator's own check of the flags llmgw gives vLLM, asking this executable.
    checked = run_llmgw("ctl", "engine-check", "vllm", "--binary", str(vllm), timeout=TIMEOUT_S)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "result: ok (exit 0)" in checked.stdout


@pytest.mark.trio
async def test_the_agent_takes_it_as_the_operators_vllm(vllm: Path, tmp_path: Path) -> None:
    config = AgentConfig(server="wss://127.0.0.1:1", state_dir=str(tmp_path / "state"), vllm_bin=str(vllm))
    plan = wanted_from(w.EngineWant(name="vllm", version=""), config, "x86_64", True)
    with trio.fail_after(TIMEOUT_S * 3):
        installed = await EngineStore(tmp_path / "state" / "engines").ensure(plan)
        assert (installed.version, installed.executable) == (DEFAULT_VLLM_VERSION, str(vllm))
        # And the help an installed vLLM's flags are checked with (agent.install.flags).
        await check_flags("vllm", str(vllm), clean_env())
        argv, env = help_run("vllm", str(vllm), clean_env())
        assert await check_runs(argv, env=env) == (HELP_DIR / "vllm.txt").read_text()


def test_health_is_503_while_it_loads_then_200(start: Callable[..., Engine]) -> None:
    engine = start(STANDIN_LOAD_S="1.5")
    first = engine.wait("an answer to /health", engine.health)
    assert first == 503
    status, _, body = engine.call("POST", "/v1/chat/completions", chat())
    assert status == 503 and "loading" in json.loads(body)["error"]["message"]
    engine.wait("/health 200 once loaded", lambda: engine.health() == 200)
    assert engine.call("POST", "/v1/chat/completions", chat())[0] == 200
    [started] = [e for e in engine.events() if e["event"] == "start"]
    assert started["pid"] == engine.popen.pid  # the script exec'd it: the agent's pid is the engine's
    assert engine.stop() == 0


def test_completions_with_the_key_whole_and_streamed(start: Callable[..., Engine]) -> None:
    engine = start(VLLM_API_KEY=KEY, STANDIN_TOKEN_MS="5")
    engine.wait("/health 200", lambda: engine.health() == 200)

    for key in (None, "sk-wrong"):
        status, _, body = engine.call("POST", "/v1/chat/completions", chat(), key=key)
        assert status == 401
        error = json.loads(body)["error"]
        assert error["code"] == 401 and error["type"] and error["message"]
    assert engine.call("GET", "/v1/models", key=None)[0] == 401
    status, _, body = engine.call("GET", "/v1/models")
    assert status == 200 and [m["id"] for m in json.loads(body)["data"]] == ["q"]

    status, _, body = engine.call("POST", "/v1/chat/completions", chat(5))
    assert status == 200
    whole = json.loads(body)
    assert whole["object"] == "chat.completion" and whole["model"] == "q"
    content = whole["choices"][0]["message"]["content"]
    assert len(content.split()) == 5 and whole["choices"][0]["finish_reason"] == "length"
    assert whole["usage"]["completion_tokens"] == 5
    assert whole["usage"]["total_tokens"] == whole["usage"]["prompt_tokens"] + 5

    status, response, body = engine.call("POST", "/v1/chat/completions", chat(5, stream=True))
    assert status == 200 and response.getheader("content-type") == "text/event-stream"
    assert response.getheader("transfer-encoding") == "chunked"
    *chunks, done = sse(body)
    assert done == "[DONE]" and len(chunks) == 5
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == content
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 4 + ["length"]

    *chunks, done = sse(
        engine.call("POST", "/v1/chat/completions", chat(3, stream=True, stream_options={"include_usage": True}))[2]
    )
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3

    status, _, body = engine.call("POST", "/v1/completions", {"model": "q", "prompt": "once upon"})
    text = json.loads(body)
    assert status == 200 and text["object"] == "text_completion"
    assert len(text["choices"][0]["text"].split()) == 8  # max_tokens' default here

    requests = [(e["path"], e["status"]) for e in engine.events() if e["event"] == "request"]
    assert requests == [("/v1/chat/completions", 401)] * 2 + [("/v1/chat/completions", 200)] * 3 + [
        ("/v1/completions", 200)
    ]


def test_sleep_and_wake_in_dev_mode_with_the_flag(start: Callable[..., Engine]) -> None:
    engine = start("--enable-sleep-mode", VLLM_SERVER_DEV_MODE="1", VLLM_API_KEY=KEY, STANDIN_WAKE_S="0.3")
    engine.wait("/health 200", lambda: engine.health() == 200)

    def sleeping() -> bool:
        status, _, body = engine.call("GET", "/is_sleeping", key=None)  # open, as vLLM's: the key guards /v1
        assert status == 200
        return json.loads(body)["is_sleeping"]

    assert sleeping() is False
    for _ in range(2):  # the second is a no-op
        status, _, body = engine.call("POST", "/sleep", key=None)
        assert (status, body) == (200, b"")
    assert sleeping() is True
    assert engine.health() == 200
    status, _, body = engine.call("POST", "/v1/chat/completions", chat())
    assert status == 503 and "sleeping" in json.loads(body)["error"]["message"]

    began = time.monotonic()
    status, _, body = engine.call("POST", "/wake_up", key=None)
    assert (status, body) == (200, b"")
    assert time.monotonic() - began >= 0.3  # answered once awake
    assert engine.call("POST", "/wake_up", key=None)[0] == 200
    assert sleeping() is False
    assert engine.call("POST", "/v1/chat/completions", chat())[0] == 200

    assert engine.call("POST", "/sleep?level=2", key=None)[0] == 200
    assert engine.call("POST", "/sleep?level=3", key=None)[0] == 400
    kinds = [(e["event"], e["level"]) for e in engine.events() if e["event"] != "request"]
    assert kinds == [("start", None), ("sleep", 1), ("wake", None), ("sleep", 2)]
    times = [e["t"] for e in engine.events()]
    assert times == sorted(times)


@pytest.mark.parametrize("flag, dev_mode", [("--enable-sleep-mode", "0"), ("--no-enable-sleep-mode", "1")])
def test_no_sleep_routes_without_the_flag_and_dev_mode(start: Callable[..., Engine], flag: str, dev_mode: str) -> None:
    engine = start(flag, VLLM_SERVER_DEV_MODE=dev_mode)
    engine.wait("/health 200", lambda: engine.health() == 200)
    assert engine.call("POST", "/sleep?level=1")[0] == 404
    assert engine.call("POST", "/wake_up")[0] == 404
    assert engine.call("GET", "/is_sleeping")[0] == 404
    assert engine.call("POST", "/v1/chat/completions", chat())[0] == 200  # no key set: none asked
