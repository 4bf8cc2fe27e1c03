"""What this llmgw is: version, the commit it was built from, the Python running it.

The commit comes from build metadata generated into the package (`_build_info`, written by
the release build and, for `./pants package`, by pants-plugins/llmgw_build), else from git when
running from a checkout, else "unknown". Build date and build target (the release artifact's
platform, e.g. `linux-amd64`, or `pex`) come from `_build_info` only. Nothing here runs at
import time.
"""

from __future__ import annotations

import importlib
import platform
import subprocess
import sys
from pathlib import Path

import attrs

from llmgw import __version__


@attrs.frozen(kw_only=True)
class VersionInfo:
    version: str
    commit: str
    build_date: str
    architecture: str
    build_target: str
    python: str
    python_executable: str


def _generated(module: str, name: str) -> str | None:
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None


def _commit_from_git(directory: Path) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(directory), "rev-parse", "--short=12", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def version_info() -> VersionInfo:
    commit = _generated("llmgw._build_info", "commit")
    build_date = _generated("llmgw._build_info", "build_date") or "unknown"
    build_target = _generated("llmgw._build_info", "target") or "unknown"
    if commit is None:
        commit = _commit_from_git(Path(__file__).resolve().parent)
    return VersionInfo(
        version=__version__,
        commit=commit or "unknown",
        build_date=build_date,
        architecture=platform.machine(),
        build_target=build_target,
        python=platform.python_version(),
        python_executable=sys.executable,
    )
