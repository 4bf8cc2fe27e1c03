"""A model updated without failing a request, on real processes on loopback: `llmgw server` with
its gateway in a worker process, one `llmgw agent`, sim engines, a steady load of streamed chats
through the gateway. Everything through what an operator and a client use.

1. The model's args changed in server.toml and `llmgw ctl reload`: its two replicas are replaced
   one at a time (new engines, with the new args), never fewer than two ready, and every request
   sent meanwhile is answered 200 and whole (every token, [DONE], none continued on another
   replica: none was cut).
2. Args the sim refuses (it exits at start): the first replacement fails, the rollout stops, the
   old replicas serve on (the same engines), and `ctl models` says why;
3. and so does the cluster page, in a real headless Chromium.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest

from llmgw.ctl.client import AdminClient
from llmgw.ctl.page import page_url
from testlib.browser import Chromium, chromium, no_console_errors, open_tab  # noqa: F401 - chromium: a fixture
from testlib.calls import post
from testlib.cluster import Cluster, wait_until

MODEL = """
[[models]]
name = "coder"
engine = "sim"
replicas = 2
args = {args}
"""
TOKENS = 25  # a stream of 25 tokens at 20 ms: half a second
READY_S = 60.0


@attrs.frozen
class Live:
    cluster: Cluster
    port: int  # the control plane's gateway worker
    token: str


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    cluster = Cluster(tmp_path_factory.mktemp("rollout"), heartbeat_interval_s=0.5, heartbeat_ttl_s=5.0)
    try:
        cluster.init_ca()
        cluster.set_catalog(MODEL.format(args='["--output-token-ms", "20"]'))
        cluster.add_node("node-a")
        server = cluster.start_server()
        cluster.start_agent("node-a")
        cluster.wait_replicas("2 of coder ready", lambda rs: len(ready(rs)) == 2, timeout=READY_S)
        [started] = server.events("server_ready")
        token = cluster.ctl("keys", "create", "rollout")["token"]
        yield Live(cluster=cluster, port=int(started["admin_url"].rsplit(":", 1)[1]), token=token)
    finally:
        cluster.close()


def ready(replicas: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    return [r for r in replicas or [] if r["replica"] and r["model"] == "coder" and r["state"] == "ready"]


def placed(live: Live) -> list[dict[str, Any]]:
    return [r for r in live.cluster.replicas() or [] if r["replica"] and r["model"] == "coder"]


def rollout(live: Live) -> dict[str, Any] | None:
    """The model's rollout as `llmgw ctl models --json` says it (asked in this process, as the
    cluster's own polls are: a `ctl` process per poll costs CPU the engines want)."""
    client = AdminClient.locate(server=None, credential=None, state_dir=str(live.cluster.state))
    [m] = [m for m in client.request("GET", "/admin/v1/models")["models"] if m["model"] == "coder"]
    return m["rollout"]


def token_ms(pid: int) -> str:
    """The --output-token-ms the engine of `pid` was started with."""
    args = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    return args[args.index("--output-token-ms") + 1]


def stream(live: Live) -> tuple[int, bytes]:
    body = {
        "model": "coder",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": TOKENS,
        "stream": True,
        "ignore_eos": True,  # every one of max_tokens: a stream cut short is told from one that ended
    }
    status, _, answer = post(live.port, live.token, body, timeout=60)
    return status, answer


def whole(body: bytes) -> bool:
    """Every token and [DONE], on one replica: not continued on another (`: llmgw migrated`)."""
    if b"llmgw migrated" in body:
        return False
    events = [line[6:] for line in body.decode().splitlines() if line.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        return False
    pieces = [json.loads(e)["choices"][0]["delta"].get("content", "") for e in events[:-1] if json.loads(e)["choices"]]
    return sum(1 for p in pieces if p) == TOKENS


class Load:
    """Streamed chats from `clients` threads, one after another each, until `stop()` (at most
    `limit` each and `within_s` in all); and the ready replicas of the model counted meanwhile."""

    def __init__(self, live: Live, clients: int = 3, limit: int = 200, within_s: float = 180.0) -> None:
        self.live = live
        self.answers: list[tuple[int, bytes]] = []
        self.ready_seen: list[int] = []
        self._stop = threading.Event()
        self._deadline = time.monotonic() + within_s
        self._threads = [threading.Thread(target=self._client, args=(limit,), daemon=True) for _ in range(clients)]
        self._threads.append(threading.Thread(target=self._watch, daemon=True))
        for t in self._threads:
            t.start()

    def _client(self, limit: int) -> None:
        for _ in range(limit):
            if self._stop.is_set() or time.monotonic() > self._deadline:
                return
            try:
                self.answers.append(stream(self.live))
            except OSError as exc:
                self.answers.append((0, str(exc).encode()))

    def _watch(self) -> None:
        while not self._stop.wait(0.25):
            replicas = self.live.cluster.replicas()
            if replicas is not None:
                self.ready_seen.append(len(ready(replicas)))

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(90)
        assert not any(t.is_alive() for t in self._threads), "a client did not end"


def test_changed_args_replace_the_replicas_one_at_a_time_under_load_and_fail_no_request(live: Live) -> None:
    before = placed(live)
    old_pids = {r["pids"][0] for r in before}
    assert len(old_pids) == 2 and {token_ms(pid) for pid in old_pids} == {"20"}
    load = Load(live)
    try:
        wait_until("the load's first answers", lambda: len(load.answers) >= 3 or None, timeout=30)
        live.cluster.set_catalog(MODEL.format(args='["--output-token-ms", "10"]'))
        live.cluster.llmgw("ctl", "reload", "--state-dir", str(live.cluster.state))

        def done() -> bool | None:
            replicas = placed(live)
            pids = {r["pids"][0] for r in replicas}
            new = len(replicas) == 2 and all(r["state"] == "ready" for r in replicas) and not pids & old_pids
            return (new and rollout(live) is None) or None

        wait_until("both replicas replaced", done, timeout=READY_S * 2)
        wait_until("more answers after the rollout", lambda: len(load.answers) >= 20 or None, timeout=30)
    finally:
        load.stop()
    failed = [(status, body[:300]) for status, body in load.answers if status != 200 or not whole(body)]
    assert not failed, failed
    assert min(load.ready_seen) >= 2, load.ready_seen  # never fewer ready than before the change
    assert {token_ms(r["pids"][0]) for r in placed(live)} == {"10"}  # the new engines run the new args
    wait_until("the old engines gone", lambda: not old_pids & set(live.cluster.engine_pids("node-a")) or None)
    events = live.cluster.server.events("rollout_replacing")
    assert [e["model"] for e in events] == ["coder", "coder"], events
    # Each replacement an id of its own: one the agent still reported (ready, the engine just
    # stopped) would have passed for ready at once.
    assert not {e["replacement"] for e in events} & {r["replica"] for r in before}, events
    assert [e["model"] for e in live.cluster.server.events("rollout_done")] == ["coder"]


def test_args_the_engine_refuses_stop_the_rollout_and_the_old_replicas_serve_on(live: Live) -> None:
    before = placed(live)
    pids = {r["pids"][0] for r in before}
    live.cluster.set_catalog(MODEL.format(args='["--output-token-ms", "fast"]'))  # not a number: the sim exits
    live.cluster.llmgw("ctl", "reload", "--state-dir", str(live.cluster.state))
    # Its agent gives the replacement up after five exits (about 15 s of backoff).
    stopped = wait_until(
        "the rollout stopped", lambda: (r := rollout(live)) and r["state"] == "stopped" and r or None, timeout=90
    )
    assert stopped["reason"].startswith("update of coder stopped: coder-") and " failed: " in stopped["reason"], stopped
    assert (stopped["updated"], stopped["replicas"]) == (0, 2)
    after = placed(live)
    assert {r["pids"][0] for r in after} == pids and all(r["state"] == "ready" for r in after)  # the same engines
    status, body = stream(live)
    assert status == 200 and whole(body), body[:300]
    text = live.cluster.llmgw("ctl", "models", "--state-dir", str(live.cluster.state)).stdout
    assert "coder: update of coder stopped: " in text and "--retry" in text, text
    [event] = live.cluster.server.events("rollout_stopped")
    assert event["model"] == "coder"


@pytest.mark.trio
async def test_the_cluster_page_says_why_the_rollout_stopped(live: Live, chromium: Chromium) -> None:  # noqa: F811 - the fixture
    admin = AdminClient.locate(server=None, credential=None, state_dir=str(live.cluster.state))
    async with open_tab(chromium) as tab:
        await tab.goto(page_url(admin, actions=False)["url"])
        line = "document.querySelector('[data-rollout=\"coder\"]')"
        text = await tab.wait_for(f"{line}?.dataset.state === 'stopped' && {line}.textContent", 30)
        assert text.startswith("update of coder stopped: coder-") and " failed: " in text, text
        assert text.endswith("; 2 of 2 replicas serve on with the version before"), text
        no_console_errors(tab)
