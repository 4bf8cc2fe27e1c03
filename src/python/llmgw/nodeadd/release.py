"""Which release file `llmgw node add` ships to a node, and the sha256 the node must find in it.

`--release` names a directory holding the release's files (`llmgw-VERSION-linux-ARCH.pyz` and
`SHA256SUMS`, as downloaded), one .pyz file, or an http(s) URL of such a directory, whose
SHA256SUMS is read here and whose .pyz the node fetches itself. Without `--release`, the running
llmgw is shipped when it is itself a release for the node's architecture; a development build is
never shipped, so the fleet does not end up running whatever was in somebody's working tree.
"""

from __future__ import annotations

import re
import sys
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

import attrs

from llmgw import download
from llmgw.errors import MachineError, PeerError, UsageError
from llmgw.version import version_info

ARCHES = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}
_NAME = re.compile(r"llmgw-(?P<version>[^/\s]+)-linux-(?P<arch>amd64|arm64)\.pyz\Z")
_FETCH_TIMEOUT_S = 30


@attrs.frozen(kw_only=True)
class Artifact:
    name: str  # llmgw-0.1.0-linux-amd64.pyz
    version: str
    sha256: str
    path: Path | None = None  # a file here, shipped over SFTP
    url: str = ""  # or fetched by the node

    @property
    def where(self) -> str:
        return str(self.path) if self.path else self.url


def release_arch(machine: str) -> str:
    """`uname -m` → the release's architecture name."""
    try:
        return ARCHES[machine]
    except KeyError:
        raise UsageError(
            f"the node is {machine!r} (uname -m); llmgw releases exist for x86_64 and aarch64 only"
        ) from None


def sha256_of(path: Path) -> str:
    try:
        return download.sha256_of(path)
    except OSError as exc:
        raise MachineError(f"cannot read {path}: {exc.strerror or exc}") from None


def parse_sums(text: str, label: str) -> dict[str, str]:
    """`sha256sum` output: name → hex digest."""
    sums: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) != 2 or not re.fullmatch(r"[0-9a-f]{64}", parts[0]):
            raise UsageError(f"{label} line {number} is not `SHA256  FILE`: {line!r}")
        sums[parts[1].lstrip("*")] = parts[0]
    return sums


def _pick(sums: dict[str, str], arch: str, label: str) -> tuple[str, str, str]:
    found = [(name, m["version"]) for name in sums if (m := _NAME.match(name)) and m["arch"] == arch]
    if not found:
        raise UsageError(
            f"{label} lists no llmgw-VERSION-linux-{arch}.pyz; the node needs the {arch} release "
            "(download both architectures' files and SHA256SUMS into one place)"
        )
    if len(found) > 1:
        raise UsageError(f"{label} lists several {arch} releases ({', '.join(n for n, _ in found)}); keep one")
    name, version = found[0]
    return name, version, sums[name]


def find_artifact(release: str, arch: str) -> Artifact:
    if not release:
        return _this_llmgw(arch)
    if release.startswith(("http://", "https://")):
        return _from_url(release, arch)
    path = Path(release)
    if path.is_dir():
        return _from_dir(path, arch)
    if path.is_file():
        return _from_file(path, arch)
    raise UsageError(f"--release {release}: no such file or directory; give a release directory, .pyz or URL")


def _from_dir(directory: Path, arch: str) -> Artifact:
    sums_file = directory / "SHA256SUMS"
    try:
        sums = parse_sums(sums_file.read_text(), str(sums_file))
    except FileNotFoundError:
        raise UsageError(
            f"{directory} has no SHA256SUMS; download it with the release, or give the .pyz file itself"
        ) from None
    name, version, digest = _pick(sums, arch, str(sums_file))
    return _checked(directory / name, version, digest, f"{sums_file}")


def _from_file(path: Path, arch: str) -> Artifact:
    m = _NAME.match(path.name)
    if not m or not zipfile.is_zipfile(path):
        raise UsageError(f"--release {path} is not a release file (llmgw-VERSION-linux-ARCH.pyz)")
    if m["arch"] != arch:
        raise UsageError(f"--release {path} is the {m['arch']} release; the node is {arch}")
    beside = path.parent / "SHA256SUMS"
    if beside.is_file():
        digest = parse_sums(beside.read_text(), str(beside)).get(path.name)
        if digest:
            return _checked(path, m["version"], digest, str(beside))
    return Artifact(name=path.name, version=m["version"], sha256=sha256_of(path), path=path)


def _checked(path: Path, version: str, digest: str, label: str) -> Artifact:
    if not path.is_file():
        raise UsageError(f"{label} lists {path.name}, which is not beside it; download it too")
    actual = sha256_of(path)
    if actual != digest:
        raise MachineError(
            f"{path} has sha256 {actual}, but {label} says {digest}: the file is damaged or not the released "
            "one; download it again"
        )
    return Artifact(name=path.name, version=version, sha256=digest, path=path)


def _from_url(url: str, arch: str) -> Artifact:
    base = url if url.endswith("/") else url + "/"
    sums_url = base + "SHA256SUMS"
    try:
        with urllib.request.urlopen(sums_url, timeout=_FETCH_TIMEOUT_S) as r:
            text = r.read(1 << 20).decode("utf-8", "replace")
    except (urllib.error.URLError, OSError) as exc:
        raise PeerError(f"cannot read {sums_url}: {getattr(exc, 'reason', exc)}; check the release URL") from None
    name, version, digest = _pick(parse_sums(text, sums_url), arch, sums_url)
    return Artifact(name=name, version=version, sha256=digest, url=base + name)


def _this_llmgw(arch: str) -> Artifact:
    info = version_info()
    me = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    fix = (
        f"pass --release DIR (holding llmgw-VERSION-linux-{arch}.pyz and SHA256SUMS, as downloaded), "
        "--release FILE.pyz or --release URL"
    )
    if info.build_target == "unknown" or me is None or not me.is_file() or not zipfile.is_zipfile(me):
        raise UsageError(f"this llmgw ({info.version}) is not a release build, so it is not shipped to nodes; {fix}")
    if info.build_target != f"linux-{arch}":
        raise UsageError(f"this llmgw is the {info.build_target} release and the node is linux-{arch}; {fix}")
    return Artifact(
        name=f"llmgw-{info.version}-linux-{arch}.pyz", version=info.version, sha256=sha256_of(me), path=me.resolve()
    )
