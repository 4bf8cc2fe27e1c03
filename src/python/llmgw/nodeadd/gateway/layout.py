"""Where `llmgw gateway add` puts things on a gateway's machine, and the unit it writes there.

    /usr/local/bin/llmgw                       the release zipapp (the toolkit's path: one llmgw per machine)
    /var/lib/llmgw-gateway/                    the gateway user's home, 0700, owned by it
    /var/lib/llmgw-gateway/pki/                gateway.key (made there, never leaves), gateway.csr,
                                               gateway.crt, ca.crt; `llmgw gateway`'s default --pki-dir
    /etc/systemd/system/llmgw-gateway.service  the unit

The gateway runs as a system user of its own (USER), not root: it faces clients, and needs
nothing root has but a port below 1024 (CAP_NET_BIND_SERVICE, the one capability it keeps).
Its files are that user's, so `llmgw.private` (which refuses a key another user owns) accepts
them, and the commands that make its key run as that user.

Pure: rendering and checking only, no I/O.
"""

from __future__ import annotations

import re

from llmgw.errors import UsageError
from llmgw.nodeadd import layout as machine

BIN = machine.BIN
USER = "llmgw-gateway"
STATE_DIR = "/var/lib/llmgw-gateway"
PKI_DIR = f"{STATE_DIR}/pki"  # `llmgw gateway --pki-dir`'s default (a test keeps them equal)
SHIV_ROOT = f"{STATE_DIR}/.shiv"  # where the zipapp unpacks when the gateway's user runs it
UNIT_NAME = "llmgw-gateway.service"
UNIT = f"/etc/systemd/system/{UNIT_NAME}"
DEFAULT_LISTEN = "0.0.0.0:8080"
# A word of the unit's ExecStart: nothing systemd would read as a specifier (%), a variable ($),
# a quote or a separator. What goes there is llmgw's own paths, a checked name, an address the
# server certificate covers and --listen, checked against this before it is written.
_UNIT_WORD = re.compile(r"[A-Za-z0-9_./:\[\]=-]+")
_LISTEN_HOST = re.compile(r"\[[0-9A-Fa-f:.]+\]|[0-9A-Fa-f:.]+|[A-Za-z0-9.-]+")
STOP_S = 45  # the gateway drains for up to 30 s on SIGTERM (llmgw.gatewayd's DRAIN_S), then stops

# The sandboxing the unit sets, and each one it does not with the reason: the unit carries both
# (as comments), docs/gateway.md shows them, and a test keeps them agreeing.
HARDENING = machine.service_hardening(STATE_DIR)
NOT_HARDENED = (
    ("MemoryDenyWriteExecute", "Python's ctypes and cffi callbacks may need memory both written and run, "
     "and a refusal there would kill a worker rather than fail one call"),
    ("PrivateNetwork", "the gateway's whole work is the network: clients, the control plane, the engines"),
    ("IPAddressDeny", "the engines' and clients' addresses are the cluster's business, not the unit's"),
)  # fmt: skip


def check_listen(value: str) -> str:
    """`--listen ADDR:PORT` as `llmgw gateway` takes it, or a UsageError saying what it must be."""
    host, sep, port = value.rpartition(":")
    good_host = _LISTEN_HOST.fullmatch(host) is not None
    if not sep or not good_host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"--listen {value!r} must be ADDR:PORT (0.0.0.0:8080, [::]:8080), with a port from 1 to 65535")
    return value


def check_workers(value: str) -> str:
    """`--workers N` (1 or more) or `auto` (one per CPU of the machine), or a UsageError."""
    if value == "auto" or (value.isdigit() and int(value) >= 1):
        return value
    raise UsageError(f"--workers {value!r} must be a whole number of workers, 1 or more, or auto (one per CPU)")


def gateway_argv(
    *, server: str | tuple[str, ...], listen: str, workers: str, name: str, bin_path: str = BIN
) -> list[str]:
    """The gateway's command, as the unit runs it; each word one that systemd takes literally.
    `server`: the control plane's agent port, or every one's (this one first)."""
    servers = [server] if isinstance(server, str) else list(server)
    argv = [
        bin_path, "gateway", *(w for url in servers for w in ("--server", url)), "--listen", listen,
        "--workers", workers, "--pki-dir", PKI_DIR, "--name", name,
    ]  # fmt: skip
    odd = [word for word in argv if _UNIT_WORD.fullmatch(word) is None]
    if odd:
        raise ValueError(f"{odd!r} cannot go into a unit's ExecStart as it is")  # a bug: the callers check first
    return argv


def csr_argv(name: str) -> list[str]:
    """Run as root: make (or keep) the gateway's key and write its request, as the gateway's user
    (`runuser`), in its home, with the installed llmgw: the files are then that user's own."""
    return [
        "runuser", "-u", USER, "--", "env", "--chdir=/", f"SHIV_ROOT={SHIV_ROOT}",
        BIN, "gateway", "csr", "--pki-dir", PKI_DIR, "--name", name,
    ]  # fmt: skip


def user_argv() -> list[str]:
    """Run as root where `getent passwd USER` finds no such user: the gateway's system user."""
    return machine.system_user_argv(USER, home=STATE_DIR, comment="llmgw gateway")


def dirs_argv() -> list[str]:
    """Run as root: the gateway's home and pki directory, 0700 and its user's (again: converges)."""
    return ["install", "-d", "-m", "0700", "-o", USER, "-g", USER, STATE_DIR, PKI_DIR]


def systemd_unit(*, server: str | tuple[str, ...], listen: str, workers: str, name: str, bin_path: str = BIN) -> str:
    exec_start = " ".join(gateway_argv(server=server, listen=listen, workers=workers, name=name, bin_path=bin_path))
    server = server if isinstance(server, str) else " and ".join(server)
    hardening = "\n".join(f"{key}={value}" for key, value in HARDENING)
    not_set = "\n".join(f"#   {key}: {why}" for key, why in NOT_HARDENED)
    return f"""\
# Written by `llmgw gateway add`; running it again rewrites this file.
[Unit]
Description=llmgw gateway {name}: the OpenAI-compatible gateway, fed by the control plane at {server}
After=network-online.target
Wants=network-online.target

[Service]
Type=simple
User={USER}
Group={USER}
Environment=SHIV_ROOT={SHIV_ROOT}
ExecStart={exec_start}
Restart=always
RestartSec=2
# SIGTERM to the gateway's parent alone: it stops its workers, which finish the requests in
# flight first; whatever is left after TimeoutStopSec is killed.
KillMode=mixed
TimeoutStopSec={STOP_S}

# Sandboxing (docs/gateway.md, "Adding a gateway machine").
{hardening}
# Not set, and why:
{not_set}

[Install]
WantedBy=multi-user.target
"""


def log_hint() -> str:
    return f"journalctl -u {UNIT_NAME}"
