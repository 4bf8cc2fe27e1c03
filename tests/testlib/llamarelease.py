"""A release directory holding llama.cpp as the release carries it, for tests of the node side.

For this machine's architecture it is the release's own archive as `./pants test` built it (for
this CPU's variants: release/llmgw_release/llamabuild.py, cached), copied as it is. For another
architecture (a node the release "covers" only on paper) it is a stand-in of the same layout
made from this machine's build: `llama.cpp-VERSION-linux-ARCH.tar.gz` with one top directory of
the same name holding `llama-server` flat with its libraries and CPU backends, and LICENSE;
listed with its sha256 in SHA256SUMS. `server` names another llama-server (a single static
binary, which reports the `built-in` backend) for a stand-in of every architecture.
"""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from pathlib import Path

from llmgw_release import llamabuild

from llmgw import pins
from llmgw.releasefiles import SUMS, llama_file_name
from testlib import llama

LICENSE = "MIT License\n\nCopyright (c) 2023-2026 The ggml authors\n"


def archive_bytes(server_dir: Path, arch: str, version: str = pins.LLAMACPP_VERSION, *, only=None) -> bytes:
    """A llama.cpp archive for `arch` holding the files of `server_dir` (or just `only` of them)."""
    top = llama_file_name(version, arch).removesuffix(".tar.gz")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        directory = tarfile.TarInfo(top)
        directory.type, directory.mode = tarfile.DIRTYPE, 0o755
        tar.addfile(directory)
        names = sorted(only or (p.name for p in server_dir.iterdir()))
        for name in names:
            path = server_dir / name
            info = tarfile.TarInfo(f"{top}/{name}")
            if path.is_symlink():
                info.type, info.linkname, info.mode = tarfile.SYMTYPE, os.readlink(path), 0o777
                tar.addfile(info)
                continue
            data = path.read_bytes()
            info.size, info.mode = len(data), 0o755 if os.access(path, os.X_OK) else 0o644
            tar.addfile(info, io.BytesIO(data))
        if "LICENSE" not in names:
            info = tarfile.TarInfo(f"{top}/LICENSE")
            info.size, info.mode = len(LICENSE), 0o644
            tar.addfile(info, io.BytesIO(LICENSE.encode()))
    return buf.getvalue()


def release_dir(root: Path, arches: tuple[str, ...] = ("amd64",), *, server: str | None = None) -> Path:
    """`root` made a release directory with the llama.cpp archive of each of `arches` and their
    SHA256SUMS (see the module's docstring)."""
    root.mkdir(parents=True, exist_ok=True)
    here = llamabuild.this_host()
    lines = []
    for arch in arches:
        name = llama_file_name(pins.LLAMACPP_VERSION, arch)
        if server is not None:
            binary = Path(server)
            data = archive_bytes(binary.parent, arch, only=[binary.name])
        elif arch == here:
            data = llamabuild.archive_path(llama.cache_root(), llama.portable_recipe()).read_bytes()
        else:
            data = archive_bytes(llama.llama_server_dir(), arch)
        (root / name).write_bytes(data)
        lines.append(f"{hashlib.sha256(data).hexdigest()}  {name}\n")
    (root / SUMS).write_text("".join(lines))
    return root
