#!/usr/bin/env python3
"""Builds (once) the Debian 12 root that the systemd test machines boot, and says where it is.

The root is a real Debian 12 ("bookworm") made by debootstrap from Debian's packages: systemd as
init, dbus, a real sshd, python3 (the release's runtime), sudo, cloud-init with ifupdown (how a
Debian cloud image configures itself) and the few tools node add uses. tests/testlib/machine.py
boots copies of it (an overlay each) with `systemd-nspawn --boot`; the root itself is never
written to after it is built.

    python3 tools/testenv/debian_root.py            build it unless built; print its path
    python3 tools/testenv/debian_root.py --cached   print its path, or exit 3 when it is not built

The cache is keyed by what goes into the root (suite, packages, mirror), so changing PACKAGES
builds a new one beside the old: $LLMGW_MACHINE_CACHE, else ~/.cache/llmgw-machine. One build at a
time (a lock file); a build that stops half way leaves only a `*.partial` directory, removed by the
next build. Measured here: about a minute, 300 MB.

Runs as root (debootstrap needs it) on CPython 3.9 and later; the standard library only.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

SUITE = "bookworm"
MIRROR = os.environ.get("LLMGW_DEBIAN_MIRROR", "http://deb.debian.org/debian")
PACKAGES = (
    "systemd",
    "systemd-sysv",
    "dbus",
    "openssh-server",
    "python3",
    "sudo",
    "iproute2",
    "ifupdown",
    "procps",
    "curl",
    "ca-certificates",
    "cloud-init",
    "locales",  # cloud-init's locale module sets LANG with it, as on Debian's cloud images
    # debootstrap resolves no virtual package: python3-cryptography (cloud-init's) needs the
    # python3-cffi-backend-api-* that only this one provides.
    "python3-cffi-backend",
)
NOT_BUILT = 3
FINISH = 2  # bump when _finish changes: it is part of the cache key


def cache_dir() -> Path:
    given = os.environ.get("LLMGW_MACHINE_CACHE")
    if given:
        return Path(given)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llmgw-machine"


def key() -> str:
    text = "\n".join([SUITE, MIRROR, *PACKAGES, str(FINISH)])
    return f"debian12-{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def root_path() -> Path:
    return cache_dir() / key() / "root"


def _finish(root: Path) -> None:
    """What every machine made from the root shares: nothing that makes one unlike another."""
    # systemd gives each booted copy its own machine id when the file is empty ("uninitialized").
    (root / "etc" / "machine-id").write_text("")
    # The host's name and addresses come from the test (or cloud-init), not from debootstrap's host.
    (root / "etc" / "hostname").write_text("localhost\n")
    resolv = root / "etc" / "resolv.conf"
    if resolv.is_symlink() or resolv.exists():
        resolv.unlink()
    resolv.write_text("")
    # As on Debian's cloud images: the locale cloud-init's locale module sets (LANG=en_US.UTF-8) exists.
    (root / "etc" / "locale.gen").write_text("en_US.UTF-8 UTF-8\n")
    subprocess.run(["chroot", str(root), "locale-gen"], check=True, capture_output=True)
    subprocess.run(["chroot", str(root), "apt-get", "clean"], check=True)
    shutil.rmtree(root / "var" / "lib" / "apt" / "lists", ignore_errors=True)
    (root / "var" / "lib" / "apt" / "lists" / "partial").mkdir(parents=True)


def build() -> Path:
    root = root_path()
    if root.is_dir():
        return root
    if os.geteuid() != 0:
        raise SystemExit("debootstrap needs root: run this (or ./pants test) as root")
    if not shutil.which("debootstrap"):
        raise SystemExit("no debootstrap: apt-get install debootstrap (./pants test installs it)")
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if root.is_dir():  # another build finished while this one waited
            return root
        partial = root.parent / "root.partial"
        if partial.exists():
            subprocess.run(["rm", "-rf", "--one-file-system", str(partial)], check=True)
        print(
            f"building the Debian 12 test machine's root with debootstrap into {root} (about a minute, once)",
            file=sys.stderr,
        )
        argv = [
            "debootstrap",
            "--variant=minbase",
            f"--include={','.join(PACKAGES)}",
            SUITE,
            str(partial),
            MIRROR,
        ]
        log = root.parent / "debootstrap.log"
        with open(log, "w") as out:
            status = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, check=False).returncode
        if status != 0:
            tail = log.read_text(errors="replace").splitlines()[-15:]
            raise SystemExit(
                f"debootstrap failed with status {status}; its log is {log}:\n" + "\n".join(tail) + "\n"
                f"check that {MIRROR} is reachable (LLMGW_DEBIAN_MIRROR names another Debian mirror)"
            )
        _finish(partial)
        partial.rename(root)
    return root


def main(argv: list[str]) -> int:
    if argv[1:] == ["--cached"]:
        root = root_path()
        if not root.is_dir():
            return NOT_BUILT
        print(root)
        return 0
    if argv[1:]:
        print(__doc__, file=sys.stderr)
        return 2
    print(build())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
