"""The `install` and `service` steps every onboarding flow is built from: a long-running llmgw
service on a machine reached over SSH (a node's agent, a gateway, a control plane), its system
user, the installed llmgw, its systemd unit written, enabled and (re)started, what the unit says
when it will not stay up (how often systemd restarted it, its journal's last lines), and its
stop for good when the machine is removed (`stop_remote`, for the `remove --ssh` commands).

Every command is argv (llmgw.nodeadd.remote quotes it), run through sudo where it changes the
machine; nothing here decides what a service is called or where its files go: the flows'
layouts do.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

from llmgw.errors import LlmgwError, PeerError
from llmgw.nodeadd import ssh
from llmgw.nodeadd.context import SHORT_S, Facts, must, put_text, said
from llmgw.nodeadd.layout import BIN

LOG_LINES = 15


async def ensure_user(s: ssh.SshSession, user: str, argv: list[str]) -> bool:
    """The system user `user`, made with `argv` (`layout.system_user_argv`) if the machine has
    none; True if it was made now."""
    found = await s.run(["getent", "passwd", user], timeout_s=SHORT_S)
    if found.exit_status == 2:  # getent: no such key
        await must(s, argv, sudo=True, what=f"making the system user {user}")
    elif found.exit_status != 0:
        raise PeerError(f"{s.target}: looking up the user {user} failed ({said(found)})")
    return found.exit_status != 0


def user_text(user: str, made: bool) -> str:
    return f"user {user} ({'made' if made else 'there already'})"


async def install_bin(s: ssh.SshSession, facts: Facts) -> bool:
    """The staged release installed at BIN unless the same file is there (its sha256, read by
    `ship`); True if it was installed."""
    art = facts.artifact
    assert art is not None
    if facts.installed_sha256 == art.sha256:
        return False
    await must(s, ["install", "-D", "-m", "0755", f"{facts.stage}/llmgw", BIN], sudo=True, what=f"installing {BIN}")
    return True


async def install_unit(s: ssh.SshSession, stage: str, text: str, unit: str, name: str) -> None:
    """The unit `text` written at `unit` (through the stage), systemd reloaded, `name` enabled."""
    await put_text(s, text, f"{stage}/unit", mode=0o644)
    await must(s, ["install", "-m", "0644", f"{stage}/unit", unit], sudo=True, what=f"writing {unit}")
    await must(s, ["systemctl", "daemon-reload"], sudo=True, what="reloading systemd")
    await must(s, ["systemctl", "enable", name], sudo=True, what=f"enabling {name}")


async def restart(s: ssh.SshSession, name: str) -> None:
    await must(s, ["systemctl", "restart", name], sudo=True, what=f"starting {name}")


async def unit_restarts(s: ssh.SshSession, unit: str) -> int:
    """How often systemd restarted the unit since it was last started by hand (NRestarts)."""
    res = await s.run(["systemctl", "show", "-p", "NRestarts", "--value", unit], timeout_s=SHORT_S)
    text = res.stdout.strip()
    return int(text) if res.exit_status == 0 and text.isdigit() else 0


async def journal_tail(s: ssh.SshSession, unit: str) -> str:
    """`; its last lines:\\n...` from the unit's journal, or "" when there is none to read."""
    argv = ["journalctl", "-u", unit, "-n", str(LOG_LINES), "--no-pager"]
    try:
        res = await s.run(argv, sudo=True, timeout_s=SHORT_S)
    except LlmgwError:
        return ""
    tail = res.stdout.rstrip() if res.exit_status == 0 else ""
    return f"; its last lines:\n{tail}" if tail else ""


async def stop_remote(
    target: str,
    *,
    known_hosts: Path,
    accept_new_host_key: bool,
    identity_files: tuple[Path, ...] | None,
    ssh_port: int,
    how: Callable[[ssh.SshSession], Awaitable[tuple[list[str], str]]],
    what: str,
    done: str,
    timeout_s: float,
) -> str:
    """Log in to `target` and stop `what` (its service) for good: `how(session)` says the argv
    and, in words, what it does (after what the machine answered, e.g. whether it runs systemd).
    `done` is what happened already, for the message when this fails. Returns the words."""
    async with ssh.open_session(
        target,
        known_hosts=known_hosts,
        accept_new_host_key=accept_new_host_key,
        client_keys=identity_files,
        port=ssh_port,
    ) as s:
        argv, words = await how(s)
        res = await s.run(argv, sudo=True, timeout_s=timeout_s)
    if res.exit_status != 0:
        raise PeerError(
            f"{done}, but stopping {what} on {target} failed ({words}: exit status {res.exit_status}: "
            f"{(res.stderr or res.stdout).strip()[-400:]}); stop it there by hand"
        )
    return words
