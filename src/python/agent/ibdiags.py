"""Installing infiniband-diags where a fabric is declared and sminfo is missing.

A declared fabric is checked against the subnet manager its adapters see, and only sminfo
(package infiniband-diags, the same name on Debian/Ubuntu and RHEL) can say which one that is.
So the agent installs the package itself, with apt-get or dnf (the first on its PATH, else
/usr/bin's), before it discovers the hardware; anywhere else it says what to install. The
decision is pure (`plan`); `ensure` runs the package manager, bounded in time like every tool.
"""

from __future__ import annotations

import os
import shutil

import attrs

from agent.discovery.tools import run_tool

PACKAGE = "infiniband-diags"
APT_GET = "/usr/bin/apt-get"
DNF = "/usr/bin/dnf"
INSTALL_TIMEOUT_S = 600.0

# Outcomes of `ensure`.
PRESENT = "present"
NOT_NEEDED = "not_needed"
INSTALLED = "installed"
FAILED = "failed"


@attrs.frozen(kw_only=True)
class Plan:
    commands: tuple[tuple[str, ...], ...]  # tried in order until sminfo is there
    env: tuple[tuple[str, str], ...] = ()
    manual: str = ""  # when there is nothing to run: what the operator should do


@attrs.frozen(kw_only=True)
class Outcome:
    status: str
    detail: str


def plan(os_family: str, *, apt_get: str = APT_GET, dnf: str = DNF) -> Plan:
    if os_family == "debian":
        install = (apt_get, "install", "-y", "--no-install-recommends", PACKAGE)
        # A fresh cloud image may have no package lists yet: install, and if that fails, update and retry.
        return Plan(
            commands=(install, (apt_get, "update"), install),
            env=(("DEBIAN_FRONTEND", "noninteractive"),),
        )
    if os_family == "rhel":
        return Plan(commands=((dnf, "install", "-y", PACKAGE),))
    return Plan(commands=(), manual=f"install the package that provides sminfo ({PACKAGE} on most distributions)")


def ensure(
    sminfo: str,
    os_family: str,
    *,
    needed: bool,
    apt_get: str | None = None,
    dnf: str | None = None,
    timeout_s: float = INSTALL_TIMEOUT_S,
) -> Outcome:
    """Install infiniband-diags if sminfo is missing and a fabric is declared (`needed`).
    `apt_get`, `dnf`: the package managers (default: found on PATH, else in /usr/bin)."""
    if os.access(sminfo, os.X_OK):
        return Outcome(status=PRESENT, detail=f"sminfo at {sminfo}")
    if not needed:
        return Outcome(status=NOT_NEEDED, detail="no fabric is declared")
    apt_get = apt_get or shutil.which("apt-get") or APT_GET
    dnf = dnf or shutil.which("dnf") or DNF
    p = plan(os_family, apt_get=apt_get, dnf=dnf)
    if not p.commands:
        return Outcome(status=FAILED, detail=f"sminfo not found at {sminfo} and no apt-get or dnf here: {p.manual}")
    last = ""
    for argv in p.commands:
        run = run_tool(argv, timeout_s=timeout_s, env=dict(p.env))
        last = f"`{' '.join(argv)}` {run.problem()}" if not run.ok else last
        if run.ok and argv[-1] == PACKAGE and os.access(sminfo, os.X_OK):
            return Outcome(status=INSTALLED, detail=f"installed {PACKAGE} with {argv[0]}; sminfo at {sminfo}")
    if not last:
        last = f"{PACKAGE} installed but there is still no sminfo at {sminfo}; set sminfo in agent.toml to where it is"
    return Outcome(status=FAILED, detail=last)
