"""The cluster page in a real headless Chromium, against a real `llmgw up --nodes 3 --fabric ib-a`.

One `up` and one Chromium for the module; each test opens its own tab in its own browser
context (its own cookies). In order, because each builds on what the one before left:

1. the URL `up` printed logs in once, leaves no code in the address bar, sets an HttpOnly
   SameSite=Strict cookie, and the page shows every node and replica, and the Vulkan device the real
   vulkaninfo finds (lavapipe, as software); screenshots at 1280x800
   and 390x844 go to the test report directory (printed), and basic accessibility holds;
2. a session from `llmgw ctl page --actions` drains a node with the keyboard alone, and the
   drain arrives in the open page without a reload; the log names the session, not a secret;
   the page's audit panel and `llmgw ctl audit` show the drain and the login by that session;
3. a model added to the catalog whose file stalls part-way on its way from the Hub (testlib.hubserver
   on loopback, a stall fault) shows its download, bytes and rate, on the open page, in
   `llmgw ctl models` and in `llmgw ctl replicas`; released, it is ready and the line is gone;
4. a fourth node declaring `ib-a` but seeing another subnet manager makes the page say the
   name covers two fabrics, while open (the live feed), and `ctl nodes` says it too.

No test may leave an error in the browser's console.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tomli_w
import tomllib
import trio

from llmgw import paths
from llmgw.ctl.client import AdminClient
from llmgw.ctl.page import page_url
from llmgw.pki.files import issue_to_dir, load_ca, node_paths
from testlib.browser import (  # noqa: F401 - chromium: a fixture
    Chromium,
    chromium,
    contrast_failures,
    no_console_errors,
    open_tab,
    report_dir,
    unlabelled_controls,
)
from testlib.cluster import free_port, wait_until
from testlib.gateway import request
from testlib.hardware import ib_root, sminfo
from testlib.hubrepo import HubRepo
from testlib.hubserver import HubServer
from testlib.marked import MARKER_ENV, kill_groups, marked_pids
from testlib.proc import Proc, llmgw_env, run_llmgw
from testlib.waiting import await_true

pytestmark = pytest.mark.trio

NODES = ("local-1", "local-2", "local-3")
ODD = "odd-1"  # declares ib-a, sees the recorded one-fabric's subnet manager: another fabric
ODD_IDENTITY = "ib-sm:0x0002c90300a1b2c3"
LIVE_S = 30.0  # a change reaching the open page: placement, engines and the feed on a loaded machine
MIB = 1 << 20
ADDED = "being-added"  # the model whose download stalls
ADDED_SIZE = 8 * MIB  # 8 pieces of 1 MiB (agent.pieces)
STALL_AT = 3 * MIB + MIB // 4  # the Hub stops sending here: 3 whole pieces in, "3 of 8 MiB (37%"


class Up:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.state = root / "state"
        self.log = root / "up.log"
        self.port = free_port()
        with self.log.open("w") as stderr:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "llmgw", "--log-format", "json", "up", "--state-dir", str(self.state)]
                + ["--port", str(self.port), "--nodes", "3", "--fabric", "ib-a", "--json"],
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                env=llmgw_env(),
            )
        self.events: list[dict[str, Any]] = []
        assert self.proc.stdout is not None
        for line in self.proc.stdout:  # bounded: `up` gives up after its own ready timeout
            self.events.append(json.loads(line))
            if self.events[-1]["event"] == "ready":
                break
        else:
            raise AssertionError(f"up ended before ready: exit {self.proc.wait(10)}\n{self.log.read_text()[-3000:]}")
        self.ready = self.events[-1]

    def ctl(self, *args: str) -> Any:
        result = run_llmgw("ctl", *args, "--json", "--state-dir", str(self.state), timeout=60)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    def log_events(self, event: str) -> list[dict[str, Any]]:
        return [r for r in map(_json_or_none, self.log.read_text().splitlines()) if r and r.get("event") == event]

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(timeout=10)


def _json_or_none(line: str) -> dict[str, Any] | None:
    try:
        return json.loads(line) if line.startswith("{") else None
    except ValueError:
        return None


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    cluster = Up(tmp_path_factory.mktemp("up"))
    extra: list[Proc] = []
    cluster.extra = extra  # type: ignore[attr-defined]
    try:
        yield cluster
    finally:
        for proc in extra:
            proc.stop(signal.SIGTERM)
        kill_groups(marked_pids(ODD))  # its engines, which outlive an agent by design
        assert cluster.stop() == 0


async def test_the_printed_url_logs_in_once_and_the_page_shows_every_node_and_replica(up: Up, chromium: Chromium):  # noqa: F811 - the fixture
    url = up.ready["page_url"]
    assert url.startswith(f"http://127.0.0.1:{up.port}/login?code=")
    token = paths.admin_token_path(up.state).read_text().strip()
    assert token not in url
    # Settled: `up` is ready once each model serves, and the agents report their engines a few
    # hundred ms apart, so both sim-small replicas may first land on the node that reported
    # first and one of them then be spread to another (a move: four replicas for a second).
    placed = await await_true(
        lambda: (rs := [r for r in up.ctl("replicas") if r["replica"]])
        and len(rs) == 3
        and all(r["state"] == "ready" for r in rs)
        and rs,
        "the replicas to settle: sim-small twice, sim-big across two nodes, all ready",
        poll_s=0.2,
    )
    replicas = [r["replica"] for r in placed]
    [local1] = [n for n in up.ctl("nodes") if n["id"] == "local-1"]
    assert local1["vulkan_status"] == "present", local1["vulkan_detail"]
    assert [(d["type"], d["software"]) for d in local1["vulkan"] if d["name"].startswith("llvmpipe")] == [("cpu", True)]

    async with open_tab(chromium) as tab:
        await tab.goto(url)
        assert await tab.evaluate("location.href") == f"http://127.0.0.1:{up.port}/"  # no code left to copy
        await tab.wait_for(f"document.querySelectorAll('[data-node]').length === {len(NODES)}")
        for node in NODES:
            assert await tab.evaluate(f"document.getElementById('node-{node}').dataset.state") == "joined"
        for replica in replicas:
            await tab.wait_for(f"document.querySelector('[data-replica=\"{replica}\"][data-state=ready]')")
        assert await tab.evaluate("document.querySelector('[data-fabric=\"ib-a\"]') !== null")
        # Each node's Vulkan devices, from the real vulkaninfo its agent ran (tools/testenv/prepare.py
        # installs vulkan-tools and Mesa's lavapipe): lavapipe shown, muted, as software, no GPU.
        lavapipe = "document.querySelector('#node-local-1 [data-vulkan][data-software=\"true\"]')"
        await tab.wait_for(f"{lavapipe} !== null")
        text = await tab.evaluate(f"{lavapipe}.textContent")
        assert text.startswith("Vulkan: llvmpipe (LLVM ") and "(software, llvmpipe, Vulkan 1." in text, text
        assert await tab.evaluate(f"{lavapipe}.className") == "muted"
        assert "read-only" in await tab.evaluate("document.getElementById('session').textContent")
        assert await tab.evaluate("document.querySelectorAll('#nodes button').length") == 0  # read-only: no actions
        # The session is in an HttpOnly, SameSite=Strict cookie; nothing of it, nor the
        # credential, is where a script could read it.
        [cookie] = (await tab.call("Network.getCookies"))["cookies"]
        assert (cookie["name"], cookie["httpOnly"], cookie["sameSite"], cookie["path"]) == (
            "llmgw_session",
            True,
            "Strict",
            "/",
        )
        assert await tab.evaluate("document.cookie") == ""
        assert await tab.evaluate("localStorage.length + sessionStorage.length") == 0
        html = await tab.evaluate("document.documentElement.outerHTML")
        assert token not in html and cookie["value"] not in html
        # The gateway's plots, one set per model, each an image with a text alternative.
        await tab.wait_for("document.querySelectorAll('#gateway svg.plot').length >= 8")

        assert await unlabelled_controls(tab) == []
        assert await contrast_failures(tab) == []
        out = report_dir()
        wide = await tab.screenshot(out / "cluster-page-1280x800.png", 1280, 800)
        phone = await tab.screenshot(out / "cluster-page-390x844.png", 390, 844, mobile=True)
        assert await tab.evaluate("document.documentElement.scrollWidth") <= 390  # nothing wider than a phone
        print(f"screenshots: {wide} {phone}")
        assert wide.stat().st_size > 10_000 and phone.stat().st_size > 10_000
        no_console_errors(tab)

    async with open_tab(chromium) as again:  # the same URL a second time: used up
        await again.goto(url)
        text = await again.evaluate("document.body.innerText")
        assert "used already" in text and "llmgw ctl page" in text
        assert (await again.call("Network.getCookies"))["cookies"] == []


async def test_a_drain_made_with_the_keyboard_arrives_in_the_open_page_without_a_reload(up: Up, chromium: Chromium):  # noqa: F811 - the fixture
    login = up.ctl("page", "--actions")
    assert login["actions"] is True
    # Every node joined with its engines reported (`up` is ready once the sims serve, which may be
    # before a third node reported): a drain planned while one is still arriving stops, rightly,
    # for want of the capacity that node brings (a fresh CI run drained before local-2 reported).
    wait_until(
        "every node joined with its engines reported",
        lambda: all(n["state"] == "joined" and n["engines"] for n in up.ctl("nodes")),
        last_seen=lambda: up.ctl("nodes"),
    )
    # The node holding the most replicas: the drain has something to move, one at a time.
    held = [n for r in up.ctl("replicas") if r["replica"] for n in r["nodes"]]
    node = max(NODES, key=held.count)
    assert held.count(node) >= 1
    async with open_tab(chromium) as tab:
        await tab.goto(login["url"])
        await tab.wait_for(f"document.getElementById('drain-{node}')")
        session = await tab.evaluate("document.getElementById('session').textContent")
        assert "may act" in session
        session_id = session.split()[1].rstrip(",")
        await tab.evaluate("window.notReloaded = true")
        # Every state the node's row shows, as the feed redraws it.
        await tab.evaluate(
            f"""window.seen = [];
            new MutationObserver(() => {{
                const row = document.getElementById('node-{node}');
                const s = row && row.dataset.state;
                if (s && window.seen[window.seen.length - 1] !== s) window.seen.push(s);
            }}).observe(document.getElementById('nodes-body'), {{subtree: true, childList: true, attributes: true}})"""
        )

        # Keyboard only: focus the button (as Tab would reach it), Enter opens the confirm, whose
        # focus starts on Cancel; Tab to the confirm button, Enter.
        await tab.evaluate(f"document.getElementById('drain-{node}').focus()")
        await tab.key("Enter")
        await tab.wait_for("document.getElementById('confirm').open")
        assert await tab.evaluate("document.activeElement.id") == "confirm-cancel"
        await tab.key("Tab")
        assert await tab.evaluate("document.activeElement.id") == "confirm-ok"
        await tab.key("Enter")

        await tab.wait_for(
            f"['draining', 'cordoned'].includes(document.getElementById('node-{node}').dataset.state)", LIVE_S
        )
        await tab.wait_for(f"document.querySelector('[data-drain=\"{node}\"] progress')", LIVE_S)
        await tab.wait_for(f"document.getElementById('node-{node}').dataset.state === 'cordoned'", LIVE_S)
        assert await tab.evaluate("window.notReloaded") is True  # the same document all along
        seen = await tab.evaluate("window.seen")  # redraws before the drain began show it joined
        assert [s for s in seen if s != "joined"] == ["draining", "cordoned"], seen
        moved = held.count(node)
        await tab.wait_for(
            f"document.querySelector('[data-drain=\"{node}\"] label').textContent"
            f".endsWith('{moved} of {moved} replicas moved, done')",
            LIVE_S,
        )
        assert await tab.evaluate("document.activeElement.id") != ""  # the keyboard's place kept
        # The audit panel shows the drain, by this session, and its login, without a reload.
        await tab.wait_for("document.querySelector('#audit [data-action=\"node.drain\"]')", LIVE_S)
        drained = await tab.evaluate("document.querySelector('#audit [data-action=\"node.drain\"]').innerText")
        assert f"page:{session_id}" in drained and node in drained and "force=false" in drained
        logins = await tab.evaluate(
            "[...document.querySelectorAll('#audit [data-action=\"page.login\"]')].map((r) => r.innerText)"
        )
        assert any(f"page:{session_id}" in text for text in logins), logins
        no_console_errors(tab)

    nodes = {n["id"]: n for n in up.ctl("nodes")}
    assert nodes[node]["cordoned"] and nodes[node]["drain"]["done"]
    assert not any(r["replica"] and node in r["nodes"] for r in up.ctl("replicas"))
    # Audited with the session's public id; neither the cookie nor a code reaches the log.
    calls = [e for e in up.log_events("admin_call") if e["path"] == f"/admin/v1/nodes/{node}/drain"]
    assert [(c["by"], c["status"]) for c in calls] == [(session_id, 202)]
    assert "code=" not in up.log.read_text()
    # And in the audit log, which `llmgw ctl audit` reads: the link minted, the login, the drain.
    entries = up.ctl("audit", "--actor", f"page:{session_id}")
    assert [(e["action"], e["target"]) for e in entries] == [("node.drain", node), ("page.login", "")]
    assert up.ctl("audit", "--action", "page.link", "--limit", "1")[0]["detail"] == {"actions": True}
    up.ctl("uncordon", node)


async def test_a_stalled_download_shows_on_the_page_in_ctl_models_and_ctl_replicas(up: Up, chromium: Chromium):  # noqa: F811 - the fixture
    content = os.urandom(ADDED_SIZE)
    path = f"{ADDED}.gguf"
    server_toml = up.state / "server.toml"
    before = server_toml.read_text()
    # The admin API in this process (a `llmgw ctl` process costs ~0.6 s); the commands whose text
    # is checked, `ctl models` and `ctl replicas`, run as themselves.
    admin = AdminClient.locate(server=None, credential=None, state_dir=str(up.state))

    def ctl(*args: str) -> str:
        return run_llmgw("ctl", *args, "--state-dir", str(up.state), timeout=60).stdout

    with HubServer([HubRepo(f"llmgw-tests/{ADDED}", {path: content})]) as hub:
        stall = hub.faults.stall(path, after=STALL_AT)
        try:
            async with open_tab(chromium) as tab:
                await tab.goto(page_url(admin, actions=False)["url"])
                await tab.wait_for("document.getElementById('model-sim-small')")
                # Added to the catalog as server.toml adds one (`ctl models add --hf` takes GGUF for
                # llama.cpp only, and this cluster runs sims): one replica, its file on the Hub.
                doc = tomllib.loads(before)
                doc["models"].append(
                    {
                        "name": ADDED,
                        "engine": "sim",
                        "replicas": 1,
                        "source": {
                            "url": f"{hub.url}/llmgw-tests/{ADDED}/resolve/main/{path}",
                            "sha256": hashlib.sha256(content).hexdigest(),
                            "size": ADDED_SIZE,
                        },
                    }
                )
                server_toml.write_text(tomli_w.dumps(doc))
                admin.request("POST", "/admin/v1/reload")
                # The one node fetching it (its origin: no other node wants it) stopped 3 pieces in;
                # its report (every 2 s while it downloads) reaches the control plane.
                await trio.to_thread.run_sync(stall.wait_reached)
                row = await await_true(
                    lambda: next(
                        (
                            r
                            for r in admin.request("GET", "/admin/v1/replicas")["replicas"]
                            if r["model"] == ADDED and "3 of 8 MiB" in r["detail"]
                        ),
                        None,
                    ),
                    f"the admin API to show {ADDED}'s replica 3 MiB into its download",
                    timeout=LIVE_S,
                    poll_s=0.2,
                )
                replica, node = row["replica"], row["nodes"][0]
                assert row["state"] == "fetching", row
                words = r"downloading weights: 3 of 8 MiB \(37%(, \d+\.\d MiB/s)?\)"  # the rate from the 2nd report
                assert re.fullmatch(words, row["detail"]), row
                # `llmgw ctl models`: the line under the table, as `ctl replicas` shows the row.
                models = await trio.to_thread.run_sync(ctl, "models")
                [line] = [line for line in models.splitlines() if line.startswith(f"  {ADDED}: ")]
                assert re.fullmatch(rf"  {ADDED}: {replica} on {node}: {words}", line), models
                assert re.search(rf"^{ADDED}\s+sim\s+0/1\s", models, flags=re.M), models
                replicas = await trio.to_thread.run_sync(ctl, "replicas")
                [shown] = [r for r in replicas.splitlines() if f" {ADDED} " in r]
                assert re.fullmatch(rf"{replica}\s+{ADDED}\s+{node}\s+fetching\s+-\s+0\s+{words}", shown), replicas
                # The open page, live: the line under the model's heading.
                progress = f"document.querySelector('[data-progress=\"{ADDED}\"]')"
                text = await tab.wait_for(f"{progress}?.textContent.includes('3 of 8 MiB') && {progress}.textContent")
                assert re.fullmatch(rf"{replica} on {node}: {words}", text), text

                stall.release()
                await tab.wait_for(
                    f"!{progress} && document.getElementById('model-{ADDED}').textContent.includes('1 of 1 ready')",
                    LIVE_S,
                )
                no_console_errors(tab)
            # Ready on the page, so in the control plane: its line gone from `ctl models`.
            models = ctl("models")
            assert re.search(rf"^{ADDED}\s+sim\s+1/1\s", models, flags=re.M), models
            assert f"  {ADDED}:" not in models, models
            [row] = [r for r in admin.request("GET", "/admin/v1/replicas")["replicas"] if r["model"] == ADDED]
            assert (row["replica"], row["state"], row["detail"]) == (replica, "ready", ""), row
            sent = hub.log.bytes_sent(path)
            assert sent == ADDED_SIZE, f"the Hub sent {sent} bytes of {ADDED_SIZE}: the stalled request went on"
        finally:
            stall.release()
            server_toml.write_text(before)
            admin.request("POST", "/admin/v1/reload")


async def test_a_model_whose_replicas_follow_the_load_shows_its_bounds_on_the_open_page(up: Up, chromium: Chromium):  # noqa: F811 - the fixture
    server_toml = up.state / "server.toml"
    before = server_toml.read_text()
    admin = AdminClient.locate(server=None, credential=None, state_dir=str(up.state))
    try:
        async with open_tab(chromium) as tab:
            await tab.goto(page_url(admin, actions=False)["url"])
            await tab.wait_for("document.getElementById('model-sim-small')")
            doc = tomllib.loads(before)
            doc["models"].append(
                {
                    "name": "elastic",
                    "engine": "sim",
                    "min_replicas": 1,
                    "max_replicas": 2,
                    "replicas": 1,
                    "idle_s": 600.0,
                }
            )
            server_toml.write_text(tomli_w.dumps(doc))
            admin.request("POST", "/admin/v1/reload")
            scale = "document.querySelector('[data-scale=\"elastic\"]')"
            text = await tab.wait_for(f"{scale}?.textContent", LIVE_S)
            assert text == "Replicas 1-2 by load (idle after 600 s), wants 1", text
            no_console_errors(tab)
    finally:
        server_toml.write_text(before)
        admin.request("POST", "/admin/v1/reload")


async def test_one_fabric_name_on_two_subnet_managers_is_a_warning_on_the_open_page(up: Up, chromium: Chromium):  # noqa: F811 - the fixture
    async with open_tab(chromium) as tab:
        await tab.goto(up.ctl("page")["url"])
        await tab.wait_for(f"document.querySelectorAll('[data-node]').length === {len(NODES)}")
        assert await tab.evaluate("document.querySelector('[data-note]')") is None

        up.extra.append(start_odd_node(up))  # type: ignore[attr-defined]
        # Live: the node joins and the warning appears in the page already open.
        await tab.wait_for("document.querySelectorAll('[data-fabric=\"ib-a\"]').length === 2", LIVE_S)
        note = await tab.wait_for("document.querySelector('#fabrics [data-note]')?.textContent")
        assert "'ib-a' covers 2 independent fabrics" in note and "placed as 2 fabrics" in note
        assert "Give each fabric its own name" in note
        assert ODD_IDENTITY in note
        warnings = await tab.evaluate("document.getElementById('warnings-list').innerText")
        assert "covers 2 independent fabrics" in warnings
        # Its certificate was issued for 20 days: highlighted, and a warning.
        cert = await tab.evaluate(
            f"document.getElementById('node-{ODD}').querySelector('td[data-label=Certificate]').innerText"
        )
        assert "renew soon" in cert
        assert f"node {ODD}: its certificate expires in" in warnings
        out = report_dir()
        await tab.evaluate("document.getElementById('fabrics').scrollIntoView()")
        shot = await tab.screenshot(out / "cluster-page-two-fabrics-1280x800.png", 1280, 800)
        print(f"screenshot: {shot}")
        no_console_errors(tab)

    result = run_llmgw("ctl", "nodes", "--state-dir", str(up.state), timeout=60)
    assert "note: fabric name 'ib-a' covers 2 independent fabrics" in result.stdout


async def test_the_usage_panel_shows_each_keys_tokens_on_the_open_page(up: Up, chromium: Chromium):  # noqa: F811 - the fixture
    # An answer through `up`'s gateway with its key: the ledger counts it (the usage the engine
    # said), and the open page's usage panel shows the key's row as `llmgw ctl usage` has it.
    port = int(up.ready["gateway_url"].rsplit(":", 1)[1].strip("/"))
    body = {"model": "sim-small", "messages": [{"role": "user", "content": "count me"}], "max_tokens": 4}
    status, _, answer = request(port, "POST", "/v1/chat/completions", body, token=up.ready["api_key"], timeout=60)
    assert status == 200, answer
    wait_until(
        "the ledger to count the answer",
        lambda: any(r["model"] == "sim-small" for r in up.ctl("usage")["usage"]),
        timeout=LIVE_S,
    )
    [row] = [r for r in up.ctl("usage")["usage"] if r["model"] == "sim-small"]
    login = up.ctl("page")
    async with open_tab(chromium) as tab:
        await tab.goto(login["url"])
        key = row["key"]
        selector = f'#usage [data-usage-key="{key}"][data-usage-model="sim-small"]'
        await tab.wait_for(f"document.querySelector('{selector}')", LIVE_S)
        cells = await tab.evaluate(f"[...document.querySelector('{selector}').cells].map((c) => c.innerText)")
        assert cells[0] == row["key"] and cells[2] == "sim-small"
        assert cells[3:] == [
            f"{row[k]:,}" for k in ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "total_tokens")
        ]
        assert await tab.evaluate("document.querySelector('#usage [data-usage-total]') !== null")
        no_console_errors(tab)


def start_odd_node(up: Up) -> Proc:
    node_dir = up.root / ODD
    issue_to_dir(load_ca(up.state), ODD, node_paths(node_dir).dir, validity_days=20)
    agent_port = up.events[[e["event"] for e in up.events].index("control_plane")]["agents"].rsplit(":", 1)[1]
    config = up.root / f"{ODD}.toml"
    config.write_text(
        f'server = "wss://127.0.0.1:{agent_port}"\nnode_id = "{ODD}"\nstate_dir = "{node_dir}"\n'
        'source_address = "127.0.0.9"\n'
        f'ib_root = "{ib_root("one-fabric")}"\nsminfo = "{sminfo("one-fabric")}"\n'
        'fabrics = [{name = "ib-a", adapters = ["mlx5_0", "mlx5_1"]}]\n'
    )
    agent = Proc(
        ODD,
        ["--log-format", "json", "agent", "run", "--config", str(config)],
        up.root / f"{ODD}.log",
        {MARKER_ENV: ODD},
    )
    wait_until(f"{ODD} to join", lambda: agent.events("link_up"), alive=[agent])
    return agent
