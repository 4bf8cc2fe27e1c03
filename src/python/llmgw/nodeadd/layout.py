"""What every onboarding flow (node add, gateway add, server add) puts in the same place on a
machine, and what it reads there in its first round trip.

    /usr/local/bin/llmgw          the release zipapp: one llmgw per machine, whatever it serves as
    /tmp/llmgw-node-add.XXXXXXXX  the stage: a private directory (mktemp -d) a run ships into and
                                  removes at its end, whatever happens

`probe_script` and `parse_probe` are the first round trip: hostname, architecture, init system,
os-release, and which of a flow's known tools are executable there. A machine's answer is data:
it selects a row of a fixed table or fails, and never becomes part of a command.

Also the system user and the systemd sandbox of a service llmgw installs as its own user
(gateway add, server add). Pure: rendering and deciding only, no I/O.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence

import attrs

BIN = "/usr/local/bin/llmgw"
STAGE_PREFIX = "/tmp/llmgw-node-add."


@attrs.frozen(kw_only=True)
class Probe:
    """What the first round trip read on the machine: data, never a command or a path to run."""

    hostname: str = ""
    arch: str = ""
    systemd: bool = False
    os_id: str = ""  # "" when the machine has no os-release
    os_like: tuple[str, ...] = ()
    tools: frozenset[str] = frozenset()  # which of the flow's known tools are executable there


def probe_script(tools: Sequence[str] = ()) -> str:
    """The first round trip, one constant script: nothing is interpolated into it but `tools`,
    absolute paths from a flow's own table, each quoted."""
    script = r"""
echo "hostname=$(uname -n)"
echo "arch=$(uname -m)"
if [ -d /run/systemd/system ]; then echo "systemd=yes"; else echo "systemd=no"; fi
for f in /etc/os-release /usr/lib/os-release; do
  if [ -r "$f" ]; then sed -n -e 's/^ID=/os_id=/p' -e 's/^ID_LIKE=/os_like=/p' "$f"; break; fi
done
"""
    if tools:
        script += (
            "for tool in "
            + " ".join(shlex.quote(t) for t in tools)
            + r"""; do
  if [ -x "$tool" ]; then echo "tool=$tool"; fi
done
"""
        )
    return script


PROBE = probe_script()


def parse_probe(stdout: str, tools: Sequence[str] = ()) -> Probe:
    """The probe's stdout, read as data: the first value of each key wins, other lines are
    ignored, and a `tool=` line counts only when it is one of `tools`."""
    found: dict[str, str] = {}
    seen = set()
    known = set(tools)
    for line in stdout.splitlines():
        key, sep, value = line.partition("=")
        if not sep:
            continue
        if key == "tool" and value in known:
            seen.add(value)
        elif key in ("hostname", "arch", "systemd", "os_id", "os_like"):
            found.setdefault(key, value.strip())
    return Probe(
        hostname=found.get("hostname", ""),
        arch=found.get("arch", ""),
        systemd=found.get("systemd") == "yes",
        os_id=_unquote(found.get("os_id", "")),
        os_like=tuple(_unquote(found.get("os_like", "")).split()),
        tools=frozenset(seen),
    )


def _unquote(value: str) -> str:
    # os-release values may be quoted (ID="rocky"); nothing else of shell syntax is honoured.
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
        return value[1:-1]
    return value


def system_user_argv(user: str, *, home: str, comment: str) -> list[str]:
    """Run as root where `getent passwd USER` finds no such user: a system user of its own
    group, `home` its home (not made here: the caller makes it with its mode), no login shell.
    The user a service of llmgw's runs as (`llmgw gateway add`, `llmgw server add`)."""
    return [
        "useradd", "--system", "--user-group", "--home-dir", home, "--no-create-home",
        "--shell", "/usr/sbin/nologin", "--comment", comment, user,
    ]  # fmt: skip


def service_hardening(state_dir: str) -> tuple[tuple[str, str], ...]:
    """The systemd sandbox of a service that runs as a user of its own (gateway add, server add):
    the whole system read-only but its state directory `state_dir`."""
    return (
        ("NoNewPrivileges", "yes"),
        ("ProtectSystem", "strict"),
        ("ReadWritePaths", state_dir),
        ("ProtectHome", "yes"),
        ("PrivateTmp", "yes"),
        ("PrivateDevices", "yes"),
        ("ProtectClock", "yes"),
        ("ProtectKernelTunables", "yes"),
        ("ProtectKernelModules", "yes"),
        ("ProtectKernelLogs", "yes"),
        ("ProtectControlGroups", "yes"),
        ("ProtectHostname", "yes"),
        ("ProtectProc", "invisible"),
        ("RestrictAddressFamilies", "AF_INET AF_INET6 AF_UNIX AF_NETLINK"),
        ("RestrictNamespaces", "yes"),
        ("RestrictRealtime", "yes"),
        ("RestrictSUIDSGID", "yes"),
        ("LockPersonality", "yes"),
        ("RemoveIPC", "yes"),
        ("SystemCallArchitectures", "native"),
        ("SystemCallFilter", "@system-service"),
        ("SystemCallErrorNumber", "EPERM"),
        ("AmbientCapabilities", "CAP_NET_BIND_SERVICE"),
        ("CapabilityBoundingSet", "CAP_NET_BIND_SERVICE"),
        ("UMask", "0077"),
    )
