"""What a release's files are called, how their SHA256SUMS reads, and whether this llmgw is one.

A release is `llmgw-VERSION-linux-ARCH.pyz` and `llama.cpp-bBUILD-linux-ARCH.tar.gz` for each
architecture and a `SHA256SUMS` listing them (docs/install.md). Both sides use this: `llmgw node
add` picks the zipapp for a node's architecture (and, from a release it is given, the llama.cpp
archive, which the node's agent then installs from NODE_RELEASE_DIR), and the control plane serves
the files it holds (`llmgw.server.nodes.releases`), the llama.cpp archives as its nodes' default llama.cpp.

Invariant: a file name is only ever taken from a SHA256SUMS line or built here, and only when it
matches `NAME` or `LLAMA_NAME` (no `/`, no whitespace), so a name read from a list can never leave
the directory it is joined to.
"""

from __future__ import annotations

import re
import sys
import zipfile
from pathlib import Path

import attrs

from llmgw.errors import UsageError
from llmgw.version import version_info

ARCHES = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}
UNAME = {"amd64": "x86_64", "arm64": "aarch64"}  # a release's architecture as `uname -m` prints it
NAME = re.compile(r"llmgw-(?P<version>[^/\s]+)-linux-(?P<arch>amd64|arm64)\.pyz\Z")
# llama.cpp built for every CPU of an architecture (release/): one top directory of the same
# name, holding llama-server and its libraries (the CPU backends chosen at run time) flat. With
# `-vulkan` after the architecture: the same files and llama.cpp's Vulkan backend (`backend`).
LLAMA_NAME = re.compile(
    r"(?P<stem>llama\.cpp-(?P<version>b\d+)-linux-(?P<arch>amd64|arm64)(?:-(?P<backend>vulkan))?)\.tar\.gz\Z"
)
LLAMA_BINARY = "llama-server"
SUMS = "SHA256SUMS"
# Under a node's agent state_dir: the llama.cpp archive of the release `llmgw node add --release`
# named and a SHA256SUMS listing it, its line copied from the operator's (node add writes it,
# agent.install.noderelease reads it).
NODE_RELEASE_DIR = "release"


def file_name(version: str, arch: str) -> str:
    return f"llmgw-{version}-linux-{arch}.pyz"


def llama_file_name(version: str, arch: str) -> str:
    """The release's llama.cpp archive of `version` (b11434) for `arch` (amd64, arm64)."""
    return f"llama.cpp-{version}-linux-{arch}.tar.gz"


def llama_binary(name: str) -> str:
    """llama-server's path inside the release's llama.cpp archive `name`."""
    m = LLAMA_NAME.match(name)
    assert m is not None, name
    return f"{m['stem']}/{LLAMA_BINARY}"


def llama_backend(name: str) -> str:
    """The backend of the release's llama.cpp archive `name`: "cpu", or "vulkan" for its Vulkan build."""
    m = LLAMA_NAME.match(name)
    assert m is not None, name
    return m["backend"] or "cpu"


def is_release_name(name: str) -> bool:
    return bool(NAME.match(name) or LLAMA_NAME.match(name))


def parse_sums(text: str, label: str) -> dict[str, str]:
    """`sha256sum` output: name → hex digest."""
    sums: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) != 2 or not re.fullmatch(r"[0-9a-f]{64}", parts[0]):
            raise UsageError(f"{label} line {number} is not `SHA256  FILE`: {line!r}")
        sums[parts[1].lstrip("*")] = parts[0]
    return sums


def release_files(sums: dict[str, str]) -> dict[str, str]:
    """The entries of a SHA256SUMS that are release files, zipapps and llama.cpp archives
    (name → digest); others are ignored."""
    return {name: digest for name, digest in sums.items() if is_release_name(name)}


def pick(sums: dict[str, str], arch: str, label: str) -> tuple[str, str, str]:
    """The one release file for `arch` a SHA256SUMS lists: (name, version, digest)."""
    found = [(name, m["version"]) for name in sums if (m := NAME.match(name)) and m["arch"] == arch]
    if not found:
        raise UsageError(
            f"{label} lists no llmgw-VERSION-linux-{arch}.pyz; the node needs the {arch} release "
            "(download both architectures' files and SHA256SUMS into one place)"
        )
    if len(found) > 1:
        raise UsageError(f"{label} lists several {arch} releases ({', '.join(n for n, _ in found)}); keep one")
    name, version = found[0]
    return name, version, sums[name]


@attrs.frozen(kw_only=True)
class Running:
    """This llmgw, when it runs from a release file."""

    path: Path  # the file, symlinks resolved: its directory may hold the rest of the release
    version: str
    arch: str  # amd64 or arm64

    @property
    def name(self) -> str:
        return file_name(self.version, self.arch)


def running_release(argv0: str | None = None) -> Running | None:
    """This llmgw's release file, or None for a development build (a checkout, a pex): the build
    info names the release's target, and the file run is a zipapp. `argv0` defaults to sys.argv[0]."""
    info = version_info()
    argv0 = argv0 if argv0 is not None else (sys.argv[0] if sys.argv else "")
    target = info.build_target
    if not argv0 or not target.startswith("linux-") or target[len("linux-") :] not in ("amd64", "arm64"):
        return None
    me = Path(argv0)
    if not me.is_file() or not zipfile.is_zipfile(me):
        return None
    return Running(path=me.resolve(), version=info.version, arch=target[len("linux-") :])
