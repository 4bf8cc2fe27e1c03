"""Answers that survive on real llama-server replicas: `llmgw server` (its gateway in a worker
process) and one agent running two llama-server replicas of a made GGUF model whose greedy answer
re-tokenizes to the same tokens (`make_gguf(cycle=True)`: whole words, over and over). A greedy
streamed answer's replica is SIGKILLed mid-answer, a chat completion's and a text completion's:
the stream ends whole, with one id and the moved comment, and no token is lost or repeated —

- at the seam: what the client got after the tokens sent before the failure is exactly what
  llama-server answers, greedily and streamed, to the continuation the gateway asked for (chat:
  the conversation plus a final assistant message holding those tokens, `continue_final_message`,
  which llama-server continues as its assistant prefill; completions: the prompt plus the text);
- whole: the stream's text is the uninterrupted greedy answer to the same request (the text sent
  before, re-tokenized, ends on the token the answer ended on: the model goes on as it would have).

A random model would pass the first and not always the second: its padding and odd tokens' text
does not come back as the same tokens (docs/gateway.md, "At the seam")."""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

import attrs
import pytest

from testlib.cluster import Cluster, wait_until
from testlib.llama import llama_server
from testlib.makegguf import cycle_text, make_gguf

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
TOKENS = 160
KILL_AFTER = 12  # tokens seen by the client


@attrs.frozen
class Live:
    cluster: Cluster
    port: int
    token: str


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    root = tmp_path_factory.mktemp("migration-llama")
    # Eight 512-wide layers: slow enough on a CPU (tens of tokens a second) to be killed mid-answer.
    model = make_gguf(root / "m.gguf", n_layer=8, n_embd=512, n_head=8, n_head_kv=2, dtype="F16", cycle=True)
    cluster = Cluster(root, heartbeat_interval_s=0.5, heartbeat_ttl_s=5.0, server_toml="gateway_workers = 1\n")
    try:
        cluster.init_ca()
        cluster.set_catalog(
            f"""
[[models]]
name = "m"
engine = "llamacpp"
source = {{ path = "{model}" }}
replicas = 2
args = ["--ctx-size", "1024", "-np", "2"]
"""
        )
        cluster.add_node("node-a", agent_toml=f'llamacpp_bin = "{llama_server()}"\n')
        server = cluster.start_server()
        cluster.start_agent("node-a")
        cluster.wait_replicas(
            "both replicas ready", lambda rs: sum(r["state"] == "ready" for r in rs) == 2, timeout=180
        )
        [ready] = server.events("server_ready")
        token = cluster.ctl("keys", "create", "llama")["token"]
        yield Live(cluster=cluster, port=int(ready["admin_url"].rsplit(":", 1)[1]), token=token)
    finally:
        cluster.close()


MESSAGES = [{"role": "user", "content": "Tell me a long story about a river."}]
PROMPT = "Once upon a time, by a river,"


def body(route: str, max_tokens: int, stream: bool, *, so_far: str | None = None) -> dict[str, Any]:
    """The request (greedy) of `route`; with `so_far`, its continuation as the gateway asks it."""
    out: dict[str, Any] = {"model": "m", "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if route == CHAT:
        out["messages"] = MESSAGES
        if so_far is not None:
            out["messages"] = [*MESSAGES, {"role": "assistant", "content": so_far}]
            out.update(continue_final_message=True, add_generation_prompt=False)
    else:
        out["prompt"] = PROMPT + (so_far or "")
    return out


def post(live: Live, route: str, payload: dict[str, Any]) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=120)
    conn.request(
        "POST",
        route,
        body=json.dumps(payload),
        headers={"authorization": f"Bearer {live.token}", "content-type": "application/json"},
    )
    return conn.getresponse()


def pieces_of(lines: list[str]) -> list[str]:
    out = []
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            for c in json.loads(line[6:]).get("choices") or ():
                text = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
                if text:
                    out.append(text)
    return out


def streamed(live: Live, route: str, payload: dict[str, Any]) -> str:
    response = post(live, route, payload)
    assert response.status == 200, response.read()
    return "".join(pieces_of(response.read().decode().splitlines()))


def answer(live: Live, route: str, payload: dict[str, Any]) -> str:
    response = post(live, route, payload)
    assert response.status == 200, response.read()
    choice = json.loads(response.read())["choices"][0]
    return choice["message"]["content"] if route == CHAT else choice["text"]


@pytest.mark.parametrize("route", [CHAT, COMPLETIONS])
def test_a_llama_server_killed_mid_answer_is_continued_as_if_uninterrupted(live: Live, route: str) -> None:
    uninterrupted = answer(live, route, body(route, TOKENS, False))
    assert uninterrupted == cycle_text(TOKENS)  # the made model says its cycle of words, whatever it is asked
    moved_before = len(live.cluster.server.events("gateway_stream_migrated"))
    response = post(live, route, body(route, TOKENS, True))
    replica = response.getheader("x-llmgw-replica")
    lines: list[str] = []
    seen = threading.Event()

    def read() -> None:
        count = 0
        while raw := response.readline():
            lines.append(raw.decode().rstrip("\r\n"))
            count += len(pieces_of(lines[-1:]))
            if count >= KILL_AFTER:
                seen.set()
        seen.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert seen.wait(60)
    [row] = [r for r in live.cluster.replicas() or [] if r["replica"] == replica]
    killed = row["pids"][0]
    os.kill(killed, signal.SIGKILL)
    reader.join(120)
    assert not reader.is_alive()
    said = [line for line in lines if line]
    assert said[-1] == "data: [DONE]" and ": llmgw migrated 1" in said, said[-3:]
    ids = {json.loads(line[6:])["id"] for line in lines if line.startswith("data: {")}
    assert len(ids) == 1
    got = pieces_of(lines)
    [moved] = live.cluster.server.events("gateway_stream_migrated")[moved_before:]
    before = int(moved["pieces_before"])
    assert KILL_AFTER <= before < len(got), (before, len(got))
    # The seam: after the tokens sent before, exactly llama-server's greedy answer to the continuation.
    partial = "".join(got[:before])
    assert "".join(got[before:]) == streamed(live, route, body(route, TOKENS - before, True, so_far=partial))
    # The whole: the answer the first replica would have finished.
    assert "".join(got) == uninterrupted, (before, "".join(got))
    wait_until(
        "the killed replica back",
        lambda: all(r["state"] == "ready" and killed not in r["pids"] for r in live.cluster.replicas() or []) or None,
        timeout=120,
    )
