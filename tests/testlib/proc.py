"""Run the real `llmgw` CLI as a child process, the way an operator would.

Under Pants a test runs inside a PEX, so a bare `python -m llmgw` would not see the
third-party packages; the child gets this process's `sys.path` through PYTHONPATH.
`umask(...)` sets the umask the processes started inside it inherit.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO_MARKER = "pants.toml"


def llmgw_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    env.update(extra or {})
    return env


def run_llmgw(*args: str, env: dict[str, str] | None = None, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "llmgw", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=llmgw_env(env),
        check=False,
        **kw,
    )


def build_root() -> Path:
    """The directory Pants runs the test in (the sandbox root), or the checkout outside Pants."""
    here = Path.cwd()
    for d in (here, *here.parents):
        if (d / REPO_MARKER).exists() or (d / "docs").is_dir():
            return d
    return here


@contextmanager
def umask(value: int) -> Iterator[None]:
    """This process's umask while inside, and so that of the processes started there."""
    old = os.umask(value)
    try:
        yield
    finally:
        os.umask(old)
