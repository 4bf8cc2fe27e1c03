"""The pki tests' fixtures: a state directory with a CA made in it (`state`), and that CA (`ca`).
test_ca.py, which tests the pure crypto with no files, has a `ca` of its own."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.pki.ca import CA
from llmgw.pki.files import init_ca, load_ca


@pytest.fixture
def state(tmp_path: Path) -> Path:
    d = tmp_path / "state"
    init_ca(d, validity_days=3650)
    return d


@pytest.fixture
def ca(state: Path) -> CA:
    return load_ca(state)
