"""Install progress on the link: throttled to one report a second, a new phase at once, the
installer never blocked; while an engine installs it is pending (or, for an upgrade, still
offered), and the outcome replaces the progress. Fake clock, a fake installer, no sockets."""

from __future__ import annotations

import attrs
import pytest
import trio
from trio.testing import MockClock

from agent import engines as agent_engines
from agent.engines import Engines, EngineUnavailable, installing
from agent.install.installer import Installed
from agent.progress import Latest, Throttle, serve_progress
from llmgw.config import AgentConfig
from llmgw.errors import MachineError
from llmgw.wire import agent_link as w


def test_the_throttle_holds_a_phase_for_a_second_and_lets_a_new_one_through() -> None:
    t = Throttle(interval_s=1.0)
    assert t.delay("build", 10.0) == 0.0  # nothing sent yet
    t.sent("build", 10.0)
    assert t.delay("build", 10.25) == 0.75
    assert t.delay("build", 11.5) == 0.0
    assert t.delay("check", 10.25) == 0.0  # a new phase is news at once


def run(script, *, interval_s: float = 1.0) -> list[tuple[float, str, int | None]]:
    """Feed `script` [(at, phase, percent)] to serve_progress; what it reported, when."""
    got: list[tuple[float, str, int | None]] = []

    async def report(phase: str, percent: int | None) -> None:
        got.append((trio.current_time(), phase, percent))

    async def main() -> None:
        latest = Latest()
        async with trio.open_nursery() as nursery:
            await nursery.start(
                lambda task_status: serve_progress(latest, report, interval_s=interval_s, task_status=task_status)
            )
            start = trio.current_time()
            for at, phase, percent in script:
                await trio.sleep_until(start + at)
                latest.note(phase, percent)  # synchronous: the installer never waits here
            await trio.sleep(5)
            nursery.cancel_scope.cancel()

    trio.run(main, clock=MockClock(autojump_threshold=0))
    return got


def test_a_build_reporting_every_70_ms_is_sent_once_a_second() -> None:
    script = [(0.0, "fetch", None)] + [(0.07 * i, "build", i) for i in range(1, 44)] + [(3.5, "check", None)]
    got = run(script)
    phases = [p for _, p, _ in got]
    assert phases[0] == "fetch" and phases[-1] == "check"
    builds = [(t, pct) for t, p, pct in got if p == "build"]
    # The first build report goes out with the phase change, then at most one a second, the latest each time.
    assert builds[0] == (pytest.approx(0.07), 1)
    assert all(b[0] - a[0] >= 1.0 - 1e-9 for a, b in zip(builds, builds[1:], strict=False))
    assert [pct for _, pct in builds] == [1, 15, 29, 43]
    assert len(got) == 1 + 4 + 1


def test_a_phase_change_is_not_held_behind_the_throttle() -> None:
    got = run([(0.0, "install", None), (0.3, "check", None)])
    assert got == [(0.0, "install", None), (pytest.approx(0.3), "check", None)]


def test_nothing_new_sends_nothing() -> None:
    got = run([(0.0, "build", 50), (2.0, "build", 50)])
    assert got == [(0.0, "build", 50)]


def test_the_status_while_installing_keeps_an_engine_in_use_offered() -> None:
    want = w.EngineWant(name="vllm", version="0.33.0")
    fresh = installing(want, None, "install", None)
    assert (fresh.ok, fresh.state, fresh.phase, fresh.version) == (False, w.ENGINE_INSTALLING, "install", "0.33.0")
    in_use = w.EngineStatus(name="vllm", version="0.32.0", ok=True, state=w.ENGINE_OK)
    upgrade = installing(want, in_use, "install", None)
    assert (upgrade.ok, upgrade.version, upgrade.state, upgrade.detail) == (
        True,
        "0.32.0",
        w.ENGINE_INSTALLING,
        "installing 0.33.0",
    )
    engines = Engines(statuses={"vllm": fresh}, executables={})
    with pytest.raises(EngineUnavailable) as info:
        engines.command_for("vllm")
    assert info.value.pending and "being installed" in str(info.value)
    engines = Engines(statuses={"vllm": upgrade}, executables={"vllm": "/e/vllm/0.32.0/bin/vllm"})
    assert engines.command_for("vllm") == ("/e/vllm/0.32.0/bin/vllm",)


@attrs.define
class FakeStore:
    """An install that reports every `step_s` seconds, then succeeds or fails right after its last
    report, which the throttle is still holding then."""

    fails: bool = False
    step_s: float = 0.4
    in_use: str = ""

    async def ensure(self, wanted, *, mirror_url=None, on_progress=None) -> Installed:
        for phase, percent in (("configure", None), ("install", None), ("check", 10), ("check", 20)):
            await trio.sleep(self.step_s)
            on_progress(phase, percent)
        if self.fails:
            raise MachineError("pip could not install vllm==0.32.0")
        return Installed(name="vllm", version=wanted.version, executable="/e/vllm/bin/vllm", ok=True)


@pytest.mark.parametrize("fails", [False, True])
def test_reconcile_sends_progress_then_the_outcome_and_nothing_after(fails: bool) -> None:
    sent: list[tuple[float, tuple[w.EngineStatus, ...]]] = []
    engines = Engines()

    async def send(message: w.AgentMessage) -> bool:
        sent.append((trio.current_time(), message.engines))
        return True

    async def main() -> None:
        want = w.EngineWant(name="vllm", version="0.32.0", pip="vllm==0.32.0")
        state = w.DesiredState(generation=1, engines=(want,))
        inv = w.Inventory(hostname="n", os="linux", arch="x86_64", python="3.11", cpu_model="c", cpu_cores=1)
        config = AgentConfig(server="wss://127.0.0.1:1")
        await agent_engines._reconcile(config, engines, state, send, inv, FakeStore(fails=fails), "wss://127.0.0.1:1")
        await trio.sleep(5)  # a progress report left behind would arrive here

    trio.run(main, clock=MockClock(autojump_threshold=0))
    states = [(m[0].state, m[0].phase) for _, m in sent]
    assert states[:2] == [(w.ENGINE_INSTALLING, "configure"), (w.ENGINE_INSTALLING, "install")]
    assert (w.ENGINE_INSTALLING, "check") in states
    final = sent[-1][1][0]
    assert final.state == (w.ENGINE_FAILED if fails else w.ENGINE_OK) and final.ok is not fails
    assert final.phase == "" and final.percent is None
    # The outcome is the last word, sent when the install ended (1.6 s), though "check 20%" was
    # still held by the throttle then (due at 2.2 s).
    assert sent[-1][0] == pytest.approx(1.6)
    assert [(m[0].phase, m[0].percent) for _, m in sent[:-1]] == [("configure", None), ("install", None), ("check", 10)]
    assert engines.statuses["vllm"] == final
