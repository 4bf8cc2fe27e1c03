"""The mirror's index: built off the trio loop, cached by mtime, read without disk access.

`available()` is what every desired state asks (on the loop); it must answer from the index as
last built. Building it hashes any archive not named by its hash: that work runs in a thread,
once per file version.
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import pytest
import trio

from llmgw.server.nodes import artifacts
from llmgw.server.nodes.artifacts import Artifacts

pytestmark = pytest.mark.trio


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, bool]]:
    """Each file hashed by the index, and whether it was hashed on the test's (trio's) thread."""
    calls: list[tuple[str, bool]] = []
    real = artifacts.sha256_of
    loop_thread = threading.current_thread()

    def recording(path: Path) -> str:
        calls.append((path.name, threading.current_thread() is loop_thread))
        return real(path)

    monkeypatch.setattr(artifacts, "sha256_of", recording)
    return calls


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


async def test_the_index_is_built_off_the_loop_and_read_without_disk_access(
    tmp_path: Path, hashed: list[tuple[str, bool]]
) -> None:
    store = Artifacts(tmp_path)
    (tmp_path / "llama.tar.gz").write_bytes(b"by hand")
    (tmp_path / sha(b"fetched")).write_bytes(b"fetched")
    assert store.available() == set()  # nothing read before the first build
    await store.refresh()
    assert store.available() == {sha(b"by hand"), sha(b"fetched")}
    assert hashed == [("llama.tar.gz", False)]  # only the file not named by its hash; in a thread
    # Reading the index touches no disk: the files gone, it still says what it last saw.
    for path in list(tmp_path.iterdir()):
        path.unlink()
    assert store.available() == {sha(b"by hand"), sha(b"fetched")}
    assert store.path_for(sha(b"by hand")) == tmp_path / "llama.tar.gz"
    await store.refresh()
    assert store.available() == set()


async def test_a_file_is_hashed_again_only_when_it_changes(tmp_path: Path, hashed: list[tuple[str, bool]]) -> None:
    store = Artifacts(tmp_path)
    archive = tmp_path / "engine.tgz"
    archive.write_bytes(b"v1")
    await store.refresh()
    await store.refresh()
    assert [name for name, _ in hashed] == ["engine.tgz"]
    archive.write_bytes(b"v2!")
    os.utime(archive, ns=(1, 1))  # another mtime, whatever the clock's granularity
    await store.refresh()
    assert store.available() == {sha(b"v2!")}
    assert [name for name, _ in hashed] == ["engine.tgz", "engine.tgz"]


async def test_partial_downloads_dot_files_and_directories_are_not_archives(
    tmp_path: Path, hashed: list[tuple[str, bool]]
) -> None:
    (tmp_path / (sha(b"x") + ".part")).write_bytes(b"half")
    (tmp_path / ".hidden").write_bytes(b"no")
    (tmp_path / ("0" * 64)).mkdir()
    store = Artifacts(tmp_path)
    await store.refresh()
    assert store.available() == set() and hashed == []


async def test_a_missing_directory_is_an_empty_mirror(tmp_path: Path) -> None:
    store = Artifacts(tmp_path / "absent")
    await store.refresh()
    assert store.available() == set()


async def test_find_refreshes_once_for_a_hash_it_does_not_hold(tmp_path: Path) -> None:
    store = Artifacts(tmp_path)
    await store.refresh()
    (tmp_path / "dropped.tgz").write_bytes(b"just now")
    assert store.path_for(sha(b"just now")) is None
    assert await store.find(sha(b"just now")) == tmp_path / "dropped.tgz"
    assert await store.find("f" * 64) is None


async def test_serve_index_builds_before_it_starts_and_tells_of_changes(tmp_path: Path) -> None:
    (tmp_path / "first.tgz").write_bytes(b"first")
    store = Artifacts(tmp_path)
    changed = trio.Event()
    seen: list[set[str]] = []

    async def on_change() -> None:
        seen.append(store.available())
        changed.set()

    async with trio.open_nursery() as nursery:
        await nursery.start(
            lambda task_status: store.serve_index(interval_s=0.01, on_change=on_change, task_status=task_status)
        )
        assert store.available() == {sha(b"first")}  # built before `started`
        (tmp_path / "second.tgz").write_bytes(b"second")
        with trio.fail_after(10):
            await changed.wait()
        nursery.cancel_scope.cancel()
    assert seen == [{sha(b"first"), sha(b"second")}]
