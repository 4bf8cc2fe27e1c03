"""The test cluster's own counting: what it calls an engine must be one, or a chaos figure lies."""

from __future__ import annotations

import os
import subprocess
import sys

from testlib.marked import MARKER_ENV, marked_engines, marked_pids


def test_a_marked_tool_run_is_not_an_engine_but_a_process_given_a_port_is(tmp_path) -> None:
    marker = f"engines-{tmp_path.name}-{os.getpid()}"
    env = {**os.environ, MARKER_ENV: marker}
    sleeper = [sys.executable, "-c", "import time; time.sleep(30)"]
    tool = subprocess.Popen([*sleeper, "--version"], env=env)
    engine = subprocess.Popen([*sleeper, "--port", "8000"], env=env)
    try:
        assert sorted(marked_pids(marker)) == sorted([tool.pid, engine.pid])
        assert marked_engines(marker) == [engine.pid]
    finally:
        for proc in (tool, engine):
            proc.kill()
            proc.wait()
    assert marked_engines(marker) == []
