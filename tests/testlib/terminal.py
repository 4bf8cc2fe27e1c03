"""A real terminal for tests: one tmux server (its own `-L` socket) with one 120x40 pane.

Keys go in with `send-keys`, what is drawn comes back with `capture-pane`; the pane stays after
its command exits so the test can read what it printed last. Every wait is bounded.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from testlib.needs import program

TMUX_TIMEOUT_S = 10.0


def words(text: str) -> str:
    """Text as drawn, wrapped anywhere: compare word sequences, not lines."""
    return " ".join(text.replace("|", " ").split())


class Terminal:
    def __init__(self, tmp_path: Path, argv: Sequence[str], *, timeout_s: float = TMUX_TIMEOUT_S) -> None:
        """Run `argv` in the pane with TERM=xterm-256color and this process's sys.path as PYTHONPATH."""
        program("tmux", "tmux")
        self.timeout_s = timeout_s
        self.socket = f"llmgw-term-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        conf = tmp_path / f"tmux-{self.socket}.conf"
        conf.write_text("set -g remain-on-exit on\nset -g history-limit 5000\n")
        pythonpath = os.pathsep.join(os.path.abspath(p) for p in sys.path if p)
        # The exit status goes to a file: tmux 3.3 does not always set #{pane_dead_status}.
        self._status = tmp_path / f"{self.socket}.status"
        script = f'"$@"; echo $? > {shlex.quote(str(self._status))}'
        command = shlex.join(
            ["env", "TERM=xterm-256color", f"PYTHONPATH={pythonpath}", "sh", "-c", script, "sh", *argv]
        )
        self.tmux("-f", str(conf), "new-session", "-d", "-x", "120", "-y", "40", "-s", "t", "-c", os.getcwd(), command)

    def tmux(self, *args: str) -> str:
        done = subprocess.run(
            ["tmux", "-L", self.socket, *args], capture_output=True, text=True, timeout=TMUX_TIMEOUT_S, check=False
        )
        if done.returncode != 0:
            raise AssertionError(f"tmux {' '.join(args)} failed: {done.stderr.strip()}")
        return done.stdout

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-J", "-t", "t")

    def scrollback(self) -> str:
        """The visible pane and the history above it, where what was printed last stays."""
        return self.tmux("capture-pane", "-p", "-J", "-S", "-", "-t", "t")

    def wait_for(self, *needles: str, timeout_s: float | None = None) -> str:
        """The screen once it shows every needle (compared as words)."""
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        while True:
            text = self.screen()
            if all(words(n) in words(text) for n in needles):
                return text
            if time.monotonic() > deadline:
                raise AssertionError(f"not drawn in time: {needles!r}; the screen:\n{text}")
            time.sleep(0.05)

    def keys(self, *keys: str) -> None:
        self.tmux("send-keys", "-t", "t", *keys)

    def type(self, text: str) -> None:
        self.tmux("send-keys", "-t", "t", "-l", text)

    def wait_exit(self, timeout_s: float | None = None) -> int:
        """The command's exit status, once it has exited and tmux has read all it wrote."""
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        # #{pane_dead} turns 1 once the pty is closed and drained, after the status file is written.
        while self.tmux("display-message", "-p", "-t", "t", "#{pane_dead}").strip() != "1":
            if time.monotonic() > deadline:
                raise AssertionError(f"the command did not exit in time; the screen:\n{self.screen()}")
            time.sleep(0.05)
        return int(self._status.read_text())

    def close(self) -> None:
        subprocess.run(
            ["tmux", "-L", self.socket, "kill-server"], capture_output=True, timeout=TMUX_TIMEOUT_S, check=False
        )
