"""Where the control plane keeps things in its state directory, and how that directory is found.

    STATE_DIR/               0700: only the user the control plane runs as may look inside
    STATE_DIR/ca/            0700: certificate authority and server certificate (llmgw.pki.files)
    STATE_DIR/llmgw.db       0600, and its -wal and -shm: SQLite store: nodes, cordons, issued and
                             revoked certificates, placements (engine keys sealed), API key hashes
    STATE_DIR/engine-keys.secret  0600: what seals the engine keys in llmgw.db (server.keyseal)
    STATE_DIR/admin.token    0600: the admin credential: whoever can read it administers the cluster
    STATE_DIR/admin.url      0644: the admin API's URL, written by a running server, read by `llmgw ctl`
    STATE_DIR/up-api-key     0600: the gateway key `llmgw up` made for you (only with `up`)
    STATE_DIR/run/           0700: a running control plane's sockets
    STATE_DIR/run/admin.sock 0600: its private socket: its own routes (admin API, page, /metrics)
                             for its gateway workers to relay to (server.adminsocket)
    STATE_DIR/run/gateway/   0700: its gateway workers' certificate (gateway.key 0600, gateway.crt,
                             ca.crt), issued anew at each start, and their settings.json (server.workers)

Each private one is made with that mode whatever the umask, and refused at start when found
open to others or owned by another user (`check_state_dir`, `llmgw.private`). The state
directory is `--state-dir`, else $LLMGW_STATE_DIR, else server.toml's `[server].state_dir`
(default /var/lib/llmgw). The environment is read when a command runs, never at import.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

from llmgw import private
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


def store_files(state_dir: Path) -> tuple[Path, Path, Path]:
    """The database and the two files SQLite keeps beside it in WAL mode."""
    db = state_dir / "llmgw.db"
    return db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")


def engine_keys_secret_path(state_dir: Path) -> Path:
    return state_dir / "engine-keys.secret"


def up_api_key_path(state_dir: Path) -> Path:
    return state_dir / "up-api-key"


def run_dir(state_dir: Path) -> Path:
    return state_dir / "run"


def admin_socket_path(state_dir: Path) -> Path:
    return run_dir(state_dir) / "admin.sock"


def workers_pki_dir(state_dir: Path) -> Path:
    return run_dir(state_dir) / "gateway"


def private_paths(state_dir: Path) -> list[tuple[Path, str, bool]]:
    """Every private path of the control plane's state directory: (path, what it holds, is a directory)."""
    ca = state_dir / "ca"  # as llmgw.pki.files.ca_paths says: named here so that `llmgw ctl` need not load cryptography
    db, wal, shm = store_files(state_dir)
    return [
        (state_dir, "the control plane's state directory", True),
        (ca, "the certificate authority's directory", True),
        (ca / "ca.key", "the CA key", False),
        (ca / "server.key", "the agent port's key", False),
        (db, "the database", False),
        (wal, "the database's write-ahead log", False),
        (shm, "the database's shared-memory index", False),
        (engine_keys_secret_path(state_dir), "the secret that seals the engine keys", False),
        (admin_token_path(state_dir), "the admin credential", False),
        (up_api_key_path(state_dir), "a gateway API key", False),
        # Not the socket in it: the directory keeps others out; a stale socket is replaced at start.
        (run_dir(state_dir), "the directory of the control plane's private socket", True),
        (workers_pki_dir(state_dir), "the directory of the gateway workers' certificate", True),
        (workers_pki_dir(state_dir) / "gateway.key", "the gateway workers' key", False),
    ]


def check_state_dir(state_dir: Path) -> None:
    """Refuse to start (`private.NotPrivate`, every problem at once) if a private path of the
    state directory that exists is open to other users or owned by another; missing ones are
    for whoever needs them to say."""
    private.require(private_paths(state_dir))


def write_private(path: Path, data: bytes, *, exclusive: bool = False) -> None:
    """Write a file only its owner can read, atomically and durably; it is never briefly readable
    by others. A missing directory is made 0700. `exclusive`: FileExistsError rather than
    replace an existing file."""
    private.make_dir(path.parent, check_existing=False)
    private.write(path, data, exclusive=exclusive)


def write_public(path: Path, text: str) -> None:
    """Write a file anyone may read but only its owner may change (0644, whatever the umask)."""
    private.write(path, text.encode(), mode=0o644)


def ensure_admin_token(state_dir: Path) -> Path:
    """Create the admin credential if there is none; an existing one is kept."""
    path = admin_token_path(state_dir)
    if not path.exists():
        with contextlib.suppress(FileExistsError):  # made meanwhile by another process: that one stays
            write_private(path, (secrets.token_urlsafe(32) + "\n").encode(), exclusive=True)
    return path


def read_admin_token(path: Path) -> str:
    try:
        # Its mode, not its owner: root may run `llmgw ctl` for a server that runs as another user.
        token = private.read(path, "the admin credential", owner=False).decode().strip()
    except FileNotFoundError:
        raise MachineError(
            f"no admin credential at {path}; it is created by `llmgw ca init` on the control plane"
        ) from None
    except PermissionError:
        raise MachineError(
            f"cannot read the admin credential {path}: it is readable only by its owner (root on a "
            "control plane); run the command with sudo, or pass a copy with --credential"
        ) from None
    except UnicodeDecodeError:
        raise MachineError(
            f"the admin credential {path} is not text; remove it and run `llmgw server` to make a new one"
        ) from None
    if not token:
        raise MachineError(f"the admin credential {path} is empty; remove it and run `llmgw server` to make a new one")
    return token
