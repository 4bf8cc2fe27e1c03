"""Where the control plane keeps things in its state directory, and how that directory is found.

    STATE_DIR/ca/            certificate authority and server certificate (llmgw.pki)
    STATE_DIR/llmgw.db       SQLite store: nodes, cordons, issued and revoked certificates
    STATE_DIR/admin.token    the admin credential (0600): whoever can read it administers the cluster
    STATE_DIR/admin.url      the admin API's URL, written by a running server, read by `llmgw ctl`

The state directory is `--state-dir`, else $LLMGW_STATE_DIR, else server.toml's
`[server].state_dir` (default /var/lib/llmgw). The environment is read when a command runs,
never at import.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from llmgw.errors import MachineError

STATE_DIR_ENV = "LLMGW_STATE_DIR"


def admin_token_path(state_dir: Path) -> Path:
    return state_dir / "admin.token"


def admin_url_path(state_dir: Path) -> Path:
    return state_dir / "admin.url"


def state_dir_from(flag: str | Path | None, configured: str) -> Path:
    if flag:
        return Path(flag)
    env = os.environ.get(STATE_DIR_ENV)
    return Path(env) if env else Path(configured)


def write_private(path: Path, data: bytes) -> None:
    """Write a file only its owner can read, atomically; it is never briefly readable by others."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def ensure_admin_token(state_dir: Path) -> Path:
    """Create the admin credential if there is none; an existing one is kept."""
    path = admin_token_path(state_dir)
    if not path.exists():
        write_private(path, (secrets.token_urlsafe(32) + "\n").encode())
    return path


def read_admin_token(path: Path) -> str:
    try:
        token = path.read_text().strip()
    except FileNotFoundError:
        raise MachineError(
            f"no admin credential at {path}; it is created by `llmgw ca init` on the control plane"
        ) from None
    except PermissionError:
        raise MachineError(
            f"cannot read the admin credential {path}: it is readable only by its owner (root on a "
            "control plane); run the command with sudo, or pass a copy with --credential"
        ) from None
    if not token:
        raise MachineError(f"the admin credential {path} is empty; remove it and run `llmgw server` to make a new one")
    return token
