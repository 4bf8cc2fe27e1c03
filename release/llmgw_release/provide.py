"""What the release build needs of this machine, provided before it builds, as `./pants test` provides the tests'.

`./pants test` installs what the suite runs (tools/testenv/prepare.py), and the suite builds
llama.cpp for this machine's architecture only. The release also builds the other architecture's
llama.cpp with Debian's cross compiler and runs it once under qemu-user, with that architecture's C
library: packages a machine that passed `./pants test` does not have. `needs` lists them, with the
native build's, from what the build itself checks (`llamabuild.needed_tools`,
`llamasmoke.smoke_needs`), so the two cannot drift; `provide` hands them to prepare.py's package
step: installed with apt-get when the build runs as root, otherwise the one command to run is said
and the build stops before it builds anything.

Invariant: a build that gets past `provide` finds every program its checks look for.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from collections.abc import Callable, Sequence

from llmgw import llamarecipe
from llmgw_release import llamabuild, llamasmoke, llamavulkan
from testenv import prepare
from testenv.prepare import Machine, Need

GIT = Need("git", ("git",), "the release names the commit it was built from")


def needs(arches: Sequence[str], host: str) -> tuple[Need, ...]:
    """The Debian packages that building and running llama.cpp for `arches` takes on a `host` machine."""
    provides: dict[str, list[str]] = {}
    whys: dict[str, dict[str, list[str]]] = {}  # package -> what it does -> for which architectures

    def add(items: dict[str, str], arch: str, does: str) -> None:
        for item, package in items.items():
            have = provides.setdefault(package, [])
            if item not in have:
                have.append(item)
            archs = whys.setdefault(package, {}).setdefault(does, [])
            if arch not in archs:
                archs.append(arch)

    for arch in arches:
        tc = llamarecipe.toolchain(arch, host)
        add(llamabuild.needed_tools(tc), arch, "builds llama.cpp for {}")
        if not tc.cross:  # the Vulkan build is native only (llmgw.llamarecipe)
            add(llamavulkan.needed_tools(tc), arch, "builds llama.cpp's Vulkan module for {}")
        add(llamasmoke.smoke_needs(arch, host), arch, "runs the {} llama.cpp once under qemu-user before it ships")
    return (
        GIT,
        *(
            Need(package, tuple(items), "; ".join(does.format(" and ".join(a)) for does, a in whys[package].items()))
            for package, items in provides.items()
        ),
    )


def provide(m: Machine, arches: Sequence[str], host: str, *, again: str) -> bool:
    """True when everything is there (installed now, as root); else it said what to run, then `again`."""
    return prepare.ensure_packages(m, needs(arches, host), need="the release build needs", again=again)


STDERR = 2  # the descriptor, not sys.stderr: a program's output goes there whatever Python wraps it in


def _run(argv: Sequence[str], env: dict) -> int:
    # apt-get's output on stderr: the build's stdout is SHA256SUMS alone.
    sys.stderr.flush()
    return subprocess.run(list(argv), env={**os.environ, **env}, stdout=STDERR, check=False).returncode


def _no_handover(name: str, value: str) -> None:
    raise AssertionError(f"the release build hands nothing to Pants ({name}={value})")


def real_machine(say: Callable[[str], None]) -> Machine:
    """This machine, as prepare.py sees it, saying things the release build's way."""
    return dataclasses.replace(prepare.real_machine(_no_handover), say=say, run=_run)
