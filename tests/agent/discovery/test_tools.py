"""Tool runs: missing, failing, not executable and hung tools are results, not exceptions."""

from __future__ import annotations

import time
from pathlib import Path

from agent.discovery import tools


def script(tmp_path: Path, body: str, name: str = "tool") -> str:
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


def test_ok_keeps_the_output(tmp_path: Path) -> None:
    run = tools.run_tool([script(tmp_path, "echo out; echo err >&2\n"), "x"])
    assert run.ok and run.stdout == "out\n" and run.stderr == "err\n" and run.returncode == 0


def test_missing_is_not_a_failure(tmp_path: Path) -> None:
    run = tools.run_tool([str(tmp_path / "nvidia-smi")])
    assert run.outcome == tools.MISSING
    assert run.problem() == f"not found at {tmp_path / 'nvidia-smi'}"


def test_a_failure_keeps_the_tools_last_words(tmp_path: Path) -> None:
    run = tools.run_tool([script(tmp_path, "echo first; echo 'driver not loaded' >&2; exit 9\n")])
    assert run.outcome == tools.FAILED and run.returncode == 9
    assert run.problem() == "exits 9: driver not loaded"


def test_not_executable_is_a_failure_that_says_so(tmp_path: Path) -> None:
    path = tmp_path / "tool"
    path.write_text("#!/bin/sh\n")
    run = tools.run_tool([str(path)])
    assert run.outcome == tools.FAILED and run.returncode is None
    assert run.problem().startswith(f"cannot run {path}")


def test_a_hung_tool_and_what_it_started_are_killed_at_the_timeout(tmp_path: Path) -> None:
    # The grandchild keeps stdout open: without killing the whole session, reading would hang.
    hung = script(tmp_path, "(sleep 60) &\nsleep 60\n")
    started = time.monotonic()
    run = tools.run_tool([hung], timeout_s=0.2)
    assert time.monotonic() - started < 10
    assert run.outcome == tools.TIMEOUT and run.problem() == "no answer in 0.2 s (killed)"
