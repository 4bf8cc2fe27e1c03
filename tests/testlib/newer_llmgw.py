"""The next llmgw, as far as its store goes: this code with one schema migration appended (it
makes the table `TABLE`), for the tests of upgrades and of who migrates a store.

- `installed()`: this process is the newer llmgw for the block.
- `PREFIX`: a command prefix (`testlib.proc.Proc`'s `prefix`) that runs the
  `python -m llmgw ARGS` after it as the newer llmgw, in a process of its own.
"""

from __future__ import annotations

import contextlib
import runpy
import sys
from collections.abc import Iterator

from llmgw.server.store import schema
from llmgw.server.store.schema import Dialect

TABLE = "newer_llmgw_feature"
PREFIX = [sys.executable, "-m", "testlib.newer_llmgw"]


def _next(d: Dialect) -> tuple[str, ...]:
    return (f"CREATE TABLE IF NOT EXISTS {TABLE} (id {d.integer} PRIMARY KEY, note TEXT NOT NULL DEFAULT '')",)


@contextlib.contextmanager
def installed() -> Iterator[None]:
    migrations, latest = schema.MIGRATIONS, schema.LATEST
    schema.MIGRATIONS, schema.LATEST = (*migrations, (latest + 1, _next)), latest + 1
    try:
        yield
    finally:
        schema.MIGRATIONS, schema.LATEST = migrations, latest


def main(argv: list[str]) -> None:
    """`python -m testlib.newer_llmgw PYTHON -m llmgw ARGS...`: `llmgw ARGS` as the newer llmgw."""
    if argv[1:3] != ["-m", "llmgw"]:
        raise SystemExit(f"usage: python -m testlib.newer_llmgw PYTHON -m llmgw ARGS...; got {argv!r}")
    with installed():
        sys.argv = ["llmgw", *argv[3:]]
        runpy.run_module("llmgw", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
