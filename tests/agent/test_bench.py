"""The agent's bench against the real llama-server (testlib.llama: the suite's build, which these
tests need and fail without): the made model loads and answers, each backend's figures come from
llama-server's own timings and go out as SpeedsChanged; a llama-server that exits or hangs is a
failed measurement with its reason, within the bound, its process gone."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import attrs
import pytest
import trio

from agent import bench as b
from agent.engines import Engines
from llmgw.wire import agent_link as w
from testlib.llama import llama_server


def _engines(executable: str, version: str = "b11434") -> Engines:
    engines = Engines()
    engines.statuses[b.ENGINE] = w.EngineStatus(name=b.ENGINE, version=version, ok=True, state=w.ENGINE_OK)
    engines.executables[b.ENGINE] = executable
    return engines


async def _idle() -> str:
    return ""


@pytest.mark.trio
async def test_llama_cpp_is_measured_on_the_made_model_and_reported(tmp_path: Path) -> None:
    sent: list[w.AgentMessage] = []

    async def send(message: w.AgentMessage) -> bool:
        sent.append(message)
        return True

    bench = b.Bench(directory=tmp_path, busy=_idle, clock=lambda: 1700000000.0)
    engines = _engines(llama_server())
    due = bench.due(engines, w.DesiredState(generation=1, bench="ask-1"))
    assert due == b.Due(version="b11434", executable=llama_server(), request="ask-1")
    await bench.run(due, send)

    # This machine's llama.cpp lists no GPU: the CPU backend alone, measuring then measured.
    assert [tuple(s.state for s in m.speeds) for m in sent] == [(w.SPEED_MEASURING,), (w.SPEED_OK,)]
    (speed,) = sent[-1].speeds
    assert (speed.engine, speed.backend, speed.device, speed.version) == ("llamacpp", "cpu", "", "b11434")
    assert speed.prompt_tps > 0 and speed.gen_tps > 0, speed
    assert (speed.request, speed.measured_at, speed.detail) == ("ask-1", 1700000000.0, "")
    # Measured: nothing is due until the engine changes or the control plane asks again.
    assert bench.due(engines, w.DesiredState(generation=2, bench="ask-1")) is None
    assert bench.due(engines, w.DesiredState(generation=3, bench="ask-2")) is not None
    newer = _engines(llama_server(), version="b11500")
    want = w.EngineWant(name=b.ENGINE, version="b11500")
    assert bench.due(newer, w.DesiredState(generation=4, bench="ask-1", engines=(want,))) is not None
    # measure_speed = false: a new version is measured only when asked.
    quiet = (attrs.evolve(want, measure_speed=False),)
    assert bench.due(newer, w.DesiredState(generation=4, bench="ask-1", engines=quiet)) is None
    assert bench.due(newer, w.DesiredState(generation=5, bench="ask-3", engines=quiet)) is not None
    log = (tmp_path / "llama-server-cpu.log").read_text()
    assert "prompt eval time" in log or "print_timing" in log, log[-2000:]


def _script(tmp_path: Path, body: str) -> str:
    path = tmp_path / "fake-llama-server"
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


@pytest.mark.trio
async def test_a_llama_server_that_exits_is_a_failed_measurement_saying_why(tmp_path: Path) -> None:
    executable = _script(tmp_path, 'echo "error: no usable CPU backend" >&2; exit 3')
    with trio.fail_after(30):
        try:
            await b.measure(executable, tmp_path / "m.gguf", "cpu", "", tmp_path / "log")
        except b.BenchFailed as exc:
            said = str(exc)
    assert "exited with 3 before it served" in said and "no usable CPU backend" in said, said


@pytest.mark.trio
async def test_a_llama_server_that_never_serves_is_stopped_at_the_bound(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    executable = _script(tmp_path, f'echo $$ > {pid_file}; echo "loading forever"; exec sleep 600')
    with trio.fail_after(30):
        try:
            await b.measure(executable, tmp_path / "m.gguf", "cpu", "", tmp_path / "log", timeout_s=1.0)
        except b.BenchFailed as exc:
            said = str(exc)
    assert "did not finish within 1 s" in said and "loading forever" in said, said
    pid = int(pid_file.read_text())
    try:
        os.kill(pid, 0)
        alive = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except ProcessLookupError:
        alive = False
    assert not alive, "the bench left its llama-server running"
