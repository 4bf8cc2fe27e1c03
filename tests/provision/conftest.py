"""Fixtures for llmgw-provision-node's tests; the helpers are testlib.provision."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

from testlib.provision import Host, load_tool, make_host


@pytest.fixture
def host(tmp_path: Path) -> Host:
    return make_host(tmp_path)


@pytest.fixture(scope="session")
def tool() -> ModuleType:
    return load_tool()
