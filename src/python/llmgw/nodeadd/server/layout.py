"""Where `llmgw server add` puts a control plane on a machine, what it copies there, and the two
files it writes: server.toml and the unit.

    /usr/local/bin/llmgw                      the release zipapp (the toolkit's path: one llmgw per machine)
    /etc/llmgw/server.toml                    0640 root:llmgw: the first control plane's, made this one's
    /var/lib/llmgw/                           0700 llmgw: the state directory, the service user's home
    /var/lib/llmgw/ca/ca.key, ca.crt          0600 / 0644 llmgw: the cluster's CA, copied
    /var/lib/llmgw/ca/server.key, server.crt  0600 / 0644 llmgw: its own agent port's, made there
    /var/lib/llmgw/engine-keys.secret         0600 llmgw: copied (server.keyseal)
    /var/lib/llmgw/admin.token                0600 llmgw: the admin credential, copied
    /var/lib/llmgw/store.password             0600 llmgw: the store's PostgreSQL password, copied
    /etc/systemd/system/llmgw-server.service  the unit

What is copied (`SECRETS`) is what every leader needs and no database holds in plain text: the
CA's key (with its certificate), the secret that seals the engine keys, the admin credential,
and the store's password. Nothing else of the state directory goes: llmgw.db is SQLite's (a
second control plane shares PostgreSQL), admin.url and run/ are a running server's own, and the
agent port's key is made on the machine for its own addresses.

The control plane runs as a system user of its own (USER), not root: it needs nothing root has,
and its files are that user's, so `llmgw.private` (which refuses a key another user owns)
accepts them. server.toml stays root's, readable by that group: the service reads it, and
cannot change it.

Pure: rendering and checking only, no I/O.
"""

from __future__ import annotations

import copy
import ipaddress
from collections.abc import Sequence
from pathlib import Path

import attrs
import tomli_w

from llmgw import config as cfg
from llmgw import paths
from llmgw.config import storeurl
from llmgw.errors import UsageError
from llmgw.nodeadd import layout as machine
from llmgw.pki.files import ca_paths

BIN = machine.BIN
USER = "llmgw"
STATE_DIR = cfg.DEFAULT_SERVER_STATE_DIR
CA_DIR = f"{STATE_DIR}/ca"
CONFIG_DIR = "/etc/llmgw"
CONFIG = f"{CONFIG_DIR}/server.toml"
PASSWORD_FILE = f"{STATE_DIR}/store.password"
SHIV_ROOT = f"{STATE_DIR}/.shiv"  # where the zipapp unpacks when the service's user runs it
ADMIN_URL = str(paths.admin_url_path(Path(STATE_DIR)))
SERVER_CERT = str(ca_paths(Path(STATE_DIR)).server_cert)
CA_CERT = str(ca_paths(Path(STATE_DIR)).ca_cert)
UNIT_NAME = "llmgw-server.service"
UNIT = f"/etc/systemd/system/{UNIT_NAME}"
STOP_S = 40  # the server lets requests in flight finish for up to 30 s on SIGTERM (docs/operations.md)
_WILDCARDS = ("0.0.0.0", "::", "")


@attrs.frozen(kw_only=True)
class Copied:
    """One file every leader needs: where it is here, where it goes there, its mode there."""

    what: str
    local: Path
    remote: str
    mode: int
    secret: bool = True  # read as a private file here (`llmgw.private`), and never shown


def secrets(state_dir: Path, password_file: str) -> tuple[Copied, ...]:
    """What `llmgw server add` copies from this control plane's state directory (and its store's
    password file, if server.toml names one), in the order it places them."""
    here = ca_paths(state_dir)
    there = ca_paths(Path(STATE_DIR))
    found = [
        Copied(what="the CA certificate", local=here.ca_cert, remote=str(there.ca_cert), mode=0o644, secret=False),
        Copied(what="the CA key", local=here.ca_key, remote=str(there.ca_key), mode=0o600),
        Copied(
            what="the engine-key secret",
            local=paths.engine_keys_secret_path(state_dir),
            remote=str(paths.engine_keys_secret_path(Path(STATE_DIR))),
            mode=0o600,
        ),
        Copied(
            what="the admin credential",
            local=paths.admin_token_path(state_dir),
            remote=str(paths.admin_token_path(Path(STATE_DIR))),
            mode=0o600,
        ),
    ]
    if password_file:
        found.append(Copied(what="the store's password", local=Path(password_file), remote=PASSWORD_FILE, mode=0o600))
    return tuple(found)


def refuse_sqlite(store: cfg.StoreSection, config_path: Path | None) -> None:
    """A second control plane shares the first one's PostgreSQL store; a SQLite one is the first
    control plane's file, which no other can share."""
    if storeurl.is_postgresql(store.url):
        return
    where = f"{config_path}'s [store]" if config_path else "the built-in defaults (no server.toml)"
    raise UsageError(
        f"this control plane's store is SQLite ({where}): its llmgw.db is a file on this machine, which a second "
        "control plane cannot share. Move the store to PostgreSQL first: `llmgw server migrate-store --to "
        f"postgresql://USER@HOST:PORT/DBNAME` while the server is stopped, then set [store] url in server.toml and "
        "start `llmgw server` (docs/operations.md), and run `llmgw server add` again"
    )


def check_store_url(url: str) -> str:
    """`--store URL` as server.toml would take it (PostgreSQL, no password in it), or a UsageError."""
    if not storeurl.is_postgresql(url):
        raise UsageError(
            '--store "sqlite" is the state directory\'s own file, which no two control planes can share; give the '
            f"PostgreSQL url this control plane's store is reached at from the machine (e.g. {storeurl.EXAMPLE})"
        )
    found = storeurl.problems(url, "", url_key="--store")
    if found:
        raise UsageError("; ".join(found))
    return url


def advertised(given: Sequence[str], host: str) -> tuple[str, ...]:
    """The addresses agents will dial the new control plane at (its agent port's
    certificate covers them): `--advertise`, else the host it is reached at over SSH."""
    return tuple(dict.fromkeys(given)) if given else (host,)


def _listen(value: str, *, loopback_ok: bool) -> tuple[str, bool]:
    """A listen address of the first control plane's, as the new one takes it: a wildcard (and,
    for `http_listen`, a loopback address) means the same on any machine and is kept; a
    particular address is the first machine's own, so its port is kept on every address."""
    host, _, port = value.rpartition(":")
    bare = host.strip("[]")
    if bare in _WILDCARDS:
        return value, False
    if loopback_ok:
        try:
            if ipaddress.ip_address(bare).is_loopback:
                return value, False
        except ValueError:
            if bare == "localhost":
                return value, False
    return f"0.0.0.0:{port}", True


@attrs.frozen(kw_only=True)
class Rendered:
    text: str
    notes: tuple[str, ...]  # what differs from the first control plane's, besides state_dir and advertise


def server_toml(source: dict, *, store_url: str, advertise: Sequence[str], password_file: bool) -> Rendered:
    """The new control plane's server.toml from the first one's (its parsed TOML, `source`): the
    same catalog, engines, limits and store; its own state directory, addresses and password
    file. Checked by the loader `llmgw server` uses before it is shipped."""
    data = copy.deepcopy(source)
    notes = []
    server = data.setdefault("server", {})
    server["state_dir"] = STATE_DIR
    server["advertise"] = list(advertise)
    for key, default, loopback_ok in (
        ("agent_listen", cfg.ServerSection().agent_listen, False),
        ("http_listen", cfg.ServerSection().http_listen, True),
    ):
        value, changed = _listen(server.get(key, default), loopback_ok=loopback_ok)
        if changed:
            notes.append(f"{key} {server[key]} is this machine's address: {value} there")
        server[key] = value
    store = data.setdefault("store", {})
    store["url"] = store_url
    store.pop("password_file", None)
    if password_file:
        store["password_file"] = PASSWORD_FILE
    release = data.get("release") or {}
    if release.get("dir"):
        notes.append(
            f"[release] dir {release['dir']} is a directory of this machine: the new control plane serves the "
            "release it runs"
        )
        del release["dir"]
    cfg.server_config_from_dict(copy.deepcopy(data), "the server.toml server add writes")  # raises if wrong
    head = (
        "# Written by `llmgw server add` from the first control plane's server.toml; running it again rewrites it.\n"
        "# Keep the catalog the same on every control plane: change it there, and add this one again.\n"
    )
    return Rendered(text=head + tomli_w.dumps(data), notes=tuple(notes))


def service_argv(*args: str) -> list[str]:
    """Run as root: the installed llmgw as the service's user (`runuser`), as the unit runs it,
    so that what it reads (the password file, the CA key) is checked as the service will."""
    return ["runuser", "-u", USER, "--", "env", "--chdir=/", f"SHIV_ROOT={SHIV_ROOT}", BIN, *args]


def user_argv() -> list[str]:
    return machine.system_user_argv(USER, home=STATE_DIR, comment="llmgw control plane")


def dirs_argv() -> list[list[str]]:
    """Run as root: the state directory and its ca/, 0700 and the service user's; /etc/llmgw."""
    return [
        ["install", "-d", "-m", "0755", CONFIG_DIR],
        ["install", "-d", "-m", "0700", "-o", USER, "-g", USER, STATE_DIR, CA_DIR],
    ]


# The sandboxing the unit sets, and each one it does not with the reason: the unit carries both
# (as comments), docs/high-availability.md shows them.
HARDENING = machine.service_hardening(STATE_DIR)
NOT_HARDENED = (
    ("MemoryDenyWriteExecute", "Python's ctypes and cffi callbacks may need memory both written and run"),
    ("PrivateNetwork", "agents, gateways, the admin API and PostgreSQL all reach it, or it them, over the network"),
)  # fmt: skip


def systemd_unit(*, bin_path: str = BIN, config_path: str = CONFIG) -> str:
    hardening = "\n".join(f"{key}={value}" for key, value in HARDENING)
    not_set = "\n".join(f"#   {key}: {why}" for key, why in NOT_HARDENED)
    return f"""\
# Written by `llmgw server add`; running it again rewrites this file.
[Unit]
Description=llmgw control plane (one of several sharing a PostgreSQL store)
After=network-online.target
Wants=network-online.target

[Service]
Type=simple
User={USER}
Group={USER}
Environment=SHIV_ROOT={SHIV_ROOT}
ExecStart={bin_path} server --config {config_path}
Restart=always
RestartSec=1
# SIGTERM: the server lets its requests in flight finish (at most 30 s), then stops.
TimeoutStopSec={STOP_S}
LimitNOFILE=65536

# Sandboxing (docs/high-availability.md, "Adding a second control plane").
{hardening}
# Not set, and why:
{not_set}

[Install]
WantedBy=multi-user.target
"""


def log_hint() -> str:
    return f"journalctl -u {UNIT_NAME}"
