"""A long-running llmgw service on a machine reached over SSH, as `llmgw gateway add` and
`llmgw server add` install one: its system user, the installed llmgw, and what its systemd
unit says when it will not stay up (how often systemd restarted it, its journal's last lines).

Every command is argv (llmgw.nodeadd.remote quotes it), run through sudo where it changes the
machine; nothing here decides what a service is called or where its files go: the callers'
layouts do.
"""

from __future__ import annotations

from llmgw.errors import LlmgwError, PeerError
from llmgw.nodeadd import ssh
from llmgw.nodeadd.context import SHORT_S, Facts, must, said
from llmgw.nodeadd.layout import BIN

LOG_LINES = 15


async def ensure_user(s: ssh.Session, user: str, argv: list[str]) -> bool:
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


async def install_bin(s: ssh.Session, facts: Facts) -> bool:
    """The staged release installed at BIN unless the same file is there (its sha256, read by
    `ship`); True if it was installed."""
    art = facts.artifact
    assert art is not None
    if facts.installed_sha256 == art.sha256:
        return False
    await must(s, ["install", "-D", "-m", "0755", f"{facts.stage}/llmgw", BIN], sudo=True, what=f"installing {BIN}")
    return True


async def unit_restarts(s: ssh.Session, unit: str) -> int:
    """How often systemd restarted the unit since it was last started by hand (NRestarts)."""
    res = await s.run(["systemctl", "show", "-p", "NRestarts", "--value", unit], timeout_s=SHORT_S)
    text = res.stdout.strip()
    return int(text) if res.exit_status == 0 and text.isdigit() else 0


async def journal_tail(s: ssh.Session, unit: str) -> str:
    """`; its last lines:\\n...` from the unit's journal, or "" when there is none to read."""
    argv = ["journalctl", "-u", unit, "-n", str(LOG_LINES), "--no-pager"]
    try:
        res = await s.run(argv, sudo=True, timeout_s=SHORT_S)
    except LlmgwError:
        return ""
    tail = res.stdout.rstrip() if res.exit_status == 0 else ""
    return f"; its last lines:\n{tail}" if tail else ""
