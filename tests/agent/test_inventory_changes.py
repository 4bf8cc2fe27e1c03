"""The agent re-reads its node and reports real changes only (MockClock, a recording link)."""

from __future__ import annotations

import attrs
import pytest
import trio
import trio.testing

from agent.main import Current, serve_inventory
from llmgw.config import AgentConfig
from llmgw.wire import agent_link as w

pytestmark = pytest.mark.trio

BASE = w.Inventory(
    hostname="n", os="linux", arch="x86_64", python="3.11", cpu_model="c", cpu_cores=8, memory_available_bytes=1
)


class RecordingLink:
    def __init__(self) -> None:
        self.sent: list[w.AgentMessage] = []

    async def send(self, message: w.AgentMessage) -> bool:
        self.sent.append(message)
        return True


async def _next(readings):
    return next(readings)


async def test_only_stable_changes_are_sent(autojump_clock: trio.testing.MockClock) -> None:
    readings = iter(
        [
            attrs.evolve(BASE, memory_available_bytes=5, disk_free_bytes=9),  # volatile only: not sent
            attrs.evolve(BASE, cpu_cores=4),  # a real change: sent
            attrs.evolve(BASE, cpu_cores=4, memory_available_bytes=7),  # same again: not sent
        ]
    )
    link = RecordingLink()
    current = Current(inventory=BASE)
    async with trio.open_nursery() as nursery:
        await nursery.start(
            lambda task_status: serve_inventory(
                AgentConfig(server="wss://x:1"),
                current,
                link,
                interval_s=60,
                read=lambda: _next(readings),
                task_status=task_status,
            )
        )
        await trio.sleep(3 * 60 + 1)
        nursery.cancel_scope.cancel()
    assert [m.inventory.cpu_cores for m in link.sent] == [4]
    assert current.inventory.cpu_cores == 4
