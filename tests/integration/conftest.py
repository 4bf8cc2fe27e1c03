"""Fixtures the `llmgw node add` tests share: `release_dir`, `node` and `cp` (testlib.nodeadd)."""

from testlib.nodeadd import cp, node, release_dir  # noqa: F401
