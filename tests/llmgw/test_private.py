"""`llmgw.private`: directories made 0700 and files 0600 whatever the umask, written whole and
durably (fsync, rename, fsync of the directory, in that order), and refused with the command
that fixes them when open to others or owned by another user (run as root here: the owner
check is shown with a file given to nobody, uid 65534)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from llmgw import paths, private
from llmgw.errors import MachineError
from testlib.proc import umask

AS_ROOT = os.geteuid() == 0
NOBODY = 65534
PERMISSIVE = [0o000, 0o022]


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.parametrize("mask", PERMISSIVE + [0o777])
def test_a_directory_and_its_missing_parents_are_made_0700_whatever_the_umask(tmp_path: Path, mask: int) -> None:
    (tmp_path / "there").mkdir(mode=0o755)
    (tmp_path / "there").chmod(0o755)
    d = tmp_path / "there" / "a" / "b" / "state"
    with umask(mask):
        private.make_dir(d, "a state directory")
    assert [mode(p) for p in (d.parent.parent, d.parent, d)] == [0o700, 0o700, 0o700]
    assert mode(tmp_path / "there") == 0o755  # an existing parent is not ours to change
    private.make_dir(d)  # again: it exists, is private, nothing to say


def test_an_existing_directory_open_to_others_is_refused_with_the_chmod_that_fixes_it(tmp_path: Path) -> None:
    d = tmp_path / "state"
    d.mkdir()
    d.chmod(0o755)
    with pytest.raises(private.NotPrivate) as info:
        private.make_dir(d, "the control plane's state directory")
    assert str(info.value).startswith(
        f"{d} has mode 0755 (the control plane's state directory); fix it with `chmod 700 {d}`"
    )
    assert isinstance(info.value, MachineError) and info.value.problems[0].path == d
    assert mode(d) == 0o755  # refused, not silently changed
    private.make_dir(d, check_existing=False)  # a directory the operator chose: left as it is
    assert mode(d) == 0o755


@pytest.mark.parametrize("mask", PERMISSIVE)
def test_a_private_write_is_whole_0600_and_leaves_no_temporary(tmp_path: Path, mask: int) -> None:
    path = tmp_path / "secret"
    data = os.urandom(1 << 20)
    with umask(mask):
        private.write(path, data)
        private.write(tmp_path / "public.crt", b"cert", mode=0o644)
    assert path.read_bytes() == data and mode(path) == 0o600
    assert mode(tmp_path / "public.crt") == 0o644
    private.write(path, b"new")  # replaces: a reader sees the old file or the whole new one
    assert path.read_bytes() == b"new" and mode(path) == 0o600
    with pytest.raises(FileExistsError):
        private.write(path, b"other", exclusive=True)
    assert path.read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["public.crt", "secret"]


def test_a_private_write_syncs_the_data_then_renames_then_syncs_the_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    steps: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        st = os.fstat(fd)
        steps.append(("fsync", "dir" if stat.S_ISDIR(st.st_mode) else f"file of {st.st_size} bytes"))
        real_fsync(fd)

    def replace(src, dst) -> None:
        steps.append(("rename", Path(dst).name))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    private.write(tmp_path / "admin.token", b"0123456789")
    assert steps == [("fsync", "file of 10 bytes"), ("rename", "admin.token"), ("fsync", "dir")]


@pytest.mark.parametrize("mask", PERMISSIVE)
def test_paths_write_private_makes_its_directory_private_too(tmp_path: Path, mask: int) -> None:
    with umask(mask):
        paths.write_private(tmp_path / "new" / "up-api-key", b"k\n")
    assert mode(tmp_path / "new") == 0o700 and mode(tmp_path / "new" / "up-api-key") == 0o600


@pytest.mark.parametrize("mask", PERMISSIVE)
def test_an_empty_file_for_sqlite_is_made_0600(tmp_path: Path, mask: int) -> None:
    with umask(mask):
        assert private.create_empty(tmp_path / "llmgw.db")
    assert mode(tmp_path / "llmgw.db") == 0o600 and (tmp_path / "llmgw.db").read_bytes() == b""
    (tmp_path / "llmgw.db").write_bytes(b"kept")
    assert not private.create_empty(tmp_path / "llmgw.db")  # an existing one is not touched
    assert (tmp_path / "llmgw.db").read_bytes() == b"kept"


def test_a_key_readable_by_others_is_refused(tmp_path: Path) -> None:
    key = tmp_path / "ca.key"
    private.write(key, b"key")
    key.chmod(0o640)
    with pytest.raises(private.NotPrivate) as info:
        private.read(key, "the CA key")
    assert f"{key} has mode 0640 (the CA key); fix it with `chmod 600 {key}`" in str(info.value)
    key.chmod(0o400)  # stricter than 0600 is private too
    assert private.read(key, "the CA key") == b"key"


@pytest.mark.skipif(not AS_ROOT, reason="giving a file to another user needs root")
def test_a_file_or_directory_of_another_user_is_refused_with_the_chown_that_fixes_it(tmp_path: Path) -> None:
    token = tmp_path / "admin.token"
    private.write(token, b"t")
    os.chown(token, NOBODY, -1)
    with pytest.raises(private.NotPrivate) as info:
        private.read(token, "the admin credential")
    assert str(info.value).startswith(
        f"{token} has owner uid {NOBODY} ({private.user_name(NOBODY)}), not root who runs llmgw "
        f"(the admin credential); fix it with `chown root {token}`"
    )
    assert private.read(token, "a copy of the admin credential", owner=False) == b"t"  # `ctl --credential`
    d = tmp_path / "state"
    d.mkdir(mode=0o700)
    os.chown(d, NOBODY, -1)
    with pytest.raises(private.NotPrivate, match=f"fix it with `chown root {d}`"):
        private.make_dir(d)


def test_every_problem_is_said_at_once_with_one_command_that_fixes_them_all(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    state.chmod(0o755)
    for name in ("llmgw.db", "admin.token"):
        (state / name).write_bytes(b"x")
        (state / name).chmod(0o644)
    with pytest.raises(private.NotPrivate) as info:
        paths.check_state_dir(state)
    text = str(info.value)
    assert [p.path.name for p in info.value.problems] == ["state", "llmgw.db", "admin.token"], text
    assert (
        f"fix them all with `chmod 700 {state} && chmod 600 {state}/llmgw.db && chmod 600 {state}/admin.token`" in text
    )


def test_a_path_of_the_wrong_kind_is_refused(tmp_path: Path) -> None:
    (tmp_path / "ca").write_bytes(b"not a directory")
    found = private.check(tmp_path / "ca", "the CA's directory", is_dir=True)
    assert [p.found for p in found] == ["the wrong type: it should be a directory"]


def test_a_directory_others_may_read_but_not_write(tmp_path: Path) -> None:
    d = tmp_path / "agent"
    d.mkdir()
    d.chmod(0o755)
    assert private.check(d, "the agent's state directory", is_dir=True, writable_only=True) == []
    d.chmod(0o777)
    [problem] = private.check(d, "the agent's state directory", is_dir=True, writable_only=True)
    assert problem.fix == f"chmod go-w {d}" and problem.found == "mode 0777, writable by others"
