"""The engines' key files: private whatever the umask, never written through a planted link,
removed with their engine, swept at start but for the engines still running."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.key_files import KeyFiles, UnsafeKeyDir
from llmgw.config import Secret
from llmgw.engines import Command
from llmgw.engines.launch import PrivateFile

KEY = "k-0123456789abcdef"


def command(keys: KeyFiles, replica: str = "m-1", rank: int = 0, name: str = "api-key") -> Command:
    path = keys.dir_for(replica, rank) / name
    return Command(
        argv=("engine", "--api-key-file", str(path)), files=(PrivateFile(path=str(path), content=Secret(KEY + "\n")),)
    )


def mode(path: Path) -> int:
    return path.lstat().st_mode & 0o777


@pytest.fixture
def open_umask() -> Iterator[None]:
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def test_files_are_private_whatever_the_umask(tmp_path: Path, open_umask: None) -> None:
    keys = KeyFiles(tmp_path / "state" / "keys")
    keys.write("m-1", 0, command(keys))
    key_file = keys.dir_for("m-1", 0) / "api-key"
    assert key_file.read_text() == KEY + "\n"
    assert (mode(keys.root), mode(key_file.parent), mode(key_file)) == (0o700, 0o700, 0o600)
    # Written again (the engine restarts): made afresh, nothing left of the last start.
    (key_file.parent / "stale").write_text("x")
    keys.write("m-1", 0, command(keys))
    assert sorted(p.name for p in key_file.parent.iterdir()) == ["api-key"]


def test_a_loose_keys_directory_of_ours_is_tightened(tmp_path: Path) -> None:
    keys = KeyFiles(tmp_path / "keys")
    keys.root.mkdir(mode=0o755)
    os.chmod(keys.root, 0o755)
    keys.write("m-1", 0, command(keys))
    assert mode(keys.root) == 0o700


def test_a_keys_directory_that_is_a_link_or_someone_elses_is_refused(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    keys = KeyFiles(tmp_path / "keys")
    keys.root.symlink_to(elsewhere)
    with pytest.raises(UnsafeKeyDir, match="is not a directory"):
        keys.write("m-1", 0, command(keys))
    assert list(elsewhere.iterdir()) == []
    if os.geteuid() != 0:
        pytest.skip("giving the directory to another user needs root")
    keys.root.unlink()
    keys.root.mkdir(mode=0o700)
    os.chown(keys.root, 65534, 65534)
    with pytest.raises(UnsafeKeyDir, match=rf"belongs to uid 65534.*`chown {os.geteuid()} {keys.root}`"):
        keys.write("m-1", 0, command(keys))


def test_a_link_planted_where_a_members_directory_goes_is_removed_not_followed(tmp_path: Path) -> None:
    keys = KeyFiles(tmp_path / "keys")
    keys.write("other", 0, command(keys, "other"))  # makes the keys directory
    target = tmp_path / "target"
    target.mkdir()
    keys.dir_for("m-1", 0).symlink_to(target)
    keys.write("m-1", 0, command(keys))
    assert list(target.iterdir()) == []  # nothing written through the link
    assert not keys.dir_for("m-1", 0).is_symlink() and (keys.dir_for("m-1", 0) / "api-key").exists()


def test_a_file_outside_its_members_directory_is_refused(tmp_path: Path) -> None:
    keys = KeyFiles(tmp_path / "keys")
    stray = Command(argv=("x",), files=(PrivateFile(path=str(tmp_path / "api-key"), content=Secret(KEY)),))
    with pytest.raises(UnsafeKeyDir, match="is not in its member's directory"):
        keys.write("m-1", 0, stray)
    assert not (tmp_path / "api-key").exists()


def test_remove_and_sweep(tmp_path: Path) -> None:
    keys = KeyFiles(tmp_path / "keys")
    for replica in ("a-1", "b-1", "c-1"):
        keys.write(replica, 0, command(keys, replica))
    keys.remove("a-1", 0)
    keys.remove("a-1", 0)  # nothing there: no error
    assert not keys.dir_for("a-1", 0).exists()
    keys.sweep([("c-1", 0)])  # the engines still running (adopted) keep theirs
    assert sorted(p.name for p in keys.root.iterdir()) == ["c-1-r0"]
    KeyFiles(tmp_path / "none").sweep([])  # no directory yet: nothing to do
