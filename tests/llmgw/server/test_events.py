"""The cluster page's live feed on a fake plane and trio's MockClock: a snapshot at once, one per
burst of changes, a heartbeat when quiet, and an end when the session does."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio
import trio.testing

from llmgw.fabrics import FabricMap
from llmgw.server import events


class FakePlane:
    def __init__(self) -> None:
        self.builds = 0
        self.cordoned = False
        self._rotation = trio.Event()
        self._cluster = trio.Event()

    def fabric_map(self) -> FabricMap:
        return FabricMap(fabrics=(), notes=("a note",))

    def node_views(self) -> list[dict[str, Any]]:
        self.builds += 1
        return [{"id": "n1", "cordoned": self.cordoned, "cpu": {"model": "Common KVM processor", "flags": []}}]

    def replica_views(self) -> list[dict[str, Any]]:
        return []

    def model_views(self) -> list[dict[str, Any]]:
        return []

    def rotation_changed(self) -> trio.Event:
        return self._rotation

    def cluster_changed(self) -> trio.Event:
        return self._cluster

    def touch(self) -> None:
        self._rotation.set()
        self._rotation = trio.Event()


def parse(frame: bytes) -> tuple[str, Any]:
    lines = frame.decode().strip().split("\n")
    if lines[0].startswith(":"):
        return "comment", lines[0]
    if lines[0].startswith("retry:"):
        return "retry", lines[0]
    return lines[0].removeprefix("event: "), json.loads(lines[1].removeprefix("data: "))


@pytest.mark.trio
async def test_a_snapshot_at_once_then_one_per_burst_then_heartbeats(autojump_clock: trio.testing.MockClock) -> None:
    plane = FakePlane()
    feed = events.stream(plane)
    assert parse(await feed.__anext__())[0] == "retry"
    kind, first = parse(await feed.__anext__())
    assert kind == "cluster" and first["notes"] == ["a note"] and first["nodes"][0]["cpu_warning"]
    started = trio.current_time()
    for _ in range(10):  # a burst: one snapshot, no sooner than MIN_INTERVAL_S after the last
        plane.cordoned = True
        plane.touch()
    kind, second = parse(await feed.__anext__())
    assert kind == "cluster" and second["nodes"][0]["cordoned"] is True
    assert trio.current_time() - started >= events.MIN_INTERVAL_S and plane.builds == 2
    quiet = trio.current_time()
    assert parse(await feed.__anext__()) == ("comment", ": heartbeat")
    assert trio.current_time() - quiet == pytest.approx(events.HEARTBEAT_S)
    await feed.aclose()


@pytest.mark.trio
async def test_the_feed_ends_with_the_session(autojump_clock: trio.testing.MockClock) -> None:
    plane = FakePlane()
    feed = events.stream(plane, session_expires_at=trio.current_time() + 40)
    await feed.__anext__()
    await feed.__anext__()
    frames = [parse(f) async for f in feed]
    assert frames[:2] == [("comment", ": heartbeat"), ("comment", ": heartbeat")]
    assert frames[-1][0] == "expired" and "llmgw ctl page" in frames[-1][1]["detail"]
    assert trio.current_time() == pytest.approx(40)


def test_the_cpu_warning_is_doctors_for_a_generic_virtual_cpu() -> None:
    fast = {"model": "AMD EPYC 7763", "flags": ["fpu", "sse2", "sse4_2", "avx", "avx2", "fma"]}
    assert events.cpu_warning(fast) == "" and events.cpu_warning(None) == ""
    assert events.cpu_warning({"model": "Neoverse-N1", "flags": ["asimd"]}) == ""  # not x86: no AVX to lack
    kvm = events.cpu_warning({"model": "Common KVM processor", "flags": ["fpu", "sse2"]})
    assert "generic virtual CPU 'Common KVM processor' (no sse4.2, avx, avx2, fma)" in kvm
    assert "--cpu host" in kvm
    assert "no avx2, fma" in events.cpu_warning({"model": "Xeon", "flags": ["sse2", "sse4_2", "avx"]})
