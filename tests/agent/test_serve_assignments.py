"""Every desired state reaches the supervisor, even one that arrives while the last one's
downloaded files are being collected (the loop then reads it without waiting for another)."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace

import pytest
import trio

from agent.replica_supervisor import serve_assignments
from llmgw.wakeup import Wakeup
from llmgw.wire import agent_link as w

pytestmark = pytest.mark.trio


def assignment(replica_id: str) -> w.ReplicaAssignment:
    return w.ReplicaAssignment(replica_id=replica_id, model="m", engine="sim", api_key="k", nodes=("n",))


async def test_a_state_arriving_during_collect_is_applied() -> None:
    assigned: list[tuple[str, ...]] = []
    release = trio.Event()
    collecting = trio.Event()

    class Weights:
        async def collect(self, keep: set[str], using: Sequence[w.WeightsSource]) -> list[str]:
            collecting.set()
            await release.wait()
            return []

    supervisor = SimpleNamespace(
        assign=lambda replicas: assigned.append(tuple(a.replica_id for a in replicas)),
        life=SimpleNamespace(weights=Weights()),
    )
    current: list[w.DesiredState | None] = [None]
    changed = Wakeup()

    def arrive(state: w.DesiredState) -> None:  # what the link does with each one
        current[0] = state
        changed.fire()

    async with trio.open_nursery() as nursery:
        await nursery.start(serve_assignments, supervisor, lambda: current[0], changed.wait)
        arrive(w.DesiredState(generation=1, replicas=(assignment("a-0"),), keep_files=()))
        await collecting.wait()
        arrive(w.DesiredState(generation=2, replicas=(assignment("a-0"), assignment("b-0")), keep_files=()))
        release.set()
        with trio.fail_after(5):
            while assigned[-1:] != [("a-0", "b-0")]:
                await trio.sleep(0)
        nursery.cancel_scope.cancel()
    assert assigned == [("a-0",), ("a-0", "b-0")]
