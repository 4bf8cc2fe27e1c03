"""The files that carry engines' keys: one private directory per replica member.

    STATE/keys/                              0700, the agent's user's
    STATE/keys/<replica_id>-r<rank>/         0700, made afresh before each start of the engine
    STATE/keys/<replica_id>-r<rank>/api-key  0600, what the engine spec's `Command.files` say

An engine reads its key from there (`--api-key-file`, SGLang's `--config`) rather than from
argv, which every user of the node can read in /proc/PID/cmdline. The directory lives as long
as the member's engine runs, so an agent that dies leaves it for the agent that adopts the
engine (`agent.adoption`), which removes it when that engine stops; whatever no running engine
needs is removed when the supervisor starts (`sweep`).

Every path is built from checked plain names (`agent.weights.check_name`), and nothing here
follows a symbolic link: a link planted in the way is refused, not written through.
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Iterable
from pathlib import Path

from llmgw.engines import Command
from llmgw.log import get_logger

log = get_logger("llmgw.agent.replicas")

Key = tuple[str, int]  # (replica_id, node_rank)


class UnsafeKeyDir(OSError):
    """The keys directory is not one only this user can read: nothing is written there."""


class KeyFiles:
    def __init__(self, root: Path) -> None:
        self.root = root

    def dir_for(self, replica_id: str, rank: int) -> Path:
        return self.root / f"{replica_id}-r{rank}"

    def write(self, replica_id: str, rank: int, command: Command) -> None:
        """Write `command.files` (0600) into the member's directory, made afresh (0700).

        Raises OSError (`UnsafeKeyDir` among them) if they cannot be written privately."""
        member = self.dir_for(replica_id, rank)
        if not command.files:  # a worker serves nothing and reads no key
            self.remove(replica_id, rank)
            return
        self._private_root()
        _remove_tree(member)
        os.mkdir(member, 0o700)
        for f in command.files:
            path = Path(f.path)
            if path.parent != member:
                raise UnsafeKeyDir(f"the engine's key file {path} is not in its member's directory {member}")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                data = f.content.reveal().encode()
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
            finally:
                os.close(fd)

    def remove(self, replica_id: str, rank: int) -> None:
        """Remove the member's directory (nothing if there is none). Never raises: a leftover is
        logged, and removed by the next `write` or `sweep`."""
        try:
            _remove_tree(self.dir_for(replica_id, rank))
        except OSError as exc:
            log.warning("replica_key_not_removed", replica=replica_id, rank=rank, reason=str(exc))

    def sweep(self, keep: Iterable[Key]) -> None:
        """Remove every member directory but those of `keep` (the engines still running)."""
        wanted = {self.dir_for(r, n).name for r, n in keep}
        try:
            entries = list(os.scandir(self.root))
        except FileNotFoundError:
            return
        except OSError as exc:
            log.warning("replica_keys_unreadable", path=str(self.root), reason=str(exc))
            return
        for entry in entries:
            if entry.name not in wanted:
                try:
                    _remove_tree(Path(entry.path))
                except OSError as exc:
                    log.warning("replica_key_not_removed", path=entry.path, reason=str(exc))

    def _private_root(self) -> None:
        """Make the keys directory 0700, or check the one there: ours, a directory, not a link."""
        self.root.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(self.root, 0o700)
        except FileExistsError:
            pass
        st = os.lstat(self.root)
        if not stat.S_ISDIR(st.st_mode):
            raise UnsafeKeyDir(f"{self.root} is not a directory; remove it, and the agent makes it again (0700)")
        if st.st_uid != os.geteuid():
            raise UnsafeKeyDir(
                f"{self.root} belongs to uid {st.st_uid}, not to the agent's user (uid {os.geteuid()}): "
                f"`chown {os.geteuid()} {self.root}`"
            )
        if st.st_mode & 0o077:
            os.chmod(self.root, 0o700)  # ours: tightening it is safe, and the umask may have loosened it
            log.warning("replica_keys_dir_tightened", path=str(self.root), was=oct(stat.S_IMODE(st.st_mode)))


def _remove_tree(path: Path) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)  # does not follow links inside (it unlinks them)
    else:
        os.unlink(path)  # a file or a link where a directory should be: the link, not its target
