"""release/llmgw_release/provide.py: the Debian packages `./pants run release:build` needs, provided
as `./pants test` provides the tests' (tools/testenv/prepare.py's package step).

The decisions run against a fake machine (which programs exist, who runs the build, what apt-get
installs), as tests/testenv/test_prepare.py's do; nothing is installed or built."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
from llmgw_release import build, llamabuild, llamasmoke, provide

from llmgw import llamarecipe
from testenv import prepare
from testenv.prepare import Machine

# What a machine `./pants test` prepared has: every program of the tests' packages, and apt-get.
PREPARED = {item for need in prepare.NEEDS for item in need.provides} | {prepare.APT_GET}
CROSS_ARM64 = {
    "crossbuild-essential-arm64": {"aarch64-linux-gnu-gcc", "aarch64-linux-gnu-g++"},
    "qemu-user-static": {"qemu-aarch64-static"},
    "libc6-arm64-cross": {"/usr/aarch64-linux-gnu/lib/ld-linux-aarch64.so.1"},
}
APT_UPDATE = ["apt-get", "update", "-q", "-o", "DPkg::Lock::Timeout=300"]


class Fake:
    """A machine that has `present`, runs the build as `euid`, and records what would be run."""

    def __init__(self, present: set[str], *, euid: int = 0, installs: dict[str, set[str]] | None = None) -> None:
        self.present = set(present)
        self.installs = installs or {}  # package -> what installing it provides
        self.ran: list[list[str]] = []
        self.said: list[str] = []

        def unused(*_args: object) -> object:
            raise AssertionError("the package step runs nothing but apt-get")

        self.machine = Machine(
            has=self.present.__contains__,
            euid=lambda: euid,
            run=self._run,
            capture=unused,
            quiet=unused,
            env={},
            say=self.said.append,
            spawn=unused,
            export=unused,
            cores=lambda: 2,
        )

    def _run(self, argv: Sequence[str], env: dict) -> int:
        assert env == {"DEBIAN_FRONTEND": "noninteractive"}
        self.ran.append(list(argv))
        if argv[:2] == ["apt-get", "install"]:
            for package in argv[2:]:
                self.present |= self.installs.get(package, set())
        return 0


def packages(needs: Sequence[prepare.Need]) -> list[str]:
    return [need.package for need in needs]


def test_a_machine_the_test_run_prepared_lacks_only_the_cross_build_and_qemu() -> None:
    gaps = prepare.missing(provide.needs(build.ARCHES, "amd64"), PREPARED.__contains__)
    assert [need.package for need, _ in gaps] == list(CROSS_ARM64)
    assert {need.package: set(absent) for need, absent in gaps} == CROSS_ARM64


def test_as_root_the_cross_packages_are_installed_saying_what_and_why() -> None:
    fake = Fake(PREPARED, installs=CROSS_ARM64)
    assert provide.provide(fake.machine, build.ARCHES, "amd64", again="./pants run release:build -- ...")
    assert fake.ran == [APT_UPDATE, prepare.install_argv(list(CROSS_ARM64))]
    assert fake.said == [
        "the release build needs 3 Debian package(s) this machine does not have:",
        "  crossbuild-essential-arm64: builds llama.cpp for arm64 (aarch64-linux-gnu-gcc, aarch64-linux-gnu-g++ missing)",
        "  qemu-user-static: runs the arm64 llama.cpp once under qemu-user before it ships (qemu-aarch64-static missing)",
        "  libc6-arm64-cross: runs the arm64 llama.cpp once under qemu-user before it ships "
        "(/usr/aarch64-linux-gnu/lib/ld-linux-aarch64.so.1 missing)",
        "installing them: apt-get install crossbuild-essential-arm64 qemu-user-static libc6-arm64-cross",
    ]


def test_not_root_the_build_says_the_one_command_and_stops_before_it_builds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(llamabuild, "this_host", lambda: "amd64")
    fake = Fake(PREPARED, euid=1000)
    out = tmp_path / "release"
    assert build.main(["--version", "0.1.0", "--out", str(out)], machine=fake.machine) == 1
    assert fake.ran == [] and not out.exists()
    assert fake.said[-2:] == [
        "installing them needs root; run this, then ./pants run release:build -- --version 0.1.0 --out "
        f"{out} again:",
        "  sudo apt-get update && sudo apt-get install -y --no-install-recommends "
        "crossbuild-essential-arm64 qemu-user-static libc6-arm64-cross",
    ]


def test_one_architecture_of_this_machine_needs_nothing_the_test_run_did_not_install() -> None:
    fake = Fake(PREPARED)
    assert provide.provide(fake.machine, ("amd64",), "amd64", again="the build")
    assert fake.ran == [] and fake.said == []
    assert "crossbuild-essential-arm64" not in packages(provide.needs(("amd64",), "amd64"))


def test_an_arm64_machine_needs_the_amd64_cross_build_and_qemu() -> None:
    needs = {need.package: need for need in provide.needs(build.ARCHES, "arm64")}
    assert needs["crossbuild-essential-amd64"].provides == ("x86_64-linux-gnu-gcc", "x86_64-linux-gnu-g++")
    assert needs["qemu-user-static"].provides == ("qemu-x86_64-static",)
    assert needs["libc6-amd64-cross"].provides == ("/usr/x86_64-linux-gnu/lib64/ld-linux-x86-64.so.2",)
    assert "crossbuild-essential-arm64" not in needs


@pytest.mark.parametrize("host", llamarecipe.ARCHES)
def test_every_program_the_build_checks_for_is_provided(host: str) -> None:
    """The needs come from the build's own checks: what gets past `provide` gets past them."""
    provided = {item: need.package for need in provide.needs(build.ARCHES, host) for item in need.provides}
    for arch in build.ARCHES:
        checked = {**llamabuild.needed_tools(llamarecipe.toolchain(arch, host)), **llamasmoke.smoke_needs(arch, host)}
        assert {item: provided.get(item) for item in checked} == checked
    assert provided["git"] == "git"  # the commit


def test_apt_gets_output_goes_to_stderr_not_to_the_builds_stdout(capfd: pytest.CaptureFixture[str]) -> None:
    assert provide._run(["sh", "-c", "echo Get:1 http://deb.debian.org/debian bookworm InRelease"], {}) == 0
    out, err = capfd.readouterr()
    assert (out, err) == ("", "Get:1 http://deb.debian.org/debian bookworm InRelease\n")
