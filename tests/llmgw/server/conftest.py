"""Fixtures of the control plane's tests: the store in either backend (testlib.stores)."""

from __future__ import annotations

from pathlib import Path

import pytest

from testlib.postgres import postgres_db, postgres_server  # noqa: F401 - fixtures, used by name
from testlib.stores import StoreUnderTest


@pytest.fixture(params=["sqlite", "postgresql"])
def store_backend(request: pytest.FixtureRequest, tmp_path: Path) -> StoreUnderTest:
    """The store the test runs against, once per backend."""
    if request.param == "sqlite":
        return StoreUnderTest(kind="sqlite", state=tmp_path)
    return StoreUnderTest(
        kind="postgresql",
        state=tmp_path,
        pg=request.getfixturevalue("postgres_server"),
        db=request.getfixturevalue("postgres_db"),
    )
