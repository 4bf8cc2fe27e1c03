"""From a new node to the first token: a GGUF model the node downloads, the catalog entry that
names it, and a streamed chat completion through the gateway timed to its first token.

The model is the tests' tiny llama (testlib.tinygguf), served over HTTP from the host's side of
the machine's link (`ModelFiles`, Python's http.server in its own process) as a model repository
would serve it: the catalog names its URL with its sha256 and size (`catalog`), and the node's
agent downloads it, verifies it and starts llama.cpp on it. `first_token` sends one streamed chat
completion to the control plane's HTTP port with an API key and returns when the first piece of
the answer's text arrives, with the replica that answered (`x-llmgw-replica`); the rest of the
stream is read too, so the answer is checked whole. `report` leaves the figures measured beside
the JUnit reports, for the docs.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import attrs

from testlib.cluster import free_port, wait_until
from testlib.tinygguf import write_tiny_llama

MODEL = "tiny"
FILE = "tiny.gguf"
ANSWER_TOKENS = 8
FIRST_TOKEN_TIMEOUT_S = 60.0  # a tiny model: its first token comes at once, but the machine is loaded


def _answers(url: str) -> bool:
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the link: never through a proxy
    try:
        with direct.open(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


class ModelFiles:
    """A directory holding the tiny GGUF model, served over HTTP on `host`:`port` (a free one)."""

    def __init__(self, directory: Path, host: str) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = write_tiny_llama(directory / FILE)
        self.url = f"http://{host}:{free_port(host)}/{FILE}"
        port = str(urlsplit(self.url).port)
        argv = [sys.executable, "-m", "http.server", "--bind", host, "--directory", str(directory), port]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_until(
                "the model's file server", lambda: self.proc.poll() is not None or _answers(self.url), timeout=15
            )
            assert self.proc.poll() is None, f"the model's file server exited with {self.proc.returncode}"
        except BaseException:
            self.stop()
            raise

    def sha256(self) -> str:
        return hashlib.sha256(self.path.read_bytes()).hexdigest()

    def catalog(self) -> str:
        """server.toml's `[[models]]` entry for it: llama.cpp, one replica, downloaded by the node."""
        source = f'{{ url = "{self.url}", sha256 = "{self.sha256()}", size = {self.path.stat().st_size} }}'
        return f'[[models]]\nname = "{MODEL}"\nengine = "llamacpp"\nreplicas = 1\nsource = {source}\n'

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@attrs.frozen(kw_only=True)
class Answer:
    replica: str  # x-llmgw-replica: the replica that answered
    first_token_at: float  # time.monotonic() when the first piece of text arrived
    first_token: str
    text: str  # the whole answer
    finish_reason: str


def first_token(base_url: str, key: str, *, model: str = MODEL, timeout: float = FIRST_TOKEN_TIMEOUT_S) -> Answer:
    """One streamed chat completion through the gateway at `base_url` (the control plane's HTTP
    port); fails unless it answers 200 with text. `ignore_eos`: a model of random weights may end
    its answer at once, and then there would be no token to time."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": ANSWER_TOKENS,
        "stream": True,
        "ignore_eos": True,
    }
    where = urlsplit(base_url)
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=timeout)
    try:
        conn.request(
            "POST",
            "/v1/chat/completions",
            body=json.dumps(body),
            headers={"content-type": "application/json", "authorization": f"Bearer {key}"},
        )
        response = conn.getresponse()
        if response.status != 200:
            raise AssertionError(f"the gateway answered {response.status}: {response.read()[:2000]!r}")
        replica = response.getheader("x-llmgw-replica") or ""
        first_at, first, pieces, finish = 0.0, "", [], ""
        deadline = time.monotonic() + timeout
        for raw in iter(response.readline, b""):
            if time.monotonic() > deadline:
                raise AssertionError(f"the answer did not end within {timeout:g} s; so far {''.join(pieces)!r}")
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line.removeprefix(b"data:").strip()
            if data == b"[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                raise AssertionError(f"the stream ended in an error: {event['error']}")
            for choice in event.get("choices") or ():
                piece = (choice.get("delta") or {}).get("content") or ""
                if piece and not first_at:
                    first_at, first = time.monotonic(), piece
                pieces.append(piece)
                finish = choice.get("finish_reason") or finish
        if not first_at:
            raise AssertionError(f"the answer had no text: finish_reason {finish!r}")
        return Answer(
            replica=replica, first_token_at=first_at, first_token=first, text="".join(pieces), finish_reason=finish
        )
    finally:
        conn.close()


def report(name: str, text: str) -> None:
    """`text` as $LLMGW_TEST_REPORTS/`name` (pants.toml: dist/test/reports, outside the sandbox)."""
    where = os.environ.get("LLMGW_TEST_REPORTS")
    if where:
        Path(where).mkdir(parents=True, exist_ok=True)
        (Path(where) / name).write_text(text)
