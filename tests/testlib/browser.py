"""A real headless Chromium driven over the DevTools protocol, for tests of the cluster page.

Debian's `chromium` (tools/testenv/prepare.py installs it) with `--remote-debugging-port=0`: the
browser writes the port it chose to DevToolsActivePort in its profile directory, and the test
speaks the protocol (JSON over a WebSocket, https://chromedevtools.github.io/devtools-protocol/)
with trio-websocket, already a dependency. No WebDriver client, nothing downloaded.

`Chromium` is the process (one per test module); `open_tab` gives a `Tab`, its own page with
its own cookies' view, attached in "flatten" mode so one WebSocket carries the browser's and
the page's messages. Each tab records what the page printed to its console and every script
error and failed load, for the tests to assert there were none. At the end, what every test of
the cluster page checks (no console error, contrast, labelled controls) and where its
screenshots go.

The flags: as root Chromium needs --no-sandbox; this machine's network is closed, so Chromium's
own background traffic (component updates, sync, safe browsing) is turned off rather than left
to fail noisily.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from trio_websocket import open_websocket_url

from testlib.proc import build_root

START_TIMEOUT_S = 30.0
COMMAND_TIMEOUT_S = 30.0
FLAGS = (
    "--headless",
    "--remote-debugging-port=0",
    "--remote-debugging-address=127.0.0.1",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--disable-default-apps",
    "--metrics-recording-only",
    "--safebrowsing-disable-auto-update",
    "--password-store=basic",
    "--use-mock-keychain",
    "--hide-scrollbars",
    "--font-render-hinting=none",
)
KEYS = {"Tab": 9, "Enter": 13, "Escape": 27, " ": 32}


def chromium_binary() -> str:
    found = shutil.which("chromium")
    if not found:
        raise AssertionError("chromium is not installed: `apt-get install chromium` (tools/testenv/prepare.py does)")
    return found


class StartTimedOut(AssertionError):
    """Chromium ran but never said where it listens."""


START_ATTEMPTS = 2


class Chromium:
    """A headless Chromium with its own profile under `root`; `close()` ends it."""

    def __init__(self, root: Path) -> None:
        self.profile = root / "profile"
        self.profile.mkdir(parents=True, exist_ok=True)
        self.log = root / "chromium.log"
        # Started again once if it never says where it listens: on a loaded machine one start in a
        # CI run hung silently past the deadline (the next start of the same binary is prompt).
        for attempt in range(START_ATTEMPTS):
            self._start()
            try:
                self.ws_url = self._devtools_url()
                return
            except StartTimedOut:
                if attempt + 1 == START_ATTEMPTS:
                    raise

    def _start(self) -> None:
        (self.profile / "DevToolsActivePort").unlink(missing_ok=True)  # a profile used before: not its port
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [chromium_binary(), *FLAGS, f"--user-data-dir={self.profile}", "about:blank"],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def _devtools_url(self) -> str:
        active = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:  # bounded: the file appears once Chromium listens
            if self.proc.poll() is not None:
                raise AssertionError(f"chromium exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            lines = active.read_text().split("\n") if active.exists() else []
            if len(lines) >= 2 and lines[0].strip().isdigit() and lines[1].strip():
                return f"ws://127.0.0.1:{lines[0].strip()}{lines[1].strip()}"
            time.sleep(0.05)
        self.close()
        raise StartTimedOut(
            f"chromium did not write {active} within {START_TIMEOUT_S:g} s; its log:\n{self.log.read_text()[-3000:]}"
        )

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def version(self) -> str:
        return subprocess.run([chromium_binary(), "--version"], capture_output=True, text=True, timeout=30).stdout


@pytest.fixture(scope="module")
def chromium(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Chromium]:
    """One headless Chromium for a test module (import it into the module: a fixture)."""
    browser = Chromium(tmp_path_factory.mktemp("chromium"))
    try:
        yield browser
    finally:
        browser.close()


class DevToolsError(Exception):
    """Chromium answered a DevTools call with an error, or a script the page ran threw."""


class Tab:
    def __init__(self, ws: Any, session_id: str) -> None:
        self.ws = ws
        self.session_id = session_id
        self._ids = itertools.count(1)
        self._waiting: dict[int, trio.MemorySendChannel] = {}
        self._event_waiters: list[tuple[str, trio.MemorySendChannel]] = []
        self.console: list[str] = []  # console.* calls, as "type: text"
        self.errors: list[str] = []  # uncaught exceptions, console.error, failed loads

    # -- the protocol ---------------------------------------------------------------------

    async def _send(self, method: str, params: dict[str, Any] | None, session: str | None) -> Any:
        msg_id = next(self._ids)
        send, receive = trio.open_memory_channel(1)
        self._waiting[msg_id] = send
        message = {"id": msg_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        await self.ws.send_message(json.dumps(message))
        with trio.fail_after(COMMAND_TIMEOUT_S):
            reply = await receive.receive()
        if "error" in reply:
            raise DevToolsError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    async def call(self, method: str, **params: Any) -> Any:
        return await self._send(method, params, self.session_id)

    async def serve_reader(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            message = json.loads(await self.ws.get_message())
            if "id" in message:
                channel = self._waiting.pop(message["id"], None)
                if channel is not None:
                    channel.send_nowait(message)
                continue
            self._record(message)
            for name, channel in list(self._event_waiters):
                if name == message.get("method"):
                    self._event_waiters.remove((name, channel))
                    channel.send_nowait(message.get("params", {}))

    def _record(self, message: dict[str, Any]) -> None:
        method, params = message.get("method"), message.get("params", {})
        if method == "Runtime.consoleAPICalled":
            text = " ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", []))
            self.console.append(f"{params['type']}: {text}")
            if params["type"] in ("error", "assert"):
                self.errors.append(f"console.{params['type']}: {text}")
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            self.errors.append(f"uncaught: {details.get('exception', {}).get('description') or details.get('text')}")
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            entry = params["entry"]
            self.errors.append(f"log: {entry.get('text')} {entry.get('url', '')}".strip())

    def expect_event(self, method: str) -> trio.MemoryReceiveChannel:
        """Register before the action that causes it; then `await channel.receive()`."""
        send, receive = trio.open_memory_channel(1)
        self._event_waiters.append((method, send))
        return receive

    # -- what tests do --------------------------------------------------------------------

    async def goto(self, url: str, timeout_s: float = COMMAND_TIMEOUT_S) -> None:
        loaded = self.expect_event("Page.loadEventFired")
        await self.call("Page.navigate", url=url)
        with trio.fail_after(timeout_s):
            await loaded.receive()

    async def evaluate(self, expression: str, timeout_s: float = COMMAND_TIMEOUT_S) -> Any:
        with trio.fail_after(timeout_s):
            result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise DevToolsError(f"{expression[:80]}...: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, predicate: str, timeout_s: float = 20.0) -> Any:
        """Until the JavaScript expression `predicate` is truthy, re-checked on each change of the
        document (a MutationObserver: no polling); its value."""
        script = f"""new Promise((resolve) => {{
            const check = () => {{
                let v;
                try {{ v = ({predicate}); }} catch (e) {{ v = undefined; }}
                if (v) {{ observer.disconnect(); resolve(v); }}
            }};
            const observer = new MutationObserver(check);
            observer.observe(document, {{subtree: true, childList: true, attributes: true, characterData: true}});
            check();
        }})"""
        try:
            return await self.evaluate(script, timeout_s=timeout_s)
        except trio.TooSlowError:
            text = await self.evaluate("document.body ? document.body.innerText.slice(0, 3000) : ''")
            raise AssertionError(f"waited {timeout_s:g} s for {predicate}; the page says:\n{text}") from None

    async def key(self, key: str) -> None:
        """A real key press, as the keyboard sends it (focus moves on Tab, buttons fire on Enter)."""
        code = KEYS[key]
        common = {"key": key, "windowsVirtualKeyCode": code, "nativeVirtualKeyCode": code}
        if key == "Enter":
            common["text"] = "\r"
        await self.call("Input.dispatchKeyEvent", type="keyDown" if "text" in common else "rawKeyDown", **common)
        await self.call("Input.dispatchKeyEvent", type="keyUp", **{k: v for k, v in common.items() if k != "text"})

    async def viewport(self, width: int, height: int, *, mobile: bool = False) -> None:
        await self.call(
            "Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=mobile
        )

    async def screenshot(self, path: Path, width: int, height: int, *, mobile: bool = False) -> Path:
        await self.viewport(width, height, mobile=mobile)
        shot = await self.call("Page.captureScreenshot", format="png")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(shot["data"]))
        return path


@contextlib.asynccontextmanager
async def open_tab(browser: Chromium, width: int = 1280, height: int = 800) -> AsyncIterator[Tab]:
    async with open_websocket_url(browser.ws_url, max_message_size=64 << 20, message_queue_size=64) as ws:
        bootstrap = Tab(ws, "")
        async with trio.open_nursery() as nursery:
            await nursery.start(bootstrap.serve_reader)
            # A new browser context per tab: its own cookies, as a fresh browser profile has.
            context = (await bootstrap._send("Target.createBrowserContext", {}, None))["browserContextId"]
            target = await bootstrap._send(
                "Target.createTarget", {"url": "about:blank", "browserContextId": context}, None
            )
            attached = await bootstrap._send(
                "Target.attachToTarget", {"targetId": target["targetId"], "flatten": True}, None
            )
            bootstrap.session_id = attached["sessionId"]
            tab = bootstrap
            for domain in ("Page", "Runtime", "Log", "Network"):
                await tab.call(f"{domain}.enable")
            await tab.viewport(width, height)
            try:
                yield tab
            finally:
                with trio.move_on_after(5) as cleanup:
                    cleanup.shield = True
                    await tab._send("Target.disposeBrowserContext", {"browserContextId": context}, None)
                nursery.cancel_scope.cancel()


# -- what every test of the cluster page checks ---------------------------------------------


def report_dir() -> Path:
    """Where screenshots go: $LLMGW_TEST_REPORTS (pants.toml sets it to dist/test/reports in the
    checkout, outside Pants' sandbox), else dist/test/reports under the build root."""
    root = Path(os.environ.get("LLMGW_TEST_REPORTS") or build_root() / "dist" / "test" / "reports")
    out = root / "cluster-page"
    out.mkdir(parents=True, exist_ok=True)
    return out


def no_console_errors(tab: Tab) -> None:
    assert tab.errors == [], f"the browser's console: {tab.errors}"


async def contrast_failures(tab: Tab) -> list[str]:
    """Each visible text element whose text on its background is below 4.5:1 (WCAG 2 AA)."""
    return await tab.evaluate(
        """(() => {
        const rgb = (s) => (s.match(/[\\d.]+/g) || []).map(Number);
        const lum = ([r, g, b]) => {
            const f = (c) => { c /= 255; return c <= 0.03928 ? c / 12.92 : ((c + 0.055) / 1.055) ** 2.4; };
            return 0.2126 * f(r) + 0.7152 * f(g) + 0.0722 * f(b);
        };
        const background = (el) => {
            for (; el; el = el.parentElement) {
                const c = rgb(getComputedStyle(el).backgroundColor);
                if (c.length === 3 || (c.length === 4 && c[3] > 0.5)) return c.slice(0, 3);
            }
            return [255, 255, 255];
        };
        const bad = [];
        for (const el of document.querySelectorAll('body *')) {
            const own = [...el.childNodes].some((n) => n.nodeType === 3 && n.textContent.trim());
            if (!own || !el.getClientRects().length || el.closest('[hidden], dialog:not([open]), .sr-only')) continue;
            const fg = rgb(getComputedStyle(el).color).slice(0, 3), bg = background(el);
            const [a, b] = [lum(fg), lum(bg)].sort((x, y) => y - x);
            const ratio = (a + 0.05) / (b + 0.05);
            if (ratio < 4.5) bad.push(`${el.tagName}.${el.className} "${el.textContent.trim().slice(0, 30)}" ${ratio.toFixed(2)}`);
        }
        return bad;
    })()"""
    )


async def unlabelled_controls(tab: Tab) -> list[str]:
    """Buttons, links and images without an accessible name; sections without a heading."""
    return await tab.evaluate(
        """(() => {
        const bad = [];
        for (const el of document.querySelectorAll('button, a[href], svg, progress, input, select, textarea')) {
            const labelled = el.getAttribute('aria-label') || el.textContent.trim() ||
                (el.id && document.querySelector(`label[for="${el.id}"]`));
            if (!labelled) bad.push(el.outerHTML.slice(0, 80));
            if (el.tagName === 'svg' && el.getAttribute('role') !== 'img') bad.push('svg without role=img');
        }
        for (const s of document.querySelectorAll('section')) {
            if (!s.querySelector('h2')) bad.push(`section#${s.id} has no heading`);
        }
        if (!document.documentElement.lang) bad.push('no lang on <html>');
        return bad;
    })()"""
    )
