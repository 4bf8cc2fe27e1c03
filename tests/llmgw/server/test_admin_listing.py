"""A listing's JSON encoded a slice at a time is byte for byte what one `json.dumps` makes, and
lets the loop run between slices (thousands of nodes are megabytes: tens of milliseconds)."""

from __future__ import annotations

import pytest
import trio

from llmgw.http.messages import Response
from llmgw.server.admin.api import ENCODE_SLICE, listing_json

pytestmark = pytest.mark.trio


class Steps(trio.abc.Instrument):
    def __init__(self) -> None:
        self.count = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.count += 1


@pytest.mark.parametrize("count", [0, 1, ENCODE_SLICE, ENCODE_SLICE + 1, 5 * ENCODE_SLICE + 7])
async def test_a_sliced_listing_is_the_one_json_would_write(count: int) -> None:
    items = [{"node_id": f"node-{i:05d}", "gpus": [{"name": "H100", "n": i}], "note": 'é\n"x"'} for i in range(count)]
    rest = {"next": None if count % 2 else "node-00003", "fabrics": [{"name": "ib-a", "nodes": ["a"]}], "notes": []}
    assert await listing_json("nodes", items, rest) == Response.json(200, {"nodes": items, **rest}).body
    assert await listing_json("nodes", items, {}) == Response.json(200, {"nodes": items}).body


async def test_the_loop_runs_between_slices() -> None:
    items = [{"i": i} for i in range(10 * ENCODE_SLICE)]
    steps = Steps()
    trio.lowlevel.add_instrument(steps)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(listing_json, "nodes", items, {})
            beside = 0
            for _ in range(5):  # a task beside it gets steps while it encodes
                await trio.lowlevel.checkpoint()
                beside += 1
    finally:
        trio.lowlevel.remove_instrument(steps)
    assert beside == 5 and steps.count >= 10 + 5
