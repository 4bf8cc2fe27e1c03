"""What a llama.cpp build needs on this node, found or named ([engines.llamacpp] build,
`agent.install.build`): the compilers, CMake, ninja or make, `nice`, and `nvcc` for CUDA; what
is missing said as people name it, with the command that installs it on this distribution.

Pure but for `which`, the PATH lookup every function is given (`which_on`), and `find_nvcc`'s
look at where the CUDA toolkit installs it. Used before any build: the installer finds the
`Toolchain` before downloading the source (fail fast), the agent's engines and discovery ask
`probe_tools` what a build could be (`BuildTools`), and doctor names the install command
(`install_hint_for`).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable

import attrs

from agent.install.errors import BuildToolsMissing

NVCC_PLACES = ("/usr/local/cuda/bin/nvcc",)  # where the CUDA toolkit installs it, often off PATH


@attrs.frozen(kw_only=True)
class Toolchain:
    """The tools a build runs with, as `find_toolchain` found them on the agent's PATH."""

    cmake: str
    generator: str  # "Ninja" or "Unix Makefiles"
    nvcc: str = ""  # "" when this node has none
    nice: str = ""  # "" when this node has none: the build then runs at the agent's priority
    # The compilers' names (looked up on PATH, as the portable recipe names them): the release's
    # gcc and g++ where the node has them.
    cc: str = "gcc"
    cxx: str = "g++"


@attrs.frozen(kw_only=True)
class BuildTools:
    """What this node has for a build, before one is chosen: the agent picks a CUDA build only
    where it can run (agent.engines)."""

    missing: tuple[str, ...] = ()  # what find_toolchain would name
    nvcc: str = ""

    @property
    def complete(self) -> bool:
        return not self.missing


C_COMPILERS = ("gcc", "cc", "clang")  # preferred first: gcc is the release's
CXX_COMPILERS = ("g++", "c++", "clang++")


def missing_tools(which: Callable[[str], str | None]) -> list[str]:
    """What a build needs and `which` does not find, as people name it."""
    missing = []
    if not any(which(c) for c in C_COMPILERS):
        missing.append("a C compiler (cc, gcc or clang)")
    if not any(which(c) for c in CXX_COMPILERS):
        missing.append("a C++ compiler (c++, g++ or clang++)")
    if not which("cmake"):
        missing.append("cmake")
    if not (which("ninja") or which("ninja-build") or which("make")):
        missing.append("make (or ninja)")
    return missing


def find_nvcc(which: Callable[[str], str | None]) -> str:
    return which("nvcc") or next((p for p in NVCC_PLACES if os.access(p, os.X_OK)), "")


def probe_tools(which: Callable[[str], str | None]) -> BuildTools:
    return BuildTools(missing=tuple(missing_tools(which)), nvcc=find_nvcc(which))


def find_toolchain(which: Callable[[str], str | None], os_release: str, path: str) -> Toolchain:
    """The tools a build needs, found with `which`; BuildToolsMissing names what to install."""
    missing = missing_tools(which)
    cmake = which("cmake")
    ninja = which("ninja") or which("ninja-build")
    if missing:
        raise BuildToolsMissing(
            f"this node cannot build llama.cpp: missing on the agent's PATH ({path}): {', '.join(missing)}; "
            f"install them: {install_hint(os_release)}; then the agent builds it at its next try (or restart "
            "it). Or give the control plane the release's llama.cpp archive for this architecture (in its "
            "[release] dir), or [engines.llamacpp] a prebuilt archive for this node in server.toml, or name an "
            "installed llama-server with `llamacpp_bin` in agent.toml"
        )
    return Toolchain(
        cmake=str(cmake),
        generator="Ninja" if ninja else "Unix Makefiles",
        nvcc=find_nvcc(which),
        nice=which("nice") or "",
        cc=next(c for c in C_COMPILERS if which(c)),
        cxx=next(c for c in CXX_COMPILERS if which(c)),
    )


_DEBIAN = "apt-get install build-essential cmake"
_RHEL = "dnf install gcc-c++ cmake make"


def install_hint_for(os_family: str) -> str:
    """The install command for doctor's OS family ("debian", "rhel", or "": both)."""
    return {"debian": _DEBIAN, "rhel": _RHEL}.get(
        os_family
    ) or f"`{_DEBIAN}` on Debian or Ubuntu, `{_RHEL}` on the RHEL family"


def install_hint(os_release: str) -> str:
    """The install command for this distribution (from /etc/os-release's ID and ID_LIKE)."""
    fields = {}
    for line in os_release.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            fields[key.strip()] = value.strip().strip("\"'").lower()
    family = {fields.get("ID", ""), *fields.get("ID_LIKE", "").split()}
    if family & {"debian", "ubuntu"}:
        return _DEBIAN
    if family & {"rhel", "fedora", "centos", "rocky", "almalinux"}:
        return _RHEL
    if family & {"suse", "opensuse", "sles"}:
        return "zypper install gcc-c++ cmake make"
    if "alpine" in family:
        return "apk add build-base cmake"
    return f"`{_DEBIAN}` on Debian or Ubuntu, `{_RHEL}` on the RHEL family"


def which_on(path: str) -> Callable[[str], str | None]:
    return lambda name: shutil.which(name, path=path)
