"""`llmgw agent supervise` / `stop`: the restart policy on a fake clock, then real processes.

The supervised child is a tiny `python -c` script (its argv is the seam) that records its pid
and exits or sleeps; the supervisor runs as its own process, so that signals reach it and not
pytest. The `--daemon` test runs the real CLI with a bogus agent.toml: its agent fails and is
started again, which is all that test needs. Every wait is a poll with a deadline.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent import doctor_checks, supervise
from llmgw import cli
from llmgw.backoff import Backoff, Failures
from llmgw.commands import agent as agent_cmd
from llmgw.errors import MachineError
from llmgw.selfexec import llmgw_command
from testlib.proc import llmgw_env, run_llmgw

# -- the policy, on a fake clock ---------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def advance(self, seconds: float) -> None:
        self.now += seconds


def restarts(policy: Backoff, uptimes: list[float]) -> list[float]:
    """The waits the supervisor would make for children that each ran `uptime` seconds."""
    clock = FakeClock()
    failures = Failures(policy)
    waits = []
    for uptime in uptimes:
        began = clock.now
        clock.advance(uptime)
        failures.failed(clock.now, ran_s=clock.now - began)
        delay = failures.delay()
        waits.append(delay)
        clock.advance(delay)
    return waits


def test_the_wait_doubles_from_1_s_up_to_30_s() -> None:
    assert restarts(supervise.CHILD_BACKOFF, [0.25] * 8) == [1, 2, 4, 8, 16, 30, 30, 30]


def test_a_child_that_stayed_up_60_s_starts_the_backoff_again() -> None:
    policy = supervise.CHILD_BACKOFF
    assert restarts(policy, [0.25, 0.25, 0.25, 60.0, 0.25, 59.75]) == [1, 2, 4, 1, 2, 4]
    assert restarts(policy, [0.25] * 6 + [59.9]) == [1, 2, 4, 8, 16, 30, 30]
    assert restarts(policy, [0.25] * 6 + [60.0]) == [1, 2, 4, 8, 16, 30, 1]


# -- the child's command and the defaults ------------------------------------------------------


def test_the_child_is_this_same_llmgw_running_the_agent_with_absolute_paths(monkeypatch) -> None:
    argv = supervise.agent_argv(Path("conf/agent.toml"), log_level="debug", log_format="json")
    own = llmgw_command()
    assert list(argv[: len(own)]) == own
    assert argv[len(own) :] == (
        "--log-level",
        "debug",
        "--log-format",
        "json",
        "agent",
        "run",
        "--config",
        str(Path.cwd() / "conf" / "agent.toml"),
    )
    env = supervise.child_env({"PYTHONPATH": f"src/python{os.pathsep}/abs", "X": "1"})
    assert env == {"PYTHONPATH": f"{Path.cwd() / 'src/python'}{os.pathsep}/abs", "X": "1"}


def test_doctors_advice_is_a_valid_command_with_the_defaults() -> None:
    assert (agent_cmd.DEFAULT_PID_FILE, agent_cmd.DEFAULT_LOG) == (supervise.DEFAULT_PID_FILE, supervise.DEFAULT_LOG)
    [command] = re.findall(r"llmgw (agent supervise .*)$", doctor_checks.SERVICE_MANAGER_FIX)
    args = cli.build_parser("agent").parse_args(command.split()[1:])
    assert args.run is agent_cmd.run_supervise and args.daemon
    assert (str(args.config), str(args.pid_file), str(args.log)) == (
        agent_cmd.DEFAULT_CONFIG,
        supervise.DEFAULT_PID_FILE,
        supervise.DEFAULT_LOG,
    )


# -- real processes ----------------------------------------------------------------------------

# The stand-in agent: records its pid in argv[1], then exits 3, sleeps, or sleeps ignoring SIGTERM.
CHILD = """
import os, signal, sys, time
if sys.argv[2] == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
with open(sys.argv[1], "a") as f:
    f.write(f"{os.getpid()}\\n")
print(f"child {os.getpid()} {sys.argv[2]}", flush=True)
if sys.argv[2] == "exit":
    sys.exit(3)
time.sleep(120)
"""

# A supervisor in its own process, from a JSON spec in argv[1].
DRIVER = """
import json, sys
from pathlib import Path
from agent import supervise
from llmgw.backoff import Backoff
a = json.loads(sys.argv[1])
spec = supervise.Spec(
    argv=tuple(a["argv"]),
    pid_file=Path(a["pid_file"]),
    log_file=Path(a["log"]),
    backoff=Backoff(first_s=0.05, max_s=0.2, healthy_s=60.0),
    stop_timeout_s=a["stop_timeout_s"],
)
sys.exit(supervise.run(spec))
"""


def until(predicate: Callable[[], object], what: str, timeout: float = 20.0) -> object:
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:g} s")
        time.sleep(0.02)
    return value


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes (its parent has not reaped it yet).
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def pids(path: Path) -> list[int]:
    """Whole lines only: a child may be writing the next one."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    return [int(line) for line in text.split("\n")[:-1]]


class Files:
    def __init__(self, root: Path) -> None:
        self.pid_file = root / "run" / "agent.pid"
        self.log = root / "log" / "agent.log"
        self.children = root / "children"

    def spec(self, mode: str, stop_timeout_s: float = 10.0) -> dict:
        return {
            "argv": [sys.executable, "-c", CHILD, str(self.children), mode],
            "pid_file": str(self.pid_file),
            "log": str(self.log),
            "stop_timeout_s": stop_timeout_s,
        }

    def supervisor_pid(self) -> int | None:
        text = self.pid_file.read_text() if self.pid_file.exists() else ""
        return int(text) if text.endswith("\n") else None


@pytest.fixture
def files(tmp_path: Path) -> Iterator[Files]:
    f = Files(tmp_path)
    yield f
    for pid in pids(f.children):  # whatever a failed test left behind
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def start(files: Files) -> Iterator[Callable[..., subprocess.Popen]]:
    started: list[subprocess.Popen] = []

    def go(mode: str, stop_timeout_s: float = 10.0) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-c", DRIVER, json.dumps(files.spec(mode, stop_timeout_s))],
            env=llmgw_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        started.append(proc)
        until(lambda: files.supervisor_pid() == proc.pid or proc.poll() is not None, "the pid file")
        assert proc.poll() is None, proc.communicate()[0]
        return proc

    yield go
    for proc in started:
        if proc.poll() is None:  # stopped the way it is meant to be, so that it stops its child too
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
        proc.communicate(timeout=10)


def test_a_child_that_exits_is_started_again_and_each_exit_is_logged(files: Files, start) -> None:
    sup = start("exit")
    until(lambda: len(pids(files.children)) >= 3, "three children")
    sup.send_signal(signal.SIGTERM)
    assert sup.wait(timeout=15) == 0
    assert not files.pid_file.exists()
    log = files.log.read_text()
    first = pids(files.children)[0]
    assert f"child {first} exit" in log  # the child's own output is appended to the log
    exits = [line for line in log.splitlines() if "event=agent_exited" in line]
    assert len(exits) >= 2
    assert f"pid={first} exit_status=3" in exits[0] and "restart_in_s=0.05" in exits[0]
    assert "restart_in_s=0.1 " in exits[1] or exits[1].endswith("restart_in_s=0.1")
    assert f"event=supervisor_started pid={sup.pid}" in log and "event=supervisor_stopping signal=SIGTERM" in log


def test_sigterm_stops_the_child_then_the_supervisor_and_removes_the_pid_file(files: Files, start) -> None:
    sup = start("sleep")
    [child] = until(lambda: pids(files.children), "the child")
    assert "agent supervisor running, pid" in sup.stdout.readline()
    sup.send_signal(signal.SIGTERM)
    assert sup.wait(timeout=15) == 0
    assert not alive(child)
    assert not files.pid_file.exists()
    log = files.log.read_text()
    assert f"event=agent_stopped pid={child} signal=SIGTERM" in log
    assert "event=agent_exited" not in log  # a stop is not an exit to restart after


def test_a_child_that_ignores_sigterm_is_killed_after_the_stop_timeout(files: Files, start) -> None:
    sup = start("stubborn", stop_timeout_s=0.5)
    [child] = until(lambda: pids(files.children), "the child")
    sup.send_signal(signal.SIGINT)
    assert sup.wait(timeout=15) == 0
    assert not alive(child)
    log = files.log.read_text()
    assert f"event=agent_kill pid={child} after_s=0.5" in log
    assert f"event=agent_stopped pid={child} signal=SIGKILL" in log


def test_a_second_supervisor_on_the_same_pid_file_is_refused(files: Files, start) -> None:
    sup = start("sleep")
    spec = supervise.Spec(argv=("true",), pid_file=files.pid_file, log_file=files.log)
    with pytest.raises(MachineError) as refused:
        supervise.run(spec)
    assert str(refused.value) == (
        f"an agent supervisor already runs with the pid file {files.pid_file} (pid {sup.pid}); "
        f"stop it first with `llmgw agent stop --pid-file {files.pid_file}`, or use another --pid-file"
    )
    assert files.supervisor_pid() == sup.pid  # the refused one left the file alone


def test_stop_signals_the_supervisor_and_waits_for_it(files: Files, start, capsys) -> None:
    sup = start("sleep")
    [child] = until(lambda: pids(files.children), "the child")
    assert supervise.stop(files.pid_file, timeout_s=15) == 0
    assert capsys.readouterr().out.startswith(f"agent supervisor stopped (pid {sup.pid}, SIGTERM, ")
    assert sup.wait(timeout=5) == 0 and not alive(child) and not files.pid_file.exists()


def test_stop_when_nothing_runs_says_so_and_signals_nobody(files: Files, capsys) -> None:
    assert supervise.stop(files.pid_file) == 0
    assert capsys.readouterr().out == f"agent supervisor not running (no pid file {files.pid_file})\n"
    # A pid file left by a supervisor that was killed, naming a pid now used by someone else.
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        files.pid_file.parent.mkdir(parents=True)
        files.pid_file.write_text(f"{bystander.pid}\n")
        assert supervise.stop(files.pid_file) == 0
        assert capsys.readouterr().out == (
            f"agent supervisor not running; {files.pid_file} names pid {bystander.pid}, which does not hold it\n"
        )
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait(timeout=10)


# Holds the pid file's lock as a supervisor would, and does not stop on SIGTERM.
STUBBORN_HOLDER = """
import fcntl, os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, f"{os.getpid()}\\n".encode())
time.sleep(60)
"""


def test_stop_that_times_out_names_the_pid(files: Files) -> None:
    files.pid_file.parent.mkdir(parents=True)
    proc = subprocess.Popen([sys.executable, "-c", STUBBORN_HOLDER, str(files.pid_file)])
    try:
        until(lambda: files.supervisor_pid() == proc.pid, "the holder's pid")
        with pytest.raises(MachineError) as timed_out:
            supervise.stop(files.pid_file, timeout_s=0.3)
        assert f"the agent supervisor (pid {proc.pid}) still runs 0.3 s after SIGTERM" in str(timed_out.value)
        assert f"kill -KILL {proc.pid}" in str(timed_out.value)
    finally:
        proc.kill()
        proc.wait(timeout=10)


# -- the CLI, detached -------------------------------------------------------------------------


@pytest.fixture
def daemon_files(files: Files) -> Iterator[Files]:
    yield files
    held = supervise.holder(files.pid_file)
    if held.locked and held.pid:  # a test that failed half way: leave nothing running
        os.kill(held.pid, signal.SIGKILL)


def test_daemon_returns_at_once_and_stop_stops_it(tmp_path: Path, daemon_files: Files) -> None:
    files = daemon_files
    agent_toml = tmp_path / "agent.toml"
    agent_toml.write_text(f'server = "wss://127.0.0.1:9"\nnode_id = "n1"\nstate_dir = "{tmp_path / "state"}"\n')
    args = ("agent", "supervise", "--daemon", "--config", str(agent_toml), "--pid-file", str(files.pid_file))
    args += ("--log", str(files.log))
    # capture_output: run() returns only once every holder of the pipes has closed them.
    began = time.monotonic()
    done = run_llmgw(*args, timeout=30)
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - began < 20
    m = re.fullmatch(rf"agent supervisor started, pid (\d+), log {re.escape(str(files.log))}\n", done.stdout)
    assert m, done.stdout
    pid = int(m[1])
    assert files.supervisor_pid() == pid and supervise.holder(files.pid_file).locked
    assert os.readlink(f"/proc/{pid}/cwd") == "/"
    assert [os.readlink(f"/proc/{pid}/fd/{n}") for n in (0, 1, 2)] == ["/dev/null", str(files.log), str(files.log)]
    assert oct(files.pid_file.stat().st_mode & 0o777) == "0o644"

    again = run_llmgw(*args, timeout=30)
    assert again.returncode == 1
    assert f"({f'pid {pid}'}); stop it first with `llmgw agent stop --pid-file {files.pid_file}`" in again.stderr

    until(lambda: "event=agent_exited" in files.log.read_text(), "the bogus agent's exit", timeout=30)
    # The real agent ran: it complained, into the log, about the state directory it was given.
    assert str(tmp_path / "state") in files.log.read_text().split("event=agent_started", 1)[1]
    started = next(line for line in files.log.read_text().splitlines() if "event=agent_started" in line)
    assert f' agent run --config {agent_toml}"' in started

    stopped = run_llmgw("agent", "stop", "--pid-file", str(files.pid_file), timeout=40)
    assert stopped.returncode == 0, stopped.stderr
    assert stopped.stdout.startswith(f"agent supervisor stopped (pid {pid}, SIGTERM, ")
    assert not files.pid_file.exists()
    until(lambda: not alive(pid), "the supervisor's end")

    twice = run_llmgw("agent", "stop", "--pid-file", str(files.pid_file), timeout=30)
    assert (twice.returncode, twice.stdout) == (0, f"agent supervisor not running (no pid file {files.pid_file})\n")
