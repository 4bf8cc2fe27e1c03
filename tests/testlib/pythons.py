"""The CPythons the tests run things under: pyenv's (3.10-3.13, which the release claims to run
on) and the 3.9 that ./pants runs Pants with (what a Proxmox host's tool must run on too). A
Python that is missing is a failure naming the fix, never a skip."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest


def pyenv_root() -> Path:
    if os.environ.get("PYENV_ROOT"):
        return Path(os.environ["PYENV_ROOT"])
    try:
        done = subprocess.run(["pyenv", "root"], capture_output=True, text=True, timeout=30, check=False)
        if done.returncode == 0 and done.stdout.strip():
            return Path(done.stdout.strip())
    except (OSError, subprocess.TimeoutExpired):
        pass
    return Path.home() / ".pyenv"


def find_python(minor: int) -> Path:
    """The newest pyenv CPython 3.`minor`.N."""
    root = pyenv_root()
    found = [
        p
        for p in root.glob(f"versions/3.{minor}.*/bin/python3.{minor}")
        if re.fullmatch(rf"3\.{minor}\.\d+", p.parents[1].name)  # not 3.13.0t and the like
    ]
    if not found:
        pytest.fail(f"no CPython 3.{minor} in {root}/versions; install it with `pyenv install 3.{minor}`")
    return max(found, key=lambda p: tuple(int(x) for x in p.parents[1].name.split(".")))


def find_python39() -> Path:
    """A CPython 3.9, found where ./pants finds the one it runs Pants with."""
    candidates = [os.environ.get("LLMGW_PANTS_PYTHON", ""), shutil.which("python3.9") or ""]
    candidates += [str(p) for p in sorted(pyenv_root().glob("versions/3.9.*/bin/python3.9"), reverse=True)]
    for candidate in filter(None, candidates):
        done = subprocess.run(
            [candidate, "-c", "import sys; print(sys.version_info[:2] == (3, 9))"],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        if done.stdout.strip() == "True":
            return Path(candidate)
    pytest.fail(
        "no CPython 3.9 (on PATH, under pyenv or in LLMGW_PANTS_PYTHON); ./pants needs one too: `pyenv install 3.9`"
    )
