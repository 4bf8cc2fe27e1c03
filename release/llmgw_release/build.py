"""`./pants run release:build -- --version X --out DIR`: the release zipapps, llama.cpp, llmgw-provision-node and SHA256SUMS.

Writes `llmgw-X-linux-amd64.pyz`, `llmgw-X-linux-arm64.pyz`, `llmgw-provision-node`,
`llama.cpp-bN-linux-amd64.tar.gz`, `llama.cpp-bN-linux-amd64-vulkan.tar.gz` (llamavulkan.py: the
CPU archive's files and llama.cpp's Vulkan module; built natively only: not arm64's from amd64), `llama.cpp-bN-linux-arm64.tar.gz`
and `SHA256SUMS` into DIR. Each
zipapp holds llmgw and agent from src/python, the runtime requirements pinned by default.lock
with the wheels of every CPython 3.10-3.13 side by side, and `llmgw/_build_info.py` (version,
commit, build date, target). The build date is the commit's time (or SOURCE_DATE_EPOCH), never
the clock, so building one commit twice gives the same bytes. `llmgw-provision-node` (run on a
Proxmox host, tools/provision) is shipped as it is in the source, with the release's version written
into its `__version__` line. The llama.cpp archives (llmgw.llamarecipe, llamacpp.py, llamabuild.py) come from
their cache, built there first if this machine has not built that recipe yet (minutes: see
docs/development.md), and each runs once before it is shipped (llamasmoke.py: `--version` and
one completion on a tiny model; the foreign architecture under qemu-user).

`build_release` takes every input explicitly; `main` finds them in the checkout (git for the
commit and its time), which is what a test in a sandbox without git cannot do. Before it builds
anything, `main` provides the Debian packages the build runs (provide.py: the cross compiler and
qemu-user for the other architecture), installing them as root, else saying the command and stopping.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.resources
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import attrs

from llmgw import llamarecipe
from llmgw_release import llamabuild, llamacli, llamasmoke, llamavulkan, provide, wheels, zipapp
from llmgw_release import lock as lockfile
from testlib.tinygguf import write_tiny_llama

ARCHES = ("amd64", "arm64")
PACKAGES = ("llmgw", "agent")
# Generated files a source tree may hold; the build writes its own _build_info.py.
GENERATED = ("_build_info.py", "_scm_version.py")
# Package data read at run time with importlib.resources: the cluster page's files (llmgw/page).
DATA_SUFFIXES = (".html", ".css", ".js")
VERSION_RE = re.compile(r"[0-9A-Za-z][0-9A-Za-z.+-]*")
INIT_VERSION_RE = re.compile(r'^__version__ = "[^"\n]*"$', re.MULTILINE)
PROVISION_TOOL = "llmgw-provision-node"


class BuildError(Exception):
    """The release cannot be built from these inputs; the message says which and why."""


@attrs.frozen(kw_only=True)
class Inputs:
    version: str
    commit: str
    source_date_epoch: int
    src_root: Path  # holds the llmgw and agent packages
    requirements_txt: Path
    lockfile: Path
    wheel_cache: Path
    index_url: str = wheels.PYPI
    # tools/provision/llmgw-provision-node, shipped beside the zipapps; None builds the zipapps alone.
    provision_tool: Path | None = None
    # llama.cpp's archives are built into (or taken from) this cache (llamabuild); None ships none.
    llama_cache: Path | None = None
    llama_arches: tuple[str, ...] | None = None  # which of them; None: the release's architectures
    llama_jobs: int = llamabuild.DEFAULT_JOBS
    # Ship this machine's architecture built for this CPU alone (its baseline and the variant it
    # loads: the tests' build, llamabuild.make_recipe(this_cpu=True)), not every variant. Tests only.
    llama_this_cpu: bool = False
    # Each archive answers one completion on this GGUF model before it ships; None: `--version` only.
    llama_smoke_model: Path | None = None
    # The Vulkan archive beside the CPU one, where it is built (llamavulkan: amd64, natively).
    llama_vulkan: bool = True


def artifact_name(version: str, arch: str) -> str:
    return f"llmgw-{version}-linux-{arch}.pyz"


def build_date(epoch: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))


def sources(src_root: Path, version: str) -> dict[str, bytes]:
    """The .py files of llmgw and agent, and their package data (`DATA_SUFFIXES`), by path under
    site-packages; __init__ says `version`."""
    out: dict[str, bytes] = {}
    for package in PACKAGES:
        if not (src_root / package / "__init__.py").is_file():
            raise BuildError(f"no package {package!r} in {src_root}")
        for path in sorted((src_root / package).rglob("*")):
            rel = path.relative_to(src_root).as_posix()
            if not path.is_file() or not path.name.endswith((".py", *DATA_SUFFIXES)):
                continue
            if "__pycache__" in path.parts or path.name in GENERATED:
                continue
            out[rel] = path.read_bytes()
    init = out["llmgw/__init__.py"].decode()
    init, count = INIT_VERSION_RE.subn(f'__version__ = "{version}"', init)
    if count != 1:
        raise BuildError(f'{src_root}/llmgw/__init__.py must have exactly one line `__version__ = "..."`')
    out["llmgw/__init__.py"] = init.encode()
    return out


def build_info(inputs: Inputs, arch: str) -> bytes:
    return (
        '"""Written by the release build (release/llmgw_release/build.py); not in the source tree."""\n\n'
        f"commit = {inputs.commit!r}\n"
        f"build_date = {build_date(inputs.source_date_epoch)!r}\n"
        f"target = {'linux-' + arch!r}\n"
    ).encode()


def runtime_file(name: str) -> bytes:
    return importlib.resources.files("llmgw_release").joinpath(name).read_bytes()


def main_py(arch: str) -> bytes:
    text = runtime_file("pyz_main.py").decode()
    text, count = re.subn(r"^MACHINES = \(\)", f"MACHINES = ({wheels.MACHINES[arch]!r},)", text, flags=re.MULTILINE)
    if count != 1:
        raise BuildError("pyz_main.py must have exactly one line starting with `MACHINES = ()`")
    return text.encode()


def write_provision_tool(source: Path, version: str, out_dir: Path) -> Path:
    """The Proxmox host's tool, saying the release's version; mode 0755 whatever the checkout's."""
    try:
        text = source.read_text()
    except OSError as exc:
        raise BuildError(f"cannot read {source}: {exc.strerror}") from None
    text, count = INIT_VERSION_RE.subn(f'__version__ = "{version}"', text, count=1)
    if count != 1:
        raise BuildError(f'{source} must have a line `__version__ = "..."`')
    path = out_dir / PROVISION_TOOL
    path.write_text(text)
    path.chmod(0o755)
    return path


def build_release(inputs: Inputs, out_dir: Path, arches: Sequence[str] = ARCHES, progress=print) -> list[Path]:
    """Build the artifacts and SHA256SUMS into `out_dir`; their paths."""
    if not VERSION_RE.fullmatch(inputs.version):
        raise BuildError(f"version {inputs.version!r} may hold only letters, digits and . + - (it names files)")
    unknown = [a for a in arches if a not in ARCHES]
    if unknown or not arches:
        raise BuildError(f"architectures {list(arches)}: each must be one of {', '.join(ARCHES)}")
    try:
        pins, lock = lockfile.read_pins(inputs.requirements_txt, inputs.lockfile)
    except lockfile.LockError as exc:
        raise BuildError(str(exc)) from None
    src = sources(inputs.src_root, inputs.version)
    out_dir.mkdir(parents=True, exist_ok=True)
    artifacts = []
    with tempfile.TemporaryDirectory(prefix="llmgw-release-") as work:
        try:
            fetched = wheels.fetch(
                pins, arches, cache=inputs.wheel_cache, work=Path(work), index_url=inputs.index_url, progress=progress
            )
            for arch in arches:
                chosen = wheels.choose({m: [p.name for p in ps] for m, ps in fetched[arch].items()})
                paths = [inputs.wheel_cache / name for name in chosen]
                checked = wheels.verify(paths, lock)
                site = wheels.site_packages(paths)
                clash = sorted(name for name in src if name in site)
                if clash:
                    raise BuildError(f"wheels and llmgw's sources both provide {clash[:5]}")
                site.update(src)
                site["llmgw/_build_info.py"] = build_info(inputs, arch)
                entries = zipapp.assemble(
                    version=inputs.version,
                    main=main_py(arch),
                    preamble=runtime_file("pyz_preamble.py"),
                    site=site,
                    epoch=inputs.source_date_epoch,
                )
                path = out_dir / artifact_name(inputs.version, arch)
                zipapp.write(path, entries, inputs.source_date_epoch)
                progress(
                    f"{path}: {path.stat().st_size / 1e6:.1f} MB, {len(chosen)} wheels "
                    f"({checked} checked against default.lock), {len(entries)} entries"
                )
                artifacts.append(path)
        except wheels.WheelError as exc:
            raise BuildError(str(exc)) from None
    if inputs.provision_tool is not None:
        artifacts.append(write_provision_tool(inputs.provision_tool, inputs.version, out_dir))
    if inputs.llama_cache is not None:
        artifacts += ship_llama(inputs, inputs.llama_cache, out_dir, inputs.llama_arches or tuple(arches), progress)
    sums = "".join(f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}\n" for p in sorted(artifacts))
    (out_dir / "SHA256SUMS").write_text(sums)
    return [*artifacts, out_dir / "SHA256SUMS"]


def ship_llama(inputs: Inputs, cache: Path, out_dir: Path, arches: Sequence[str], progress) -> list[Path]:
    """Each architecture's llama.cpp archive from `cache` (built there if need be), run, then copied out."""
    unknown = [a for a in arches if a not in llamarecipe.ARCHES]
    if unknown or not arches:
        raise BuildError(f"llama.cpp architectures {list(arches)}: each must be one of {', '.join(llamarecipe.ARCHES)}")
    source = llamabuild.pinned_source()
    shipped = []
    for arch in arches:
        try:
            recipe = llamabuild.make_recipe(source, arch, this_cpu=inputs.llama_this_cpu)
            cached = llamabuild.archive_path(cache, recipe).is_file()
            archive = llamabuild.ensure_archive(recipe, cache, jobs=inputs.llama_jobs, say=progress)
            smoked = llamasmoke.smoke(archive, source, arch, model=inputs.llama_smoke_model)
        except (llamabuild.LlamaBuildError, llamarecipe.RecipeError) as exc:
            raise BuildError(str(exc)) from None
        shipped.append(_copy_out(archive, out_dir, cached, smoked, recipe.toolchain.cross, progress))
        if not inputs.llama_vulkan:
            continue
        if recipe.toolchain.cross:
            progress(
                f"no Vulkan build of llama.cpp for {arch}: it is cross-built here, and the Vulkan build is "
                "native only (docs/development.md, The Vulkan build)"
            )
            continue
        try:
            vk = llamavulkan.make_recipe(source, arch, this_cpu=inputs.llama_this_cpu)
            cached = llamavulkan.archive_path(cache, vk).is_file()
            archive = llamavulkan.ensure_archive(vk, cache, jobs=inputs.llama_jobs, say=progress)
            smoked = llamasmoke.smoke(
                archive, source, arch, model=inputs.llama_smoke_model, top=llamavulkan.top_dir(vk)
            )
        except (llamabuild.LlamaBuildError, llamarecipe.RecipeError) as exc:
            raise BuildError(str(exc)) from None
        shipped.append(_copy_out(archive, out_dir, cached, smoked, False, progress))
    return shipped


def _copy_out(archive: Path, out_dir: Path, cached: bool, smoked: llamasmoke.Smoked, cross: bool, progress) -> Path:
    path = out_dir / archive.name
    shutil.copyfile(archive, path)
    ran = f"{smoked.version}, {'qemu-user' if cross else 'natively'}"
    if smoked.backend:
        ran += f", CPU backend {smoked.backend}, {llamasmoke.SMOKE_TOKENS} tokens"
    progress(
        f"{path}: {path.stat().st_size / 1e6:.1f} MB, {'from the cache' if cached else 'built'} "
        f"({archive.parent}); ran: {ran}"
    )
    return path


# -- the command line: inputs from the checkout ---------------------------------------------


def find_checkout(start: Path) -> Path:
    for d in (start, *start.parents):
        if (d / "pants.toml").is_file() and (d / "3rdparty" / "python" / "requirements.txt").is_file():
            return d
    raise BuildError(f"{start} is not inside the llmgw checkout (no pants.toml above it); run from the checkout")


def _git(repo: Path, *args: str) -> str:
    try:
        done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=False)
    except OSError as exc:
        raise BuildError(f"cannot run git: {exc}") from None
    if done.returncode != 0:
        raise BuildError(f"`git {' '.join(args)}` failed in {repo}: {done.stderr.strip()}")
    return done.stdout.strip()


def checkout_inputs(
    repo: Path,
    version: str,
    wheel_cache: Path,
    index_url: str,
    *,
    llama_cache: Path | None = None,
    llama_jobs: int = llamabuild.DEFAULT_JOBS,
    llama_smoke_model: Path | None = None,
) -> tuple[Inputs, bool]:
    """Inputs from the checkout, and whether it has uncommitted changes to what is built."""
    commit = _git(repo, "rev-parse", "--short=12", "HEAD")
    dirty = bool(
        _git(repo, "status", "--porcelain", "--", "src/python", "release", "3rdparty/python", "tools/provision")
    )
    epoch = os.environ.get("SOURCE_DATE_EPOCH") or _git(repo, "log", "-1", "--format=%ct", "HEAD")
    inputs = Inputs(
        version=version,
        commit=f"{commit}-dirty" if dirty else commit,
        source_date_epoch=int(epoch),
        src_root=repo / "src" / "python",
        requirements_txt=repo / "3rdparty" / "python" / "requirements.txt",
        lockfile=repo / "3rdparty" / "python" / "default.lock",
        wheel_cache=wheel_cache,
        index_url=index_url,
        provision_tool=repo / "tools" / "provision" / PROVISION_TOOL,
        llama_cache=llama_cache,
        llama_jobs=llama_jobs,
        llama_smoke_model=llama_smoke_model,
    )
    return inputs, dirty


def main(argv: Sequence[str] | None = None, machine: provide.Machine | None = None) -> int:
    """The build from the command line; `machine` is what provides its Debian packages (tests give a fake)."""
    parser = argparse.ArgumentParser(
        prog="release:build",
        description=(
            "Build the llmgw release from this checkout: the zipapps, llama.cpp for each architecture, "
            "llmgw-provision-node and SHA256SUMS."
        ),
        allow_abbrev=False,
    )
    parser.add_argument("--version", required=True, help="the release version, e.g. 0.2.0")
    parser.add_argument("--out", required=True, type=Path, help="directory to write the artifacts into")
    parser.add_argument(
        "--arch", action="append", choices=ARCHES, help="an architecture to build (repeatable; default: all)"
    )
    parser.add_argument("--wheel-cache", type=Path, default=wheels.default_cache(), help="default: %(default)s")
    parser.add_argument("--index-url", default=wheels.PYPI, help="where missing wheels come from (default: PyPI)")
    parser.add_argument(
        "--llama-cache",
        type=Path,
        default=llamabuild.cache_root(),
        help="where llama.cpp's archives are built once and kept, shared with ./pants test (default: %(default)s)",
    )
    parser.add_argument(
        "--llama-jobs", type=int, default=None, help="compile jobs for llama.cpp (default: $LLAMA_BUILD_JOBS or 2)"
    )
    args = parser.parse_args(argv)
    arches = tuple(dict.fromkeys(args.arch or ARCHES))

    def progress(message: str) -> None:
        print(f"release: {message}", file=sys.stderr, flush=True)

    started = time.monotonic()
    try:
        jobs = args.llama_jobs if args.llama_jobs is not None else llamacli.build_jobs()
        if jobs < 1:
            raise BuildError(f"--llama-jobs {jobs}: must be 1 or more")
        # Before anything is built: the cross compiler and qemu-user, which `./pants test` does not install.
        again = "./pants run release:build -- " + shlex.join(sys.argv[1:] if argv is None else argv)
        if not provide.provide(machine or provide.real_machine(progress), arches, llamabuild.this_host(), again=again):
            return 1
        repo = find_checkout(Path.cwd())
        with tempfile.TemporaryDirectory(prefix="llmgw-release-model-") as models:
            inputs, dirty = checkout_inputs(
                repo,
                args.version,
                args.wheel_cache,
                args.index_url,
                llama_cache=args.llama_cache.resolve(),
                llama_jobs=jobs,
                llama_smoke_model=write_tiny_llama(Path(models) / "tiny.gguf"),
            )
            if dirty:
                progress(
                    f"uncommitted changes under src/python, release, 3rdparty/python or tools/provision: commit is {inputs.commit}"
                )
            paths = build_release(inputs, args.out.resolve(), arches, progress)
    except (BuildError, llamabuild.LlamaBuildError) as exc:
        print(f"release: {exc}", file=sys.stderr)
        return 1
    progress(f"built {inputs.commit} ({build_date(inputs.source_date_epoch)}) in {time.monotonic() - started:.1f}s")
    sys.stdout.write(paths[-1].read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
