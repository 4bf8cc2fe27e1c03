"""A release directory holding llama.cpp as the release carries it, made from the llama-server
this machine already has (testlib.llama), for tests of the node side while the release's own
portable build is made elsewhere (release/).

The layout is the release's (docs/install.md): `llama.cpp-VERSION-linux-ARCH.tar.gz` with one
top directory of the same name holding `llama-server` flat with its libraries, and LICENSE;
listed with its sha256 in SHA256SUMS. The stand-in's llama-server links its CPU backend in, so
there are no libggml-cpu-*.so beside it and it reports the `built-in` backend.
"""

from __future__ import annotations

import hashlib
import io
import tarfile
from pathlib import Path

from llmgw import pins
from llmgw.releasefiles import SUMS, llama_file_name
from testlib import llama

LICENSE = "MIT License\n\nCopyright (c) 2023-2026 The ggml authors\n"


def archive_bytes(server: Path, arch: str, version: str = pins.LLAMACPP_VERSION) -> bytes:
    """The release's llama.cpp archive for `arch`, holding `server` as its llama-server."""
    top = llama_file_name(version, arch).removesuffix(".tar.gz")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        directory = tarfile.TarInfo(top)
        directory.type, directory.mode = tarfile.DIRTYPE, 0o755
        tar.addfile(directory)
        for name, data, mode in (("llama-server", server.read_bytes(), 0o755), ("LICENSE", LICENSE.encode(), 0o644)):
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size, info.mode = len(data), mode
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def release_dir(root: Path, arches: tuple[str, ...] = ("amd64",), *, server: str | None = None) -> Path:
    """`root` made a release directory with the llama.cpp archive of each of `arches` (every one
    holding this machine's llama-server, whatever its architecture) and their SHA256SUMS."""
    root.mkdir(parents=True, exist_ok=True)
    binary = Path(server or llama.llama_server())
    lines = []
    for arch in arches:
        name = llama_file_name(pins.LLAMACPP_VERSION, arch)
        data = archive_bytes(binary, arch)
        (root / name).write_bytes(data)
        lines.append(f"{hashlib.sha256(data).hexdigest()}  {name}\n")
    (root / SUMS).write_text("".join(lines))
    return root
