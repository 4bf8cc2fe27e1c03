"""A real `llmgw up` for a test: started with `--json` until its `ready` event, stopped as Ctrl-C
stops it. tests/llmgw/test_up.py tests `up` itself; other tests use it as the cluster a newcomer
gets (tests/integration/test_openai_clients.py)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from testlib.proc import llmgw_env


def start(state: Path, port: int, *flags: str, stderr: Any = subprocess.DEVNULL) -> tuple[subprocess.Popen, dict]:
    """`llmgw up --json` until its `ready` event, which comes back with the events before it
    (under "before")."""
    # Unless the test reads it, stderr goes to a file in the state's parent: a failed start says why.
    log = None
    if stderr is subprocess.DEVNULL:
        log = stderr = (state.parent / f"up-stderr-{port}.log").open("ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmgw", "up", "--state-dir", str(state), "--port", str(port), "--json", *flags],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env=llmgw_env(),
    )
    if log is not None:
        log.close()  # the child has its own copy
    events = []
    assert proc.stdout is not None
    for line in proc.stdout:  # bounded: `up` itself gives up after its ready timeout
        event = json.loads(line)
        if event["event"] == "ready":
            assert events[0]["event"] == "starting" and "node_joined" in {e["event"] for e in events}
            return proc, {**event, "before": events}
        events.append(event)
    said = (state.parent / f"up-stderr-{port}.log").read_text(errors="replace")[-4000:] if log else ""
    raise AssertionError(f"llmgw up ended before ready: exit {proc.wait(10)}, events {events}, stderr:\n{said}")


def stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGINT)  # what Ctrl-C sends
    return proc.wait(timeout=30)
