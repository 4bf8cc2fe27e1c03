"""llama.cpp's Vulkan build as `./pants test` made it (tools/testenv/prepare.py starts it in the
background beside the CPU build: tools/llama/build-llama-server --vulkan), for the tests that run
it. Depending on this module makes a test wait for that build (tests/testlib/BUILD:
//tools/llama:built-vulkan), so only those tests wait for it.

The archive is the release's Vulkan archive for this machine's architecture, on the CPU build
the tests use (this CPU's variants: testlib.llama.portable_recipe), from the cache:
`llama.cpp-VERSION-linux-ARCH-vulkan.tar.gz`, the CPU archive's files and libggml-vulkan.so."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import pytest
from llmgw_release import llamabuild, llamavulkan

from llmgw import llamarecipe
from llmgw.releasefiles import SUMS
from testlib import llama


@functools.cache
def vulkan_recipe() -> llamarecipe.VulkanRecipe:
    try:
        return llamavulkan.make_recipe(llamabuild.pinned_source(), llamabuild.this_host(), this_cpu=True)
    except llamabuild.LlamaBuildError as exc:
        pytest.fail(f"cannot tell which llama.cpp Vulkan build is this machine's: {exc}")


def vulkan_archive() -> Path:
    path = llamavulkan.archive_path(llama.cache_root(), vulkan_recipe())
    if not path.is_file():
        pytest.fail(
            f"no llama.cpp Vulkan archive at {path}: `./pants test` builds it before the tests that need it; "
            "outside Pants run tools/testenv/prepare.py (or tools/llama/build-llama-server --vulkan)"
        )
    return path


def release_dir(root: Path) -> Path:
    """`root` made a release directory with this machine's CPU and Vulkan llama.cpp archives and
    their SHA256SUMS, as `release:build` writes them."""
    root.mkdir(parents=True, exist_ok=True)
    lines = []
    for archive in (llamabuild.archive_path(llama.cache_root(), llama.portable_recipe()), vulkan_archive()):
        data = archive.read_bytes()
        (root / archive.name).write_bytes(data)
        lines.append(f"{hashlib.sha256(data).hexdigest()}  {archive.name}\n")
    (root / SUMS).write_text("".join(lines))
    return root
