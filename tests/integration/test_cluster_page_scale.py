"""The cluster page with 5,000 nodes, in a real headless Chromium.

The control plane is a real one (`testlib.controlplane.serve_plane`: its HTTP server on loopback,
its feed, its page), run in this test's process; its registry holds 5,000 nodes as
`tools/bench/agents_load.py`'s agents describe themselves (8 GPUs, 2 fabrics, an engine), each
joined by the registry's own calls (`connect`, `heartbeat`, `told`) rather than over 5,000 TLS
links, which `tools/bench/controlplane.py --agents` measures. Every 100th node is lost (its last
heartbeat long ago), every 250th of the others cordoned through the operator's path.

Checked: the time to the first rows (printed, with a generous bound); at most a few hundred rows
in the document, however far the list is scrolled; the last node at the end of the list; the
counts per state and the state and name filters (typed with the keyboard); a node cordoned
through the admin API (as `llmgw ctl cordon` does) changing its row in the open page without a
reload; the basic accessibility checks; no error in the browser's console. A screenshot goes to
the test report directory.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import trio
from bench import agents_load

from llmgw.ctl.client import AdminClient
from testlib.browser import (  # noqa: F401 - chromium: a fixture
    Chromium,
    Tab,
    chromium,
    contrast_failures,
    no_console_errors,
    open_tab,
    report_dir,
    unlabelled_controls,
)
from testlib.controlplane import make_state, serve_plane

pytestmark = pytest.mark.trio

NODES = 5000
LOST = {agents_load.node_id(i) for i in range(99, NODES, 100)}  # 50
CORDONED = [agents_load.node_id(i) for i in range(0, NODES, 250)]  # 20, none lost
MAX_ROWS = 300  # rows in the document at once: those in view, and a few either side
FIRST_RENDER_S = 30.0  # from the login URL to the first rows, on a loaded 2-core machine
LIVE_S = 20.0


async def big_plane(tmp_path: Path, nursery: trio.Nursery):
    state = tmp_path / "cp"
    make_state(state, sans=["127.0.0.1"], days=3)
    plane, _ = await serve_plane(state, nursery)
    registry = plane.registry
    now = registry.clock.now()
    not_after = time.time() + 300 * 86400
    for i in range(NODES):
        hello = agents_load.hello(i)
        node_id = hello.node_id
        heard = now - 5000 if node_id in LOST else now
        conn = registry.connect(
            hello, address=f"10.1.{i // 250}.{i % 250 + 1}", cert_serial=i + 1, cert_not_after=not_after, now=heard
        )
        registry.heartbeat(node_id, conn, heard)
        if node_id not in LOST:
            registry.told(node_id, conn, 600.0)  # the time to be lost 5,000 agents are told (heartbeats.py)
        if i % 500 == 0:
            await trio.lowlevel.checkpoint()
    for node_id in CORDONED:
        await plane.intent.cordon(node_id, True)
    return plane, state


async def rows(tab: Tab) -> int:
    return await tab.evaluate("document.querySelectorAll('#nodes [data-node]').length")


async def shown_ids(tab: Tab) -> list[str]:
    return await tab.evaluate("[...document.querySelectorAll('#nodes [data-node]')].map((r) => r.dataset.node)")


async def scroll_to_end_shows_the_last_node(tab: Tab) -> None:
    """Scrolled to its end, the list shows the last node, and still only the rows in view."""
    await tab.evaluate("document.getElementById('node-list').scrollTop = 1e9")
    last = agents_load.node_id(NODES - 1)
    await tab.wait_for(f"document.getElementById('node-{last}')")
    assert await rows(tab) <= MAX_ROWS
    assert (await shown_ids(tab))[-1] == last
    in_view = await tab.evaluate(
        f"""(() => {{
        const l = document.getElementById('node-list').getBoundingClientRect();
        const r = document.getElementById('node-{last}').getBoundingClientRect();
        return r.bottom <= l.bottom + 1 && r.top >= l.top;
    }})()"""
    )
    assert in_view, "the last node's row is not in the list's view"


async def choose_state(tab: Tab, state: str) -> None:
    """Choose in the state filter, as a keyboard's arrows do (the value, then a change event)."""
    await tab.evaluate(
        f"{{ const s = document.getElementById('state-filter'); s.focus(); s.value = '{state}';"
        "s.dispatchEvent(new Event('change', {bubbles: true})); }"
    )


async def type_into(tab: Tab, element_id: str, text: str) -> None:
    """Focus the field and type, as the keyboard does (each character an input event)."""
    await tab.evaluate(f"document.getElementById('{element_id}').focus()")
    for ch in text:
        await tab.call("Input.insertText", text=ch)


async def test_the_page_stays_usable_with_5000_nodes(tmp_path: Path, nursery: trio.Nursery, chromium: Chromium):  # noqa: F811 - the fixture
    plane, state = await big_plane(tmp_path, nursery)
    client = AdminClient.locate(server=None, credential=None, state_dir=str(state))
    async with open_tab(chromium) as tab:
        began = time.monotonic()
        await tab.goto(client.url + plane.page.login_path(), timeout_s=FIRST_RENDER_S)
        await tab.wait_for("document.querySelector('#nodes [data-node]')", FIRST_RENDER_S)
        seen_s = time.monotonic() - began
        # From the navigation's start (the login URL) to the page's first drawing of the rows.
        first_render_ms = await tab.evaluate("performance.getEntriesByName('llmgw-first-render')[0].startTime")
        print(
            f"first rows of {NODES} nodes: {first_render_ms:.0f} ms after navigation ({seen_s:.1f} s seen by the test)"
        )
        assert first_render_ms < FIRST_RENDER_S * 1000
        await tab.evaluate("window.notReloaded = true")

        assert 10 <= await rows(tab) <= MAX_ROWS
        assert (await shown_ids(tab))[0] == agents_load.node_id(0)
        counts = await tab.evaluate("document.getElementById('node-counts').textContent")
        joined = NODES - len(LOST)
        assert counts == f"5,000 nodes: {joined:,} joined, {len(LOST)} lost, {len(CORDONED)} cordoned", counts
        options = await tab.evaluate("[...document.getElementById('state-filter').options].map((o) => o.textContent)")
        assert options == [
            "all (5,000)",
            f"joined ({joined:,})",
            "joining (0)",
            f"lost ({len(LOST)})",
            "unknown (0)",
            f"cordoned ({len(CORDONED)})",
            "draining (0)",
        ]
        assert await unlabelled_controls(tab) == []
        assert await contrast_failures(tab) == []
        out = report_dir()
        wide = await tab.screenshot(out / "cluster-page-5000-nodes-1280x800.png", 1280, 800)
        # A phone: each row a card, all of one height; the end of the list is still the last node.
        phone = await tab.screenshot(out / "cluster-page-5000-nodes-390x844.png", 390, 844, mobile=True)
        print(f"screenshots: {wide} {phone}")
        assert await tab.evaluate("document.documentElement.scrollWidth") <= 390
        await scroll_to_end_shows_the_last_node(tab)
        await tab.viewport(1280, 800)

        await scroll_to_end_shows_the_last_node(tab)

        # The state filter, from the keyboard: lost ones only.
        await choose_state(tab, "lost")
        await tab.wait_for("document.getElementById('node-counts').textContent.endsWith('; showing 50')")
        ids = await shown_ids(tab)  # those in view of the 50
        assert len(ids) >= 10 and ids == sorted(LOST)[: len(ids)]
        assert set(
            await tab.evaluate("[...document.querySelectorAll('#nodes [data-node]')].map((r) => r.dataset.state)")
        ) == {"lost"}
        # The lost ones say since when they are silent; the warnings name a few and the count.
        heard = await tab.evaluate(
            f"document.querySelector('#node-{sorted(LOST)[0]} td[data-label=Heartbeat]').innerText"
        )
        assert heard.endswith("min ago") or heard.endswith("h ago"), heard
        warned = await tab.evaluate("document.getElementById('warnings-list').innerText")
        assert f"{len(LOST)} nodes are lost" in warned

        # The name filter, typed, with the state filter back to all.
        await choose_state(tab, "")
        await type_into(tab, "node-filter", "node-0123")
        await tab.wait_for("document.getElementById('node-counts').textContent.endsWith('; showing 10')")
        assert await shown_ids(tab) == [agents_load.node_id(i) for i in range(1230, 1240)]
        assert await tab.evaluate("document.activeElement.id") == "node-filter"  # typing kept its place

        # A change through the admin API (`llmgw ctl cordon`) reaches the open page, by itself.
        target = agents_load.node_id(1234)
        assert await tab.evaluate(f"document.getElementById('node-{target}').dataset.state") == "joined"
        changed = time.monotonic()
        await trio.to_thread.run_sync(client.cordon, target, True)
        await tab.wait_for(f"document.getElementById('node-{target}').dataset.state === 'cordoned'", LIVE_S)
        print(f"a cordon reached the open page in {time.monotonic() - changed:.2f} s")
        await tab.wait_for(
            f"document.getElementById('state-filter').options[5].textContent === 'cordoned ({len(CORDONED) + 1})'"
        )
        assert await tab.evaluate("window.notReloaded") is True
        # Its details, from the keyboard: its name is a link to everything the row cuts short.
        await tab.evaluate(f"document.getElementById('details-{target}').focus()")
        await tab.key("Enter")
        await tab.wait_for("document.getElementById('node-details').open")
        details = await tab.evaluate("document.getElementById('node-details-body').innerText")
        assert "8 × NVIDIA H100 80GB HBM3" in details and "ib-2: mlx5_0" in details, details
        await tab.key("Escape")
        await tab.wait_for("!document.getElementById('node-details').open")
        assert await tab.evaluate("document.activeElement.id") == f"details-{target}"
        no_console_errors(tab)
