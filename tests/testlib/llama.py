"""Where the real llama-server is: $LLMGW_LLAMA_SERVER, or tools/llama/build-llama-server's cache.

`./pants test` builds it into that cache before the tests run (tools/testenv/prepare.py), so the
tests find it with nothing set; LLMGW_LLAMA_SERVER still names another. Tests that need it fail,
never skip, without it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

LLAMA_VERSION = "11434.0.0"  # tools/llama/build-llama-server's (tests/testenv checks they agree)


def cached_path() -> Path:
    """Where tools/llama/build-llama-server puts it (LLMGW_LLAMA_CACHE, else the user's cache)."""
    cache = os.environ.get("LLMGW_LLAMA_CACHE") or (
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llmgw-llama"
    )
    return Path(cache) / LLAMA_VERSION / "bin" / "llama-server"


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
