"""Which release file `llmgw node add` ships to a node, and the sha256 the node must find in it.

`--release` names a directory holding the release's files (`llmgw-VERSION-linux-ARCH.pyz` and
`SHA256SUMS`, as downloaded), one .pyz file, or an http(s) URL of such a directory, whose
SHA256SUMS is read here and whose .pyz the node fetches itself. Without `--release`, the node
fetches the file for its architecture from the control plane (`from_plane`: its SHA256SUMS read
here over HTTPS, the server checked against the cluster's CA root), or, over SSH
(`--release-via ssh`, or when the control plane holds none for the node), `local_release` is
copied: `[release] dir`, else the release directory this llmgw runs from, else this llmgw itself
when it is a release for the node's architecture. A development build is never shipped, so the
fleet does not end up running whatever was in somebody's working tree.

`find_llama` finds, in the SHA256SUMS `--release` names (a directory's, or the one beside a .pyz),
the llama.cpp archive for the node's architecture, checked here against that list
(llmgw.nodeadd.node.llama ships it with the zipapp).
"""

from __future__ import annotations

import ssl
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

import attrs

from llmgw import download
from llmgw.errors import MachineError, PeerError, UsageError
from llmgw.releasefiles import ARCHES, LLAMA_NAME, NAME, SUMS, parse_sums, pick, release_files, running_release
from llmgw.version import version_info
from llmgw.wire.agent_link import RELEASE_PREFIX

__all__ = [
    "ARCHES",
    "Artifact",
    "find_artifact",
    "find_llama",
    "from_plane",
    "local_release",
    "parse_sums",
    "release_arch",
]

_FETCH_TIMEOUT_S = 30
# How node add has the node get its release (`--release-via`); AUTO: from the control plane when
# it holds the node's file, else over SSH.
AUTO, SSH, HTTPS = "", "ssh", "https"


@attrs.frozen(kw_only=True)
class Artifact:
    name: str  # llmgw-0.1.0-linux-amd64.pyz
    version: str
    sha256: str
    path: Path | None = None  # a file here, shipped over SFTP
    url: str = ""  # or fetched by the node
    from_plane: bool = False  # the url is the control plane's: the node checks it against the CA root

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
    sums_file = directory / SUMS
    try:
        sums = parse_sums(sums_file.read_text(), str(sums_file))
    except FileNotFoundError:
        raise UsageError(
            f"{directory} has no SHA256SUMS; download it with the release, or give the .pyz file itself"
        ) from None
    name, version, digest = pick(sums, arch, str(sums_file))
    return _checked(directory / name, version, digest, f"{sums_file}")


def _from_file(path: Path, arch: str) -> Artifact:
    m = NAME.match(path.name)
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


def find_llama(release: str, arch: str) -> tuple[Artifact | None, str]:
    """The llama.cpp archive for `arch` in the release `--release` names, checked against its
    SHA256SUMS; or (None, why not, "" when the release is no local one: a URL, or nothing
    given). Blocking (a whole-file hash)."""
    if not release or release.startswith(("http://", "https://")):
        return None, ""
    path = Path(release)
    directory = path if path.is_dir() else path.parent
    sums_file = directory / SUMS
    try:
        sums = parse_sums(sums_file.read_text(), str(sums_file))
    except FileNotFoundError:
        return (
            None,
            f"there is no {sums_file} to list a llama.cpp archive: the node takes llama.cpp from the control plane",
        )
    # The CPU build: a node with a Vulkan device takes the Vulkan build from the control plane.
    found = [(n, m["version"]) for n in sums if (m := LLAMA_NAME.match(n)) and m["arch"] == arch and not m["backend"]]
    if not found:
        return (
            None,
            f"{sums_file} lists no llama.cpp archive for {arch}: the node takes llama.cpp from the control plane",
        )
    if len(found) > 1:
        raise UsageError(
            f"{sums_file} lists several llama.cpp archives for {arch} ({', '.join(n for n, _ in found)}); keep one"
        )
    name, version = found[0]
    if not (directory / name).is_file():
        return None, (
            f"{sums_file} lists {name}, which is not beside it: the node takes llama.cpp from the control plane; "
            "download it too for the release's own"
        )
    return _checked(directory / name, version, sums[name], str(sums_file)), ""


def _from_url(url: str, arch: str) -> Artifact:
    base = url if url.endswith("/") else url + "/"
    sums_url = base + "SHA256SUMS"
    try:
        with urllib.request.urlopen(sums_url, timeout=_FETCH_TIMEOUT_S) as r:
            text = r.read(1 << 20).decode("utf-8", "replace")
    except (urllib.error.URLError, OSError) as exc:
        raise PeerError(f"cannot read {sums_url}: {getattr(exc, 'reason', exc)}; check the release URL") from None
    name, version, digest = pick(parse_sums(text, sums_url), arch, sums_url)
    return Artifact(name=name, version=version, sha256=digest, url=base + name)


def local_release(release_dir: str, arch: str) -> Artifact:
    """What is copied over SSH without `--release`, in the control plane's order
    (`llmgw.server.nodes.releases`): `[release] dir`; else the release directory this llmgw runs from,
    when a SHA256SUMS beside its file lists it; else this llmgw itself. Checked here before use."""
    if release_dir:
        return _from_dir(Path(release_dir), arch)
    me = running_release()
    if me is not None:
        beside = me.path.parent / SUMS
        try:
            listed = me.name in parse_sums(beside.read_text(), str(beside))
        except (OSError, UsageError):
            listed = False
        if listed:
            return _from_dir(me.path.parent, arch)
    return _this_llmgw(arch)


def _this_llmgw(arch: str) -> Artifact:
    info = version_info()
    me = running_release()
    fix = (
        f"set [release] dir in server.toml to a directory holding llmgw-VERSION-linux-{arch}.pyz and SHA256SUMS, "
        f"or pass --release DIR (such a directory), --release FILE.pyz or --release URL"
    )
    if me is None:
        raise UsageError(f"this llmgw ({info.version}) is not a release build, so it is not shipped to nodes; {fix}")
    if me.arch != arch:
        raise UsageError(f"this llmgw is the linux-{me.arch} release and the node is linux-{arch}; {fix}")
    return Artifact(name=me.name, version=me.version, sha256=sha256_of(me.path), path=me.path)


def plane_url(host: str, port: int) -> str:
    """Where the control plane serves its release files: the agent port, at the address the agent dials."""
    return f"https://{f'[{host}]' if ':' in host else host}:{port}{RELEASE_PREFIX}"


def from_plane(host: str, port: int, ca_pem: bytes, arch: str) -> tuple[Artifact | None, str]:
    """The control plane's file for `arch`, from its SHA256SUMS read over HTTPS (the server checked
    against the cluster's CA root alone), or (None, why) when it holds none for `arch`. Blocking."""
    base = plane_url(host, port)
    ctx = ssl.create_default_context(cadata=ca_pem.decode())  # the CA root only: no system store
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=ctx))
    try:
        with opener.open(base + SUMS, timeout=_FETCH_TIMEOUT_S) as r:
            text = r.read(1 << 20).decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        said = exc.read(600).decode("utf-8", "replace").strip()
        if exc.code == 404:
            return None, said or f"{base}{SUMS}: 404"
        raise PeerError(f"the control plane answered HTTP {exc.code} for {base}{SUMS}: {said}") from None
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, ssl.SSLCertVerificationError):
            raise MachineError(
                f"what answers at {base} is not this control plane: its certificate is not from the cluster's CA "
                f"({exc.reason.verify_message}); check [server].advertise / --server-address, or copy the release "
                "over SSH with --release-via ssh"
            ) from None
        raise _unreadable(base, exc.reason) from None
    except OSError as exc:  # e.g. the TLS alert of a plane that wants a certificate, read with the answer
        raise _unreadable(base, exc) from None
    label = f"the control plane's {base}{SUMS}"
    try:
        name, version, digest = pick(release_files(parse_sums(text, label)), arch, label)
    except UsageError as exc:
        return None, str(exc)
    return Artifact(name=name, version=version, sha256=digest, url=base + name, from_plane=True), ""


def _unreadable(base: str, reason: object) -> MachineError:
    return MachineError(
        f"cannot read the control plane's release list at {base}{SUMS}: {reason}; is `llmgw server` listening on "
        "agent_listen, with [release] serve = true (the default)? Or copy the release over SSH with --release-via ssh"
    )


def how_to_ship(*, release: str, via: str, plane_serves: bool) -> str:
    """`--release-via` with `--release` and server.toml's `[release] serve`: where the file comes
    from. "given": `--release` as before; SSH: `local_release` over SSH; HTTPS: the control plane,
    falling back to SSH only under AUTO (`choose` does that)."""
    if via not in (AUTO, SSH, HTTPS):
        raise UsageError(f"--release-via {via}: expected ssh or https")
    if release:
        if via == HTTPS:
            raise UsageError(
                f"--release {release} and --release-via https: the node fetches over HTTPS only the control "
                "plane's own release files ([release] dir in server.toml); drop one of the two"
            )
        if via == SSH and release.startswith(("http://", "https://")):
            raise UsageError(
                f"--release {release} and --release-via ssh: with a URL the node downloads the file itself, "
                "which --release-via ssh is for avoiding; download the release here and give its directory "
                "(--release DIR --release-via ssh), or drop --release-via"
            )
        return "given"
    if via == SSH:
        return SSH
    if not plane_serves:
        if via == HTTPS:
            raise UsageError(
                "--release-via https: this control plane serves no release ([release] serve = false in "
                "server.toml); set it to true and restart `llmgw server`, or use --release-via ssh"
            )
        return SSH
    return HTTPS
