"""What the integration test modules share before they are collected: the `release` mark, read
by testlib.nodeadd's `release_dir`. It is registered here because a module's own
`pytest_plugins` (testlib.nodeadd) are loaded only after the module is imported, marks and all."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "release(version='0.0.0-e2e', with_llama=False): the release testlib.nodeadd's release_dir gives the test",
    )
