"""Wheels for one architecture: fetched per CPython minor, merged into the one site-packages they share.

pip picks the wheel for each pin and each minor (`pip download --no-deps --only-binary=:all:
--platform ... --python-version 3.X --abi cp3X`), never for the build machine. The platforms are
manylinux2014 first, then manylinux_2_17 ... manylinux_2_28 for projects that publish nothing
older (greenlet): the artifact needs glibc 2.28 (RHEL 8, Ubuntu 20.04) and prefers older builds.

Merging: a project whose wheel runs on every minor (pure Python, or an abi3 wheel old enough,
like cryptography's cp39-abi3) ships that one wheel; otherwise each minor's wheel is unpacked
into the same tree, where their compiled modules sit side by side under per-minor names
(`_cffi_backend.cpython-312-x86_64-linux-gnu.so`). Any other file two wheels both hold must be
identical, except dist-info metadata, where the oldest minor's copy wins. RECORD files are left
out: nothing installs into or uninstalls from the zipapp, and a RECORD would list one minor only.

Wheels are kept in a cache (`~/.cache/llmgw-release/wheels`), so a second build needs no network:
each fetch first asks pip for the pins with `--no-index --find-links CACHE`, and goes to the
index only when that fails. A fetched wheel whose file name the lockfile lists must have the
lockfile's sha256.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import attrs

from llmgw_release.lock import Lock, normalize

PYPI = "https://pypi.org/simple/"
MINORS = (10, 11, 12, 13)
MACHINES = {"amd64": "x86_64", "arm64": "aarch64"}
OLDEST_MANYLINUX = 17
NEWEST_MANYLINUX = 28  # glibc of RHEL 8, the oldest system llmgw supports

# pip settings that must not leak into the build from the machine (site pip.conf, PIP_* variables
# naming other indexes or constraints). Only these transport settings pass through.
PIP_ENV_KEPT = frozenset({"PIP_CERT", "PIP_CLIENT_CERT", "PIP_PROXY", "PIP_DEFAULT_TIMEOUT", "PIP_RETRIES"})


class WheelError(Exception):
    """The wheels for a target cannot be fetched or do not merge."""


def platforms(arch: str) -> list[str]:
    machine = MACHINES[arch]
    return [f"manylinux2014_{machine}"] + [
        f"manylinux_2_{n}_{machine}" for n in range(OLDEST_MANYLINUX, NEWEST_MANYLINUX + 1)
    ]


@attrs.frozen(kw_only=True)
class WheelName:
    """The parts of a wheel file name (PEP 427) that say what it runs on."""

    filename: str
    project: str  # normalized
    version: str
    pythons: frozenset[str]
    abis: frozenset[str]

    @classmethod
    def parse(cls, filename: str) -> WheelName:
        parts = filename[: -len(".whl")].split("-") if filename.endswith(".whl") else []
        if len(parts) not in (5, 6):
            raise WheelError(f"{filename!r} is not a wheel file name")
        return cls(
            filename=filename,
            project=normalize(parts[0]),
            version=parts[1],
            pythons=frozenset(parts[-3].split(".")),
            abis=frozenset(parts[-2].split(".")),
        )

    def runs_on(self, minor: int) -> bool:
        """Whether CPython 3.`minor` can import it (the platform was already chosen by pip)."""
        for py in self.pythons:
            for abi in self.abis:
                if abi == "none" and py in ("py3", f"py3{minor}", f"cp3{minor}"):
                    return True
                if abi == f"cp3{minor}" and py == f"cp3{minor}":
                    return True
                if abi == "abi3" and py.startswith("cp3") and py[3:].isdigit() and int(py[3:]) <= minor:
                    return True
        return False


def choose(per_minor: Mapping[int, Iterable[str]]) -> list[str]:
    """The wheel files to ship, given the file pip chose for each project on each minor."""
    by_project: dict[str, dict[str, set[int]]] = {}
    for minor, files in per_minor.items():
        for f in files:
            by_project.setdefault(WheelName.parse(f).project, {}).setdefault(f, set()).add(minor)
    chosen: list[str] = []
    for _project, files in sorted(by_project.items()):
        minors = set().union(*files.values())
        everywhere = [f for f in files if all(WheelName.parse(f).runs_on(m) for m in minors)]
        if everywhere:
            # The one most minors were given already, then by name, so the choice is stable.
            chosen.append(min(everywhere, key=lambda f: (-len(files[f]), f)))
        else:
            chosen.extend(sorted(files))
    return chosen


def _is_metadata(path: str) -> bool:
    return path.split("/", 1)[0].endswith(".dist-info")


def site_packages(wheels: Sequence[Path]) -> dict[str, bytes]:
    """The files the wheels install into site-packages, by path relative to it."""
    out: dict[str, bytes] = {}
    origin: dict[str, str] = {}
    for wheel in sorted(wheels, key=lambda p: p.name):  # cp310 before cp311: its metadata wins
        with zipfile.ZipFile(wheel) as z:
            for info in z.infolist():
                name = info.filename
                if name.endswith("/"):
                    continue
                top, _, rest = name.partition("/")
                if top.endswith(".data"):
                    kind, _, name = rest.partition("/")
                    if kind not in ("purelib", "platlib"):
                        continue  # scripts, headers, data: nothing the zipapp runs
                if _is_metadata(name) and name.rsplit("/", 1)[-1] in ("RECORD", "RECORD.jws", "RECORD.p7s"):
                    continue
                data = z.read(info)
                if name in out and out[name] != data:
                    if _is_metadata(name):
                        continue
                    raise WheelError(
                        f"{name} differs between {origin[name]} and {wheel.name}; they cannot share one tree"
                    )
                out[name] = data
                origin.setdefault(name, wheel.name)
    return out


# -- fetching ------------------------------------------------------------------------------


def default_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "llmgw-release" / "wheels"


def pip_command() -> tuple[list[str], dict[str, str]]:
    """`python -m pip` with the pip the build runs with (from the lock, via shiv), and a clean env."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k in PIP_ENV_KEPT}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    env.pop("PYTHONPATH", None)
    spec = importlib.util.find_spec("pip")
    if spec is not None and spec.origin:
        env["PYTHONPATH"] = str(Path(spec.origin).parent.parent)
    return [sys.executable, "-m", "pip"], env


@attrs.frozen(kw_only=True)
class Fetch:
    """One pip run: the wheels of every pin for one architecture and one CPython minor."""

    arch: str
    minor: int
    dest: Path

    def args(self, requirements: Path, source: Sequence[str]) -> list[str]:
        plat = [a for p in platforms(self.arch) for a in ("--platform", p)]
        return [
            "download",
            "--quiet",
            "--no-deps",
            "--only-binary=:all:",
            "--implementation=cp",
            f"--python-version=3.{self.minor}",
            f"--abi=cp3{self.minor}",
            *plat,
            *source,
            "--dest",
            str(self.dest),
            "--requirement",
            str(requirements),
        ]


def _run_all(commands: Sequence[list[str]], env: Mapping[str, str], log_dir: Path) -> list[tuple[int, str]]:
    """Run the commands side by side; each one's exit status and output."""
    procs = []
    for i, cmd in enumerate(commands):
        log = (log_dir / f"pip-{i}.log").open("wb")
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(env)), log))
    results = []
    for proc, log in procs:
        status = proc.wait()
        log.close()
        results.append((status, Path(log.name).read_text(errors="replace")))
    return results


def fetch(
    pins: Mapping[str, str],
    arches: Sequence[str],
    *,
    cache: Path,
    work: Path,
    index_url: str = PYPI,
    progress=print,
) -> dict[str, dict[int, list[Path]]]:
    """For each architecture and minor, the wheel files pip chose for the pins (all in `cache`)."""
    cache.mkdir(parents=True, exist_ok=True)
    requirements = work / "pins.txt"
    requirements.write_text("".join(f"{name}=={version}\n" for name, version in sorted(pins.items())))
    pip, env = pip_command()
    fetches = [Fetch(arch=a, minor=m, dest=work / f"{a}-cp3{m}") for a in arches for m in MINORS]

    def attempt(todo: list[Fetch], source: list[str]) -> list[tuple[Fetch, str]]:
        for f in todo:
            shutil.rmtree(f.dest, ignore_errors=True)
            f.dest.mkdir(parents=True)
        results = _run_all([[*pip, *f.args(requirements, source)] for f in todo], env, work)
        return [(f, out) for f, (status, out) in zip(todo, results, strict=True) if status != 0]

    missing = attempt(fetches, ["--no-index", f"--find-links={cache}"])
    if missing:
        progress(f"fetching wheels from {index_url} for {', '.join(f'{f.arch}/cp3{f.minor}' for f, _ in missing)}")
        failed = attempt([f for f, _ in missing], [f"--index-url={index_url}"])
        if failed:
            f, out = failed[0]
            raise WheelError(f"pip could not fetch the wheels for {f.arch} CPython 3.{f.minor}:\n{out.strip()}")
        for f, _ in missing:
            for wheel in f.dest.iterdir():
                _store(wheel, cache)

    result: dict[str, dict[int, list[Path]]] = {}
    for f in fetches:
        names = sorted(p.name for p in f.dest.iterdir())
        _check_pins(names, pins, f)
        result.setdefault(f.arch, {})[f.minor] = [cache / n for n in names]
    return result


def _store(wheel: Path, cache: Path) -> None:
    """Put a fetched wheel into the cache atomically (other builds may read it meanwhile)."""
    target = cache / wheel.name
    if target.exists():
        return
    fd, tmp = tempfile.mkstemp(dir=cache, prefix=f".{wheel.name}.")
    os.close(fd)
    shutil.copyfile(wheel, tmp)
    os.replace(tmp, target)


def _check_pins(names: Sequence[str], pins: Mapping[str, str], fetch: Fetch) -> None:
    got = {WheelName.parse(n).project: WheelName.parse(n).version for n in names}
    if got != dict(pins):
        raise WheelError(
            f"pip fetched {sorted(got.items())} for {fetch.arch} CPython 3.{fetch.minor}, "
            f"expected exactly the pins {sorted(pins.items())}"
        )


def verify(wheels: Iterable[Path], lock: Lock) -> int:
    """Check each wheel the lockfile lists against its sha256; the number checked."""
    checked = 0
    for wheel in wheels:
        expected = lock.hashes.get(wheel.name)
        if expected is None:
            continue
        actual = hashlib.sha256(wheel.read_bytes()).hexdigest()
        if actual != expected:
            raise WheelError(
                f"{wheel} has sha256 {actual}, but default.lock says {expected}; "
                "delete it from the wheel cache and build again"
            )
        checked += 1
    return checked
