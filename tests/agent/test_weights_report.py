"""What the weights cache tells the control plane (`held_now`, `serve_weights_report`), and the
models staged here downloaded with nothing run (`serve_staging`), against testlib.hubserver."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from agent.weights import WeightsStore
from agent.weights_report import held_now, serve_staging, serve_weights_report
from llmgw.wire import agent_link as w
from testlib.hubrepo import HubRepo
from testlib.hubrepos import weights_source as source
from testlib.hubserver import HubServer

pytestmark = pytest.mark.trio

SMALL = bytes(range(256)) * 64
BIG = b"0123456789abcdef" * 4096
REPO = "org/model-GGUF"


@pytest.fixture
def hub() -> Iterator[HubServer]:
    with HubServer([HubRepo(REPO, {"m-Q4_K_M.gguf": SMALL, "m-Q8_0.gguf": BIG})]) as server:
        yield server


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


async def test_held_now_says_what_is_whole_what_is_arriving_and_the_limit(tmp_path: Path, hub: HubServer) -> None:
    store = WeightsStore(tmp_path / "weights", limit_bytes=64 << 20)
    assert held_now(store) == w.WeightsHeld(
        files=(), cache_bytes=0, limit_bytes=64 << 20, free_bytes=held_now(store).free_bytes
    )
    await store.prepare(source(hub, REPO, "m-Q4_K_M.gguf"))
    part = tmp_path / "weights" / sha(BIG) / "m-Q8_0.gguf.part"
    part.parent.mkdir()
    part.write_bytes(BIG[:1000])
    held = held_now(store)
    assert {(f.sha256, f.size, f.complete) for f in held.files} == {
        (sha(SMALL), len(SMALL), True),
        (sha(BIG), 1000, False),
    }
    assert held.cache_bytes == len(SMALL) + 1000 and held.free_bytes > 0


async def test_a_change_is_reported_and_a_steady_cache_is_not(
    tmp_path: Path, hub: HubServer, autojump_clock: trio.abc.Clock
) -> None:
    store = WeightsStore(tmp_path / "weights")
    current = held_now(store)
    reports: list[w.WeightsHeld] = []
    whole = trio.Event()

    async def report(held: w.WeightsHeld) -> None:
        nonlocal current
        current = held
        reports.append(held)
        if any(f.complete for f in held.files):
            whole.set()

    async with trio.open_nursery() as nursery:
        await nursery.start(serve_weights_report, store, lambda: current, report)
        await trio.sleep(60)  # twelve looks at an unchanged cache
        assert reports == []
        await store.prepare(source(hub, REPO, "m-Q4_K_M.gguf"))
        await whole.wait()
        await trio.sleep(60)  # steady again: whatever the download's own reports, none more now
        settled = len(reports)
        await trio.sleep(60)
        assert len(reports) == settled
        nursery.cancel_scope.cancel()
    assert [(f.sha256, f.complete) for f in reports[-1].files] == [(sha(SMALL), True)]


async def test_a_staged_model_is_downloaded_and_nothing_else_happens(tmp_path: Path, hub: HubServer) -> None:
    store = WeightsStore(tmp_path / "weights")
    staged = source(hub, REPO, "m-Q4_K_M.gguf")
    broken = w.WeightsSource(
        repo=REPO,
        commit="0" * 40,
        files=(w.WeightsFile(path="nope.gguf", url=f"{hub.url}/x", sha256="1" * 64, size=3),),
    )
    state = w.DesiredState(generation=1, stage=(broken, staged))
    arrived = trio.Event()

    async def changed() -> None:
        arrived.set()  # the loop went through the list and waits for the next state
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        await nursery.start(serve_staging, store, lambda: state, changed)
        await arrived.wait()
        nursery.cancel_scope.cancel()
    # The broken one failed (logged), the next was still fetched; no replica, no engine.
    assert (tmp_path / "weights" / sha(SMALL) / "m-Q4_K_M.gguf").read_bytes() == SMALL
    assert [h.sha256 for h in store.held() if h.complete] == [sha(SMALL)]
