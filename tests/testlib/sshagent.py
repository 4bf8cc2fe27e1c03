"""A real `ssh-agent` for tests, holding keys whose files are then deleted.

The agent can run as another user (`uid`, e.g. nobody's 65534), as an operator's agent forwarded
with `ssh -A` is: its socket belongs to the login user, and root reaches it through
`sudo --preserve-env=SSH_AUTH_SOCK` (ssh-agent serves its own user and root). `add` loads a key
and removes its private file, so a login that works afterwards can only have used the agent.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from testlib.needs import program

START_TIMEOUT_S = 10.0


class SshAgent:
    def __init__(self, *, uid: int | None = None) -> None:
        """The socket is in a directory of its own under /tmp, as ssh-agent's /tmp/ssh-XXXXXX: a
        test's tmp_path is root's alone, where another user could not make it."""
        self.uid = uid
        self.directory = Path(tempfile.mkdtemp(prefix="llmgw-test-agent-"))
        self.socket = self.directory / "agent.sock"
        self._proc: subprocess.Popen | None = None

    def start(self) -> SshAgent:
        agent = program("ssh-agent", "openssh-client")
        argv = [agent, "-D", "-a", str(self.socket)]
        if self.uid is not None:
            os.chown(self.directory, self.uid, self.uid)
            argv = [
                program("setpriv", "util-linux"),
                f"--reuid={self.uid}",
                f"--regid={self.uid}",
                "--clear-groups",
                *argv,
            ]
        self._proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.socket.exists():
            if self._proc.poll() is not None:
                raise RuntimeError(f"ssh-agent exited with {self._proc.returncode}: {self._proc.stderr.read()!r}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"ssh-agent made no socket at {self.socket} within {START_TIMEOUT_S} s")
            time.sleep(0.02)
        return self

    @property
    def env(self) -> dict[str, str]:
        return {"SSH_AUTH_SOCK": str(self.socket)}

    def add(self, key: Path) -> None:
        """Load the private key `key` into the agent, then delete its file (key.pub stays)."""
        done = subprocess.run(
            [program("ssh-add", "openssh-client"), str(key)],
            env={**os.environ, **self.env},
            capture_output=True,
            text=True,
            timeout=30,
        )
        if done.returncode != 0:
            raise RuntimeError(f"ssh-add {key} failed: {done.stderr}")
        key.unlink()

    def listed(self) -> str:
        """`ssh-add -l`: the fingerprints the agent holds."""
        return subprocess.run(
            [program("ssh-add", "openssh-client"), "-l"],
            env={**os.environ, **self.env},
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(10)
            self._proc = None
        shutil.rmtree(self.directory, ignore_errors=True)
