"""How fast this node runs llama.cpp: each backend measured on the made model (agent.benchmodel)
and reported to the control plane (`w.SpeedsChanged`), which places llama.cpp replicas on the
faster nodes first (llmgw.server.state.scheduler).

When: once llama.cpp is installed and checked here (and again for each new version or binary),
and when the control plane asks (`DesiredState.bench`, from `llmgw ctl nodes bench`: a token not
answered yet). Where server.toml's [engines.llamacpp] says `measure_speed = false` (the want's
`measure_speed`), or before the first desired state says either way, only when asked. Never while this node's replicas are busy, as far as the agent can tell (their
engines used more than BUSY_CORES of CPU over BUSY_SAMPLE_S): the backend is reported `waiting`
and measured once they are idle, looked at again every BUSY_RETRY_S.

How, for each backend (`backends`: "cpu", then the first device of each GPU backend that
`llama-server --list-devices` lists, "cuda" for CUDA0): llama-server on the made model at the
lowest priority (nice 19), on 127.0.0.1 at a free port, one slot; once its /health answers, one
completion of PROMPT (about 128 tokens) generating N_PREDICT tokens whatever it predicts
(`ignore_eos`); llama-server's own `timings` of that answer (prompt_per_second,
predicted_per_second) are the figures; then it is stopped. All of it within TIMEOUT_S. A
measurement that goes wrong is reported `failed` with why (the end of llama-server's log, or what
did not answer); it never fails the node or its engine, and the figures of the one before, if any,
are kept in the report. Its log is bench/llama-server-BACKEND.log in the agent's state directory.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path

import attrs
import trio

from agent import benchmodel
from agent.engine_proc import call_engine, pick_port, probe_health, signal_group
from agent.engines import Engines
from llmgw.errors import LlmgwError
from llmgw.log import get_logger
from llmgw.wire import agent_link as w

log = get_logger("llmgw.agent.bench")

ENGINE = "llamacpp"
CPU = "cpu"
# Letters and spaces, which the made model's tokenizer takes a token each (a space joins the
# letter after it): 128 tokens with the BOS.
PROMPT = (
    "the quick brown fox jumps over the lazy dog while the old clock on the wall ticks on and the "
    "rain falls softly on the roof of the small house by the sea each day"
)
N_PREDICT = 32
CONTEXT = 512
TIMEOUT_S = 60.0  # a backend's whole measurement: start, load, the completion, the stop
STOP_TIMEOUT_S = 5.0  # SIGTERM to SIGKILL
LIST_TIMEOUT_S = 15.0  # `llama-server --list-devices`
NICE = 19
BUSY_CORES = 0.25  # the replicas' engines using more CPU than this: the node is busy
BUSY_SAMPLE_S = 1.0
BUSY_RETRY_S = 30.0
LOOK_S = 5.0  # how often the loop looks whether llama.cpp was installed (or changed) meanwhile
LOG_TAIL_LINES = 3
_DEVICE = re.compile(r"^\s+([A-Za-z][A-Za-z_-]*?)(\d+):", re.MULTILINE)


class BenchFailed(LlmgwError):
    """A measurement went wrong (the node's fault or llama-server's): the message says what and why."""


@attrs.frozen(kw_only=True)
class Due:
    """A measurement to make: of this engine version and executable, answering `request`."""

    version: str
    executable: str
    request: str


def backends(list_devices: str) -> list[tuple[str, str]]:
    """(backend, device) to measure from `llama-server --list-devices`'s output: the CPU, then
    the first device of each other backend ("CUDA0" -> ("cuda", "CUDA0"), "Vulkan0" -> ("vulkan", ...))."""
    out, seen = [(CPU, "")], {CPU}
    for kind, number in _DEVICE.findall(list_devices):
        backend = kind.lower()
        if backend not in seen:
            seen.add(backend)
            out.append((backend, f"{kind}{number}"))
    return out


def figures(body: bytes) -> tuple[float, float]:
    """(prompt tokens a second, generated tokens a second) from llama-server's completion answer."""
    try:
        timings = json.loads(body)["timings"]
        prompt, gen = float(timings["prompt_per_second"]), float(timings["predicted_per_second"])
    except (ValueError, KeyError, TypeError) as exc:
        raise BenchFailed(f"llama-server's answer has no timings ({type(exc).__name__}: {exc})") from None
    if not (math.isfinite(prompt) and math.isfinite(gen) and prompt > 0 and gen > 0):
        raise BenchFailed(f"llama-server's timings are not speeds: prompt {prompt}, generation {gen}")
    return prompt, gen


def server_argv(executable: str, model: Path, port: int, backend: str, device: str) -> list[str]:
    nice = shutil.which("nice")
    argv = [nice, "-n", str(NICE)] if nice else []
    argv += [executable, "--model", str(model), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--ctx-size", str(CONTEXT), "--parallel", "1"]
    if backend == CPU:
        # No device at all, not only no layers: a GPU build would still offload large batches.
        argv += ["--device", "none", "--n-gpu-layers", "0"]
    else:
        argv += ["--device", device, "--n-gpu-layers", "999"]
    return argv


def _tail(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    last = [line.strip() for line in lines if line.strip()][-LOG_TAIL_LINES:]
    return " Its log ends: " + " / ".join(last) if last else ""


async def measure(
    executable: str, model: Path, backend: str, device: str, log_path: Path, *, timeout_s: float = TIMEOUT_S
) -> tuple[float, float]:
    """(prompt, generation) tokens a second of one backend; `BenchFailed` saying why not."""
    port = pick_port("127.0.0.1")
    argv = server_argv(executable, model, port, backend, device)
    body = json.dumps(
        {"prompt": PROMPT, "n_predict": N_PREDICT, "ignore_eos": True, "temperature": 0, "cache_prompt": False}
    ).encode()
    with open(log_path, "wb") as out:
        proc = await trio.lowlevel.open_process(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True
        )
    try:
        with trio.move_on_after(timeout_s) as scope:
            interval = 0.05
            while await probe_health("127.0.0.1", port) != 200:
                if proc.returncode is not None:
                    raise BenchFailed(f"llama-server exited with {proc.returncode} before it served.{_tail(log_path)}")
                await trio.sleep(interval)  # a real process loading a model: ask again soon
                interval = min(interval * 2, 0.5)
            answer = await call_engine("127.0.0.1", port, "POST", "/completion", timeout_s=timeout_s, json_body=body)
            if answer is None or answer[0] != 200:
                said = "nothing" if answer is None else f"{answer[0]}: {answer[1][:200].decode(errors='replace')}"
                raise BenchFailed(f"llama-server answered the completion with {said}.{_tail(log_path)}")
            return figures(answer[1])
        assert scope.cancelled_caught
        raise BenchFailed(f"the measurement did not finish within {timeout_s:g} s.{_tail(log_path)}")
    finally:
        with trio.CancelScope(shield=True):
            signal_group(proc.pid, signal.SIGTERM)
            with trio.move_on_after(STOP_TIMEOUT_S):
                await proc.wait()
            if proc.returncode is None:
                signal_group(proc.pid, signal.SIGKILL)
                with trio.move_on_after(STOP_TIMEOUT_S):
                    await proc.wait()


async def list_devices(executable: str) -> str:
    """`llama-server --list-devices`'s output ("" if it says nothing or fails: the CPU alone is measured)."""
    with trio.move_on_after(LIST_TIMEOUT_S):
        try:
            done = await trio.run_process(
                [executable, "--list-devices"], capture_stdout=True, stderr=subprocess.STDOUT, check=False
            )
        except OSError:
            return ""
        return done.stdout.decode(errors="replace")
    return ""


def _cpu_ticks(pids: Iterable[int]) -> int:
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat(5))
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile, or not ours to read
    return total


async def replicas_busy(pids: Callable[[], Iterable[int]], sample_s: float = BUSY_SAMPLE_S) -> str:
    """Why this node's replicas are busy now ("" if not, as far as their engines' CPU time tells)."""
    running = [p for p in pids() if p > 0]
    if not running:
        return ""
    before = await trio.to_thread.run_sync(_cpu_ticks, running)
    await trio.sleep(sample_s)
    after = await trio.to_thread.run_sync(_cpu_ticks, running)
    cores = (after - before) / os.sysconf("SC_CLK_TCK") / sample_s
    return f"its replicas are busy ({cores:.1f} cores); measured once they are idle" if cores > BUSY_CORES else ""


Measure = Callable[[str, Path, str, str, Path], Awaitable[tuple[float, float]]]


async def made_model(directory: Path) -> Path:
    """The made model's file in `directory` (written there, off the event loop, if it is not)."""
    return await trio.to_thread.run_sync(benchmodel.ensure, directory)


@attrs.define
class Bench:
    """The speeds this node reports, and what was measured last. `directory`: where the made
    model and llama-server's logs go; `busy()`: why not now ("" when the replicas are idle)."""

    directory: Path
    busy: Callable[[], Awaitable[str]]
    measure: Measure = measure
    list_devices: Callable[[str], Awaitable[str]] = list_devices
    model: Callable[[Path], Awaitable[Path]] = made_model
    clock: Callable[[], float] = time.time
    speeds: dict[str, w.BackendSpeed] = attrs.Factory(dict)  # by backend (llama.cpp's)
    measured: tuple[str, str] | None = None  # (version, executable) measured last
    answered: str = ""  # the last request answered

    def as_tuple(self) -> tuple[w.BackendSpeed, ...]:
        return tuple(self.speeds[k] for k in sorted(self.speeds))

    def due(self, engines: Engines, desired: w.DesiredState | None) -> Due | None:
        """What to measure now, if anything: llama.cpp checked here and not measured at this
        version and executable (where the control plane's want says `measure_speed`), or a
        request not answered yet."""
        status, executable = engines.statuses.get(ENGINE), engines.executables.get(ENGINE)
        if status is None or not status.ok or status.state == w.ENGINE_INSTALLING or executable is None:
            return None
        request = desired.bench if desired is not None else ""
        if request and request != self.answered:
            return Due(version=status.version, executable=executable, request=request)
        if (status.version, executable) != self.measured and self.by_itself(desired):
            return Due(version=status.version, executable=executable, request=request)
        return None

    @staticmethod
    def by_itself(desired: w.DesiredState | None) -> bool:
        """Whether the control plane wants llama.cpp's speed measured without being asked: its
        want of llama.cpp says so. Not before a desired state wants llama.cpp (the want may say
        `measure_speed = false`, and until one comes this agent has checked no llama.cpp)."""
        wants = desired.engines if desired is not None else ()
        return any(e.name == ENGINE and e.measure_speed for e in wants)

    def forget_unless(self, engines: Engines) -> bool:
        """Drop the speeds if llama.cpp is no longer offered here; True if there were any."""
        if ENGINE in engines.statuses or not self.speeds:
            return False
        self.speeds.clear()
        self.measured = None
        return True

    def _note(self, backend: str, due: Due, state: str, **fields) -> None:
        before = self.speeds.get(backend)
        kept = (
            {"prompt_tps": before.prompt_tps, "gen_tps": before.gen_tps, "measured_at": before.measured_at}
            if before is not None and before.version == due.version
            else {}
        )
        self.speeds[backend] = w.BackendSpeed(
            engine=ENGINE, backend=backend, state=state, version=due.version, request=due.request, **{**kept, **fields}
        )

    def waiting(self, due: Due, why: str) -> None:
        for backend in self.speeds or {CPU: None}:
            self._note(backend, due, w.SPEED_WAITING, detail=why)

    async def run(self, due: Due, send: Callable[[w.AgentMessage], Awaitable[bool]]) -> None:
        """Measure every backend of `due.executable`, reporting each as it starts and ends."""
        model = await self.model(self.directory)
        found = backends(await self.list_devices(due.executable))
        for gone in set(self.speeds) - {b for b, _ in found}:
            del self.speeds[gone]
        for backend, device in found:
            self._note(backend, due, w.SPEED_MEASURING, device=device)
            await send(w.SpeedsChanged(speeds=self.as_tuple()))
            try:
                prompt, gen = await self.measure(
                    due.executable, model, backend, device, self.directory / f"llama-server-{backend}.log"
                )
            except (BenchFailed, OSError) as exc:
                reason = str(exc) if isinstance(exc, BenchFailed) else f"llama-server did not start: {exc}"
                log.warning("bench_failed", engine=ENGINE, backend=backend, reason=reason)
                self._note(backend, due, w.SPEED_FAILED, device=device, detail=reason)
            else:
                log.info("bench_measured", engine=ENGINE, backend=backend, prompt_tps=prompt, gen_tps=gen)
                self._note(
                    backend,
                    due,
                    w.SPEED_OK,
                    device=device,
                    prompt_tps=round(prompt, 1),
                    gen_tps=round(gen, 1),
                    measured_at=self.clock(),
                )
            await send(w.SpeedsChanged(speeds=self.as_tuple()))
        self.measured = (due.version, due.executable)
        self.answered = due.request or self.answered


async def serve_bench(
    bench: Bench,
    engines: Engines,
    desired: Callable[[], w.DesiredState | None],
    changed: Callable[[], Awaitable[None]],
    send: Callable[[w.AgentMessage], Awaitable[bool]],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Measure when `bench.due` says, forever: after each desired state (`changed`) and every
    LOOK_S (an install finished meanwhile); while the replicas are busy, every BUSY_RETRY_S."""
    bench.directory.mkdir(parents=True, exist_ok=True)
    task_status.started()
    while True:
        if bench.forget_unless(engines):
            await send(w.SpeedsChanged(speeds=bench.as_tuple()))
        due = bench.due(engines, desired())
        if due is None:
            with trio.move_on_after(LOOK_S):
                await changed()
            continue
        why = await bench.busy()
        if why:
            if any(s.state != w.SPEED_WAITING for s in bench.speeds.values()) or not bench.speeds:
                bench.waiting(due, why)
                await send(w.SpeedsChanged(speeds=bench.as_tuple()))
            await trio.sleep(BUSY_RETRY_S)
            continue
        await bench.run(due, send)
