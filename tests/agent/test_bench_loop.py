"""When the agent measures (agent.bench.serve_bench), on trio's MockClock with a stand-in for the
measurement: once llama.cpp is checked, again at a new version or when the control plane asks
(DesiredState.bench), never while the replicas are busy (waiting, then measured once idle), a
failure reported with its reason and the last figures kept; the devices llama-server lists are
measured each as its backend. Where the want says `measure_speed = false`, only when asked."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.testing

from agent import bench as b
from agent import benchmodel
from agent.engines import Engines
from llmgw.wakeup import Wakeup
from llmgw.wire import agent_link as w

GPU_LIST = "Available devices:\n  CUDA0: NVIDIA L4 (22491 MiB, 22000 MiB free)\n  CUDA1: NVIDIA L4 (22491 MiB, 22000 MiB free)\n"


def test_the_backends_are_the_cpu_and_the_first_device_of_each_gpu_backend() -> None:
    assert b.backends("Available devices:\n  (none)\n") == [("cpu", "")]
    assert b.backends(GPU_LIST + "  Vulkan0: llvmpipe (LLVM 15.0.7, 256 bits) (7923 MiB, 7923 MiB free)\n") == [
        ("cpu", ""),
        ("cuda", "CUDA0"),
        ("vulkan", "Vulkan0"),
    ]


def test_the_figures_are_llama_servers_timings_and_nothing_else() -> None:
    body = b'{"content":"x","timings":{"prompt_per_second":850.5,"predicted_per_second":42.0}}'
    assert b.figures(body) == (850.5, 42.0)
    for bad in (b"{}", b"not json", b'{"timings":{"prompt_per_second":0,"predicted_per_second":1}}'):
        with pytest.raises(b.BenchFailed):
            b.figures(bad)


class Harness:
    def __init__(self, tmp_path: Path, *, measure_speed: bool = True) -> None:
        self.engines = Engines()
        # What the control plane wants of llama.cpp (llmgw.engines.wants), server.toml's measure_speed in it.
        self.wants = (w.EngineWant(name="llamacpp", version="b11434", measure_speed=measure_speed),)
        self.desired: w.DesiredState | None = w.DesiredState(generation=1, engines=self.wants)
        self.changed = Wakeup()
        self.sent: list[tuple[w.BackendSpeed, ...]] = []
        self.measured: list[tuple[str, str]] = []
        self.busy_for = 0  # answers "busy" this many more times
        self.fail_next = False
        self.devices = ""
        self.bench = b.Bench(
            directory=tmp_path,
            busy=self.busy,
            measure=self.measure,
            list_devices=self.list,
            model=self.model,
            clock=trio.current_time,
        )

    async def model(self, directory: Path) -> Path:
        # Written here, not in a thread: MockClock would jump over the thread's real time.
        return benchmodel.ensure(directory)

    async def busy(self) -> str:
        await trio.sleep(b.BUSY_SAMPLE_S)
        if self.busy_for:
            self.busy_for -= 1
            return "its replicas are busy (1.5 cores)"
        return ""

    async def list(self, executable: str) -> str:
        return self.devices

    async def measure(self, executable, model, backend, device, log_path) -> tuple[float, float]:
        assert model.is_file()
        await trio.sleep(2.0)
        self.measured.append((executable, backend))
        if self.fail_next:
            self.fail_next = False
            raise b.BenchFailed("llama-server exited with 1 before it served")
        return (800.0, 40.0) if backend == "cpu" else (9000.0, 300.0)

    async def send(self, message: w.AgentMessage) -> bool:
        assert isinstance(message, w.SpeedsChanged)
        self.sent.append(message.speeds)
        return True

    def install(self, version: str, executable: str = "/opt/llama/llama-server") -> None:
        self.engines.statuses["llamacpp"] = w.EngineStatus(name="llamacpp", version=version, ok=True, state="ok")
        self.engines.executables["llamacpp"] = executable

    def ask(self, token: str) -> None:
        self.desired = w.DesiredState(generation=2, engines=self.wants, bench=token)
        self.changed.fire()

    def last(self) -> dict[str, w.BackendSpeed]:
        return {s.backend: s for s in self.sent[-1]}

    async def serve(self, nursery: trio.Nursery) -> None:
        await nursery.start(b.serve_bench, self.bench, self.engines, lambda: self.desired, self.changed.wait, self.send)


async def _measured_when_checked_again_when_asked_or_changed(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    async with trio.open_nursery() as nursery:
        await h.serve(nursery)
        await trio.sleep(60)
        assert h.sent == [] and h.measured == []  # no llama.cpp yet: nothing to measure
        h.install("b11434")
        await trio.sleep(b.LOOK_S + 5)
        assert h.measured == [("/opt/llama/llama-server", "cpu")]
        cpu = h.last()["cpu"]
        assert (cpu.state, cpu.prompt_tps, cpu.gen_tps, cpu.version, cpu.request) == ("ok", 800.0, 40.0, "b11434", "")
        await trio.sleep(600)
        assert len(h.measured) == 1  # measured: not again by itself
        h.ask("ask-1")
        await trio.sleep(5)
        assert len(h.measured) == 2 and h.last()["cpu"].request == "ask-1"
        h.ask("ask-1")  # the same request again (a reconnect resends the desired state): answered already
        await trio.sleep(60)
        assert len(h.measured) == 2
        # A new version with a GPU build: each backend, the failed one saying why, its old figures gone.
        h.devices = GPU_LIST
        h.fail_next = True
        h.install("b11500")
        await trio.sleep(b.LOOK_S + 10)
        assert h.measured[2:] == [("/opt/llama/llama-server", "cpu"), ("/opt/llama/llama-server", "cuda")]
        cpu, cuda = h.last()["cpu"], h.last()["cuda"]
        assert (cpu.state, cpu.detail, cpu.gen_tps, cpu.version) == (
            "failed",
            "llama-server exited with 1 before it served",
            0.0,
            "b11500",
        )
        assert (cuda.state, cuda.device, cuda.gen_tps) == ("ok", "CUDA0", 300.0)
        # llama.cpp no longer offered here: no speeds.
        del h.engines.statuses["llamacpp"]
        await trio.sleep(b.LOOK_S + 1)
        assert h.sent[-1] == ()
        nursery.cancel_scope.cancel()


def test_measured_when_checked_again_when_asked_or_changed(tmp_path: Path) -> None:
    trio.run(
        _measured_when_checked_again_when_asked_or_changed, tmp_path, clock=trio.testing.MockClock(autojump_threshold=0)
    )


async def _measure_speed_false_measures_only_when_asked(tmp_path: Path) -> None:
    h = Harness(tmp_path, measure_speed=False)
    async with trio.open_nursery() as nursery:
        await h.serve(nursery)
        h.install("b11434")
        await trio.sleep(600)
        assert h.measured == [] and h.sent == []  # installed and checked: not measured, nothing reported
        h.install("b11500")  # nor at a new version
        await trio.sleep(600)
        assert h.measured == [] and h.sent == []
        h.ask("ask-1")  # `llmgw ctl nodes bench`
        await trio.sleep(5)
        assert h.measured == [("/opt/llama/llama-server", "cpu")]
        cpu = h.last()["cpu"]
        assert (cpu.state, cpu.gen_tps, cpu.version, cpu.request) == ("ok", 40.0, "b11500", "ask-1")
        h.install("b11600")  # answered; a new version is still not measured by itself
        await trio.sleep(600)
        assert len(h.measured) == 1
        h.ask("ask-2")
        await trio.sleep(5)
        assert len(h.measured) == 2 and h.last()["cpu"].version == "b11600"
        nursery.cancel_scope.cancel()


def test_measure_speed_false_measures_only_when_asked(tmp_path: Path) -> None:
    trio.run(
        _measure_speed_false_measures_only_when_asked, tmp_path, clock=trio.testing.MockClock(autojump_threshold=0)
    )


async def _not_by_itself_before_a_desired_state_wants_llama_cpp(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.desired = None  # none yet: it may say measure_speed = false
    h.install("b11434")
    async with trio.open_nursery() as nursery:
        await h.serve(nursery)
        await trio.sleep(600)
        assert h.measured == []
        h.desired = w.DesiredState(generation=1, engines=h.wants)
        h.changed.fire()
        await trio.sleep(5)
        assert h.measured == [("/opt/llama/llama-server", "cpu")]
        nursery.cancel_scope.cancel()


def test_not_by_itself_before_a_desired_state_wants_llama_cpp(tmp_path: Path) -> None:
    trio.run(
        _not_by_itself_before_a_desired_state_wants_llama_cpp,
        tmp_path,
        clock=trio.testing.MockClock(autojump_threshold=0),
    )


async def _never_while_the_replicas_are_busy(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.install("b11434")
    h.busy_for = 3
    async with trio.open_nursery() as nursery:
        await h.serve(nursery)
        await trio.sleep(2 * b.BUSY_RETRY_S)
        assert h.measured == []
        assert [(s.backend, s.state, s.detail) for s in h.sent[-1]] == [
            ("cpu", "waiting", "its replicas are busy (1.5 cores)")
        ]
        assert len(h.sent) == 1  # told once while it waits, not at every look
        await trio.sleep(2 * b.BUSY_RETRY_S)
        assert h.measured == [("/opt/llama/llama-server", "cpu")] and h.last()["cpu"].state == "ok"
        # Busy when asked again: the figures measured stay in the report while it waits.
        h.busy_for = 1
        h.ask("ask-2")
        await trio.sleep(5)
        waiting = h.last()["cpu"]
        assert (waiting.state, waiting.gen_tps, waiting.request) == ("waiting", 40.0, "ask-2")
        await trio.sleep(b.BUSY_RETRY_S + 5)
        assert len(h.measured) == 2 and h.last()["cpu"].state == "ok"
        nursery.cancel_scope.cancel()


def test_never_while_the_replicas_are_busy(tmp_path: Path) -> None:
    trio.run(_never_while_the_replicas_are_busy, tmp_path, clock=trio.testing.MockClock(autojump_threshold=0))


async def _busy_is_the_replicas_cpu_time() -> None:
    assert await b.replicas_busy(lambda: []) == ""
    assert await b.replicas_busy(lambda: [0]) == ""  # a member not started yet has no process


def test_no_replicas_is_not_busy() -> None:
    trio.run(_busy_is_the_replicas_cpu_time)
