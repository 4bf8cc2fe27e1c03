"""Where the real llama-server is: $LLMGW_LLAMA_SERVER or tools/llama/build-llama-server's cache.

Tests that need it fail rather than skip without it: CI builds it first (.ci/run)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

LLAMA_VERSION = "11434.0.0"  # tools/llama/build-llama-server's


def llama_server() -> str:
    given = os.environ.get("LLMGW_LLAMA_SERVER")
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    path = Path(given) if given else cache / "llmgw-llama" / LLAMA_VERSION / "bin" / "llama-server"
    if not os.access(path, os.X_OK):
        pytest.fail(
            f"no llama-server at {path} ({'LLMGW_LLAMA_SERVER' if given else 'the build cache'}); "
            "run tools/llama/build-llama-server (about 5 minutes) or set LLMGW_LLAMA_SERVER"
        )
    return str(path)
