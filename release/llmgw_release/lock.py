"""What the release ships, read from the repository: the runtime requirements and their exact pins.

The runtime requirements are the "Runtime" section of 3rdparty/python/requirements.txt (the same
file Pants reads); the versions are the ones pinned in 3rdparty/python/default.lock, so the
artifact holds exactly the distributions the tests ran against.

The closure is walked here rather than by pip because pip evaluates environment markers against
the interpreter running it, even with `--python-version`: asked for 3.10 from 3.11 it leaves out
tomli and exceptiongroup. The walk keeps every dependency whose marker is not about an extra and
whose project the lock holds. One artifact serves every CPython minor, so a dependency any minor
needs is shipped to all of them anyway; a dependency the lock does not hold was resolved away
for every platform the lock targets (Windows-only ones, say).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from urllib.parse import unquote

import attrs

RUNTIME_SECTION = "# Runtime"
TOOLS_SECTION = "# Test and lint tools"

# PEP 508: a requirement starts with the project name, then optional [extras].
_NAME = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?")
_EXTRA = re.compile(r"\bextra\b")


class LockError(Exception):
    """requirements.txt or default.lock does not say what the release needs."""


def normalize(name: str) -> str:
    """PEP 503 name normalization: `Typing_Extensions` and `typing-extensions` are one project."""
    return re.sub(r"[-_.]+", "-", name).lower()


@attrs.frozen(kw_only=True)
class Requirement:
    """What the build needs of a requirement: its project, and its marker (never its version
    range: versions come from the lock, which satisfied the ranges when it was generated)."""

    name: str  # normalized
    has_extras: bool
    marker: str  # "" when unconditional


def parse_requirement(line: str) -> Requirement:
    spec, _, marker = line.partition(";")
    m = _NAME.match(spec)
    if m is None:
        raise LockError(f"cannot read the project name of requirement {line!r}")
    return Requirement(name=normalize(m.group(1)), has_extras=bool(m.group(2)), marker=marker.strip())


def runtime_requirements(requirements_txt: str) -> list[Requirement]:
    """The requirements between the `# Runtime` and `# Test and lint tools` comments."""
    lines = requirements_txt.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(RUNTIME_SECTION)]
    if len(starts) != 1:
        raise LockError(f"requirements.txt must have exactly one line starting with {RUNTIME_SECTION!r}")
    out = []
    for line in lines[starts[0] + 1 :]:
        if line.startswith(TOOLS_SECTION):
            break
        text = line.split(" #", 1)[0].strip()
        if not text or text.startswith("#"):
            continue
        req = parse_requirement(text)
        if req.has_extras:
            raise LockError(f"runtime requirement {text!r} asks for extras; the release build does not resolve extras")
        out.append(req)
    if not out:
        raise LockError(f"requirements.txt has no requirements under {RUNTIME_SECTION!r}")
    return out


@attrs.frozen(kw_only=True)
class Locked:
    name: str
    version: str
    requires: tuple[Requirement, ...]


@attrs.frozen(kw_only=True)
class Lock:
    projects: Mapping[str, Locked]
    # sha256 of every artifact file the lock lists, by file name. Pex's universal lock does not
    # list every wheel of every minor, so a file missing here is not an error.
    hashes: Mapping[str, str]


def parse_lock(text: str) -> Lock:
    """A Pants (pex) lockfile: `//` header comments, then JSON."""
    body = "\n".join(line for line in text.splitlines() if not line.startswith("//"))
    try:
        data = json.loads(body)
        (resolve,) = data["locked_resolves"]
        projects: dict[str, Locked] = {}
        hashes: dict[str, str] = {}
        for entry in resolve["locked_requirements"]:
            name = normalize(entry["project_name"])
            projects[name] = Locked(
                name=name,
                version=entry["version"],
                requires=tuple(parse_requirement(r) for r in entry["requires_dists"]),
            )
            for artifact in entry["artifacts"]:
                if artifact["algorithm"] == "sha256":
                    hashes[unquote(artifact["url"].rsplit("/", 1)[-1])] = artifact["hash"]
    except (ValueError, KeyError, TypeError) as exc:
        raise LockError(f"cannot read the lockfile: {exc!r}") from None
    return Lock(projects=projects, hashes=hashes)


def runtime_pins(roots: Iterable[Requirement], lock: Lock) -> dict[str, str]:
    """Every project the runtime needs on some CPython 3.10-3.13 on Linux, with its locked version."""
    pins: dict[str, str] = {}
    todo: list[tuple[Requirement, str]] = [(r, "requirements.txt") for r in roots]
    while todo:
        req, wanted_by = todo.pop()
        if req.name in pins or _EXTRA.search(req.marker):
            continue
        locked = lock.projects.get(req.name)
        if locked is None:
            if req.marker:
                continue  # resolved away for every platform the lock targets
            raise LockError(
                f"{wanted_by} needs {req.name!r}, which default.lock does not pin; " "run `./pants generate-lockfiles`"
            )
        pins[req.name] = locked.version
        todo.extend((dep, req.name) for dep in locked.requires)
    return dict(sorted(pins.items()))


def read_pins(requirements_txt: Path, lockfile: Path) -> tuple[dict[str, str], Lock]:
    lock = parse_lock(lockfile.read_text())
    return runtime_pins(runtime_requirements(requirements_txt.read_text()), lock), lock
