"""The release `node add --release` names is the release the node gets, whole: its llama.cpp
archive for the node's architecture is found by the operator's SHA256SUMS and checked here
(release.find_llama), shipped when the control plane will want that version from the release
(llama.wanted, llama.choose), and placed in the agent's release directory with that list's line
(llama.place); an add that ships none removes what an earlier one placed. The whole of it against
a real node is tests/integration/test_node_add_release_fetch.py."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest
import trio

from llmgw import config as cfg
from llmgw.errors import MachineError, UsageError
from llmgw.nodeadd import ssh
from llmgw.nodeadd.node import layout, llama
from llmgw.nodeadd.release import find_llama
from llmgw.pins import LLAMACPP_VERSION

PYZ = "llmgw-0.3.0-linux-amd64.pyz"
AMD = f"llama.cpp-{LLAMACPP_VERSION}-linux-amd64.tar.gz"
ARM = f"llama.cpp-{LLAMACPP_VERSION}-linux-arm64.tar.gz"


def _release(d: Path, *names: str, listed: tuple[str, ...] = ()) -> Path:
    """A release directory holding `names` (a zipapp, llama.cpp archives) and a SHA256SUMS of
    them and of `listed` (listed, not downloaded)."""
    d.mkdir(parents=True, exist_ok=True)
    for name in names:
        if name.endswith(".pyz"):
            with zipfile.ZipFile(d / name, "w") as z:
                z.writestr("__main__.py", "print('hi')\n")
        else:
            (d / name).write_bytes(f"the archive {name}".encode())
    lines = [f"{hashlib.sha256((d / n).read_bytes()).hexdigest()}  {n}" for n in names]
    lines += [f"{'0' * 64}  {n}" for n in listed]
    (d / "SHA256SUMS").write_text("\n".join(lines) + "\n")
    return d


def test_the_archive_for_the_nodes_architecture_is_found_by_the_list_and_checked(tmp_path: Path) -> None:
    d = _release(tmp_path / "rel", PYZ, AMD, ARM)
    art, why = find_llama(str(d), "arm64")
    assert why == "" and art is not None
    assert (art.name, art.version, art.path) == (ARM, LLAMACPP_VERSION, d / ARM)
    assert art.sha256 == hashlib.sha256((d / ARM).read_bytes()).hexdigest()
    # A .pyz given: the list beside it.
    assert find_llama(str(d / PYZ), "amd64")[0].path == d / AMD  # type: ignore[union-attr]
    # Damaged after the list was made: refused here, before anything goes.
    (d / AMD).write_bytes(b"tampered")
    with pytest.raises(MachineError, match="damaged or not the released one"):
        find_llama(str(d), "amd64")


def test_a_release_without_the_archive_says_where_llama_cpp_comes_from_instead(tmp_path: Path) -> None:
    art, why = find_llama(str(_release(tmp_path / "a", PYZ)), "amd64")
    assert (
        art is None and "lists no llama.cpp archive for amd64: the node takes llama.cpp from the control plane" in why
    )
    art, why = find_llama(str(_release(tmp_path / "b", PYZ, listed=(AMD,))), "amd64")
    assert art is None and f"lists {AMD}, which is not beside it" in why and "download it too" in why
    alone = tmp_path / "c"
    alone.mkdir()
    with zipfile.ZipFile(alone / PYZ, "w") as z:
        z.writestr("__main__.py", "")
    art, why = find_llama(str(alone / PYZ), "amd64")
    assert art is None and "no" in why and "SHA256SUMS" in why
    assert find_llama("https://example.net/release/", "amd64") == (None, "")  # the node fetches from a URL
    assert find_llama("", "amd64") == (None, "")
    two = _release(tmp_path / "d", PYZ, AMD, "llama.cpp-b1-linux-amd64.tar.gz")
    with pytest.raises(UsageError, match="several llama.cpp archives for amd64"):
        find_llama(str(two), "amd64")


def test_it_goes_only_where_the_control_plane_will_want_that_version_from_the_release() -> None:
    default = cfg.EnginesSection()
    assert llama.wanted(default, llamacpp_bin="") == LLAMACPP_VERSION  # the pinned release's, by default
    assert llama.wanted(default, llamacpp_bin="/opt/llama-server") == ""  # the operator's wins on the node
    operators = cfg.server_config_from_dict({"engines": {"llamacpp": {"version": ""}}}).engines
    assert llama.wanted(operators, llamacpp_bin="") == ""
    off = cfg.server_config_from_dict({"engines": {"llamacpp": {"release": False}}}).engines
    assert llama.wanted(off, llamacpp_bin="") == ""


def test_another_version_than_the_one_wanted_is_not_shipped(tmp_path: Path) -> None:
    d = _release(tmp_path / "rel", PYZ, AMD)
    art, why = trio.run(llama.choose, str(d), "amd64", LLAMACPP_VERSION)
    assert art is not None and why == ""
    art, why = trio.run(llama.choose, str(d), "amd64", "b99999")
    assert art is None and f"its llama.cpp is {LLAMACPP_VERSION} and the control plane wants b99999" in why
    assert trio.run(llama.choose, str(d), "amd64", "") == (None, "")  # nothing wanted: nothing looked at


class _Node:
    def __init__(self) -> None:
        self.target = ssh.Target(user="root", host="10.0.0.21")
        self.user = "root"
        self.ran: list[list[str]] = []
        self.sent: dict[str, str] = {}

    async def run(self, argv, *, sudo=False, timeout_s):
        self.ran.append(list(argv))
        return ssh.Result(exit_status=0, stdout="", stderr="")

    async def put(self, local, remote, mode=0o755, *, timeout_s=600):
        self.sent[remote] = Path(local).read_text()


def test_configure_places_it_with_its_line_of_the_list_and_an_add_without_removes_it(tmp_path: Path) -> None:
    d = _release(tmp_path / "rel", PYZ, AMD)
    art, _ = find_llama(str(d), "amd64")
    assert art is not None
    stage = "/tmp/llmgw-node-add.abcdefgh"
    node = _Node()
    assert trio.run(llama.place, node, stage, art) == f"{layout.RELEASE_DIR}/{AMD}"
    assert node.sent == {f"{stage}/SHA256SUMS": f"{art.sha256}  {AMD}\n"}
    assert node.ran == [
        ["install", "-d", "-m", "0755", "/var/lib/llmgw-agent/release"],
        ["install", "-m", "0644", f"{stage}/{AMD}", f"/var/lib/llmgw-agent/release/{AMD}"],
        ["install", "-m", "0644", f"{stage}/SHA256SUMS", "/var/lib/llmgw-agent/release/SHA256SUMS"],
        ["find", "/var/lib/llmgw-agent/release", "-maxdepth", "1", "-type", "f", "!", "-name", AMD,
         "!", "-name", "SHA256SUMS", "-delete"],
    ]  # fmt: skip
    again = _Node()
    assert trio.run(llama.place, again, stage, None) == ""
    assert again.ran == [["rm", "-rf", "--", "/var/lib/llmgw-agent/release"]]
