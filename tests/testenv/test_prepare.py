"""tools/testenv/prepare.py: what `./pants test` provides before the tests run, and what it says.

The decisions run against a fake machine (what exists, who runs it, what apt-get and the llama
build answer); the last tests run the real script and the real build script on this machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from testenv import prepare
from testenv.prepare import NEEDS, Machine
from testlib import llama
from testlib.proc import build_root

EVERYTHING = {item for need in NEEDS for item in need.provides} | {prepare.APT_GET}
BUILD = Path("/checkout/tools/llama/build-llama-server")
DEBIAN = Path("/checkout/tools/testenv/debian_root.py")
LLAMA = [sys.executable, "-I", str(BUILD)]  # run with the interpreter Pants runs on
VULKAN_CACHED = [*LLAMA, "--vulkan", "--cached"]


class Fake:
    """A machine that has `present`, runs as `euid`, and records what would be run."""

    def __init__(
        self,
        present: set[str],
        *,
        euid: int = 0,
        apt_status: int = 0,
        installs: dict[str, set[str]] | None = None,
        llama: str = "cached",
        vulkan: str = "cached",
        debian: str = "cached",
        env: dict | None = None,
    ) -> None:
        self.present = set(present)
        self._euid = euid
        self.apt_status = apt_status
        self.installs = installs or {}  # package -> what installing it provides
        self.llama = llama  # "cached", "missing", "broken" (its --cached check fails)
        self.vulkan = vulkan  # the same, for the Vulkan build (--vulkan --cached)
        self.debian = debian  # the same, for the Debian root
        self.ran: list[tuple[list[str], dict]] = []
        self.captured: list[list[str]] = []
        self.said: list[str] = []
        self.spawned: list[tuple[list[str], dict, Path]] = []
        self.exported: list[tuple[str, str]] = []
        self.machine = Machine(
            has=self.present.__contains__,
            euid=lambda: self._euid,
            run=self._run,
            capture=self._capture,
            quiet=self._quiet,
            env=dict(env or {}),
            say=self.said.append,
            spawn=self._spawn,
            export=lambda name, value: self.exported.append((name, value)),
            cores=lambda: 2,
        )

    def _spawn(self, argv: Sequence[str], env: dict, log: Path) -> int:
        self.spawned.append((list(argv), dict(env), log))
        return 4242

    def _run(self, argv: Sequence[str], env: dict) -> int:
        self.ran.append((list(argv), dict(env)))
        if argv[:2] == ["apt-get", "install"] and self.apt_status == 0:
            for package in argv[2:]:
                self.present |= self.installs.get(package, set())
        return self.apt_status

    def _capture(self, argv: Sequence[str]) -> tuple[int, str]:
        self.captured.append(list(argv))
        if argv[0] == str(DEBIAN):
            if argv[1:] == ["--cached"]:
                return (0, "/cache/root\n") if self.debian == "cached" else (prepare.NOT_BUILT, "")
            if self.debian == "fails":
                return 1, ""
            self.debian = "cached"
            return 0, "/cache/root\n"
        # prepare builds only in the background
        assert argv[:3] == LLAMA and argv[3:] in (["--cached"], ["--vulkan", "--cached"]), argv
        state = self.vulkan if "--vulkan" in argv else self.llama
        if state == "broken":
            return 2, ""
        return (0, "/cache/llama-server\n") if state == "cached" else (prepare.NOT_BUILT, "")

    def _quiet(self, argv: Sequence[str]) -> int:
        self.captured.append(list(argv))
        return 0 if argv[0] in self.present else 127

    @property
    def text(self) -> str:
        return "\n".join(self.said)


def without(*items: str) -> set[str]:
    return EVERYTHING - set(items)


def run(fake: Fake) -> int:
    return prepare.prepare(fake.machine, build=BUILD, debian=DEBIAN)


# -- packages ---------------------------------------------------------------------------------


def test_everything_there_as_root_says_nothing_and_runs_nothing_but_the_cache_check() -> None:
    fake = Fake(EVERYTHING)
    assert run(fake) == 0
    assert fake.said == []
    assert fake.ran == []
    assert fake.captured == [[*LLAMA, "--cached"], VULKAN_CACHED, [str(DEBIAN), "--cached"]]


def test_as_root_only_the_missing_packages_are_installed_saying_what_and_why() -> None:
    fake = Fake(without("tmux", "/usr/sbin/sshd"), installs={"tmux": {"tmux"}, "openssh-server": {"/usr/sbin/sshd"}})
    assert run(fake) == 0
    assert [argv for argv, _ in fake.ran] == [
        ["apt-get", "update", "-q", "-o", "DPkg::Lock::Timeout=300"],
        ["apt-get", "install", "-y", "-q", "--no-install-recommends", "-o", "DPkg::Lock::Timeout=300", "openssh-server", "tmux"],
    ]  # fmt: skip
    assert all(env == {"DEBIAN_FRONTEND": "noninteractive"} for _, env in fake.ran)
    assert "openssh-server: node add's tests log into a real sshd (/usr/sbin/sshd missing)" in fake.text
    assert "tmux: node add's terminal screens are tested in a real tmux pane (tmux missing)" in fake.text
    assert "installing them: apt-get install openssh-server tmux" in fake.text


def test_not_root_is_told_the_one_command_and_nothing_is_run() -> None:
    fake = Fake(without("tmux", "/usr/sbin/sshd"), euid=1000)
    assert run(fake) == 1
    assert fake.ran == [] and fake.captured == []  # no llama build either: cmake and g++ may be missing too
    assert fake.said[-2:] == [
        "installing them needs root; run this, then ./pants test again:",
        "  sudo apt-get update && sudo apt-get install -y --no-install-recommends openssh-server tmux",
    ]


def test_not_root_without_sudo_is_told_to_use_su() -> None:
    fake = Fake(without("sudo"), euid=1000)
    assert run(fake) == 1
    assert fake.said[-1] == "  su -c 'apt-get update && apt-get install -y --no-install-recommends sudo'"
    assert "sudo: node add's test logs into its node as a user with passwordless sudo (sudo missing)" in fake.text


def test_a_machine_without_apt_get_is_told_what_is_missing_and_stops() -> None:
    fake = Fake(without("ip", prepare.APT_GET))
    assert run(fake) == 1
    assert fake.ran == []
    assert "iproute2: tests make network namespaces and veth pairs (ip netns) (ip missing)" in fake.text
    assert "no /usr/bin/apt-get" in fake.said[-1]


def test_a_failed_apt_get_stops_before_pants_runs() -> None:
    fake = Fake(without("tmux"), apt_status=100)
    assert run(fake) == 1
    assert len(fake.ran) == 1  # update failed: no install attempted
    assert fake.said[-1] == "apt-get update failed (above); fix that and run ./pants test again"
    assert fake.captured == []  # and no llama build


def test_a_package_that_installs_but_does_not_provide_the_program_is_named() -> None:
    fake = Fake(without("systemd-analyze"), installs={"systemd": set()})
    assert run(fake) == 1
    assert fake.said[-1] == (
        "systemd is installed but systemd-analyze is still missing; the tests need it: "
        "the systemd units node add writes and the docs show are verified"
    )


def test_one_package_with_several_programs_is_installed_once_naming_every_missing_one() -> None:
    fake = Fake(without("unshare", "nsenter"), installs={"util-linux": {"unshare", "nsenter"}})
    assert run(fake) == 0
    assert fake.ran[-1][0][-1:] == ["util-linux"]
    assert "(unshare, nsenter missing)" in fake.text


# -- llama-server ---------------------------------------------------------------------------


def test_an_unbuilt_llama_cpp_is_built_in_the_background_saying_why_where_and_how_long() -> None:
    """The build does not hold the suite back: it starts in the background (its log under dist/),
    the Debian root is made meanwhile, and Pants is told to wait for it (LLMGW_LLAMA_BUILD_STATE, in
    //tools/llama:built's environment) and to run one more process than it has cores."""
    fake = Fake(EVERYTHING, llama="missing", debian="missing", env={"LLAMA_BUILD_JOBS": "4"})
    assert run(fake) == 0
    assert fake.spawned == [(LLAMA, {"LLAMA_BUILD_JOBS": "4"}, prepare.BUILD_LOG)]
    assert fake.captured == [[*LLAMA, "--cached"], VULKAN_CACHED, [str(DEBIAN), "--cached"], [str(DEBIAN)]]
    assert fake.exported == [
        ("LLMGW_LLAMA_BUILD_STATE", "building:4242"),
        ("LLMGW_LLAMA_VULKAN_BUILD_STATE", "built"),
        ("PANTS_PROCESS_EXECUTION_LOCAL_PARALLELISM", "3"),
    ]
    said = fake.said[0]
    assert said.startswith("llama.cpp is not built yet: the release test ships it, and the llama.cpp engine tests")
    assert "as the release ships it but with only the CPU variants this machine loads" in said
    assert "in the background with 4 jobs (pid 4242; 19 minutes beside the suite on 2 cores" in said
    assert "its output goes to dist/testenv/llama-build.log" in said
    assert said.endswith("the others wait for it (//tools/llama:built), and fail with the build's error if it fails")


def test_an_unbuilt_vulkan_build_starts_beside_the_cpu_one_and_pants_gets_a_slot_for_each_wait() -> None:
    fake = Fake(EVERYTHING, llama="missing", vulkan="missing")
    assert run(fake) == 0
    assert fake.spawned == [
        (LLAMA, {"LLAMA_BUILD_JOBS": "3"}, prepare.BUILD_LOG),
        ([*LLAMA, "--vulkan"], {"LLAMA_BUILD_JOBS": "3"}, prepare.VULKAN_BUILD_LOG),
    ]
    assert fake.exported == [
        ("LLMGW_LLAMA_BUILD_STATE", "building:4242"),
        ("LLMGW_LLAMA_VULKAN_BUILD_STATE", "building:4242"),
        ("PANTS_PROCESS_EXECUTION_LOCAL_PARALLELISM", "4"),
    ]
    said = fake.said[1]
    assert said.startswith("llama.cpp's Vulkan build is not there yet: the Vulkan engine test runs it on lavapipe")
    assert "its output goes to dist/testenv/llama-vulkan-build.log" in said
    assert said.endswith("(//tools/llama:built-vulkan)")


def test_only_the_vulkan_build_missing_starts_it_alone() -> None:
    fake = Fake(EVERYTHING, vulkan="missing")
    assert run(fake) == 0
    assert [argv for argv, _, _ in fake.spawned] == [[*LLAMA, "--vulkan"]]
    assert fake.exported == [
        ("LLMGW_LLAMA_BUILD_STATE", "built"),
        ("LLMGW_LLAMA_VULKAN_BUILD_STATE", "building:4242"),
        ("PANTS_PROCESS_EXECUTION_LOCAL_PARALLELISM", "3"),
    ]


def test_a_vulkan_cache_check_that_fails_stops_with_its_status() -> None:
    fake = Fake(EVERYTHING, vulkan="broken")
    assert run(fake) == 1
    assert fake.said[-1] == f"{' '.join(LLAMA)} --vulkan --cached failed with status 2"


def test_the_background_build_takes_one_job_more_than_the_cores_unless_told() -> None:
    fake = Fake(EVERYTHING, llama="missing")
    assert run(fake) == 0
    [(_, env, _)] = fake.spawned
    assert env == {"LLAMA_BUILD_JOBS": "3"}


def test_a_built_llama_cpp_is_said_to_pants_as_built_and_nothing_is_started() -> None:
    fake = Fake(EVERYTHING)
    assert run(fake) == 0
    assert fake.spawned == []
    assert fake.exported == [("LLMGW_LLAMA_BUILD_STATE", "built"), ("LLMGW_LLAMA_VULKAN_BUILD_STATE", "built")]


def test_a_cache_check_that_fails_otherwise_stops_with_its_status() -> None:
    fake = Fake(EVERYTHING, llama="broken")
    assert run(fake) == 1
    assert fake.spawned == []
    assert fake.said[-1] == f"{' '.join(LLAMA)} --cached failed with status 2"


def test_llmgw_llama_server_names_the_tests_server_but_the_release_build_is_still_made() -> None:
    fake = Fake(EVERYTHING | {"/opt/llama-server"}, llama="missing", env={"LLMGW_LLAMA_SERVER": "/opt/llama-server"})
    assert run(fake) == 0
    assert [argv for argv, _, _ in fake.spawned] == [LLAMA]
    assert fake.captured == [
        [*LLAMA, "--cached"],
        VULKAN_CACHED,
        ["/opt/llama-server", "--version"],
        [str(DEBIAN), "--cached"],
    ]
    assert fake.said[0].startswith("llama.cpp is not built yet")


def test_an_llmgw_llama_server_that_does_not_run_stops_with_its_name() -> None:
    fake = Fake(EVERYTHING, env={"LLMGW_LLAMA_SERVER": "/nowhere/llama-server"})
    assert run(fake) == 1
    assert fake.said == [
        "LLMGW_LLAMA_SERVER=/nowhere/llama-server does not run (`/nowhere/llama-server --version` fails); "
        "fix it, or unset it to use the cached build"
    ]


# -- the test machines' Debian root ----------------------------------------------------------


def test_an_unbuilt_debian_root_is_made_saying_why_and_how_long() -> None:
    fake = Fake(EVERYTHING, debian="missing")
    assert run(fake) == 0
    assert fake.captured[-2:] == [[str(DEBIAN), "--cached"], [str(DEBIAN)]]
    [said] = fake.said
    assert "Debian 12 root is not built yet" in said and "debootstrap" in said and "about a minute" in said


def test_a_failed_debian_root_stops_with_a_message() -> None:
    fake = Fake(EVERYTHING, debian="fails")
    assert run(fake) == 1
    assert (
        fake.said[-1] == "building the test machines' Debian root failed (above); fix that and run ./pants test again"
    )


def test_not_root_never_runs_debootstrap() -> None:
    fake = Fake(EVERYTHING, euid=1000, debian="missing")
    assert run(fake) == 0
    assert all(argv[0] != str(DEBIAN) for argv in fake.captured)
    assert "boot test machines" in fake.text


def test_not_root_with_everything_there_runs_and_says_which_tests_need_root() -> None:
    fake = Fake(EVERYTHING, euid=1000)
    assert run(fake) == 0
    [said] = fake.said
    assert said.startswith("not root: the tests that make network namespaces")


# -- the real scripts, on this machine ------------------------------------------------------


def test_every_need_names_a_package_and_says_why() -> None:
    assert len({n.package for n in NEEDS}) == len(NEEDS)
    assert all(n.provides and n.why for n in NEEDS)
    # The paths the test helpers run by absolute path are the ones checked.
    provided = {item for n in NEEDS for item in n.provides}
    assert {"/usr/sbin/sshd", "ip", "unshare", "nsenter", "sudo", "tmux", "systemd-analyze", "chromium"} <= provided
    assert "haproxy" in provided  # tests/testlib/haproxy.py runs it
    assert "wrk" in provided  # tests/integration/test_gateway_bench.py's benchmark loads the gateway with it


def test_a_machine_without_chromium_gets_it_for_the_cluster_page_tests() -> None:
    fake = Fake(without("chromium"), installs={"chromium": {"chromium"}})
    assert run(fake) == 0
    assert [argv for argv, _ in fake.ran][-1][-1] == "chromium"
    assert "chromium: the cluster page is tested in a real headless Chromium (chromium missing)" in fake.text


def test_a_machine_without_postgresql_gets_it_for_the_store_tests() -> None:
    fake = Fake(
        without("/usr/lib/postgresql/*/bin/initdb", "/usr/lib/postgresql/*/bin/pg_ctl"),
        installs={"postgresql": {"/usr/lib/postgresql/*/bin/initdb", "/usr/lib/postgresql/*/bin/pg_ctl"}},
    )
    assert run(fake) == 0
    assert [argv for argv, _ in fake.ran][-1][-1] == "postgresql"
    assert "postgresql: the store's tests run against a real PostgreSQL cluster" in fake.text


def test_a_versioned_directory_is_found_by_its_pattern_on_this_machine() -> None:
    """Debian installs PostgreSQL's server programs under /usr/lib/postgresql/VERSION/bin, off PATH:
    the check globs, and finds what testlib.postgres runs."""
    from testlib.postgres import bindir

    assert prepare._has("/usr/lib/postgresql/*/bin/initdb")
    assert not prepare._has("/usr/lib/postgresql/*/bin/no-such-program")
    assert (bindir() / "initdb").exists() and (bindir() / "pg_ctl").exists()


def test_the_chromium_the_tests_drive_is_installed_and_runs() -> None:
    from testlib.browser import chromium_binary

    done = subprocess.run([chromium_binary(), "--version"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("Chromium "), done.stderr


def test_a_machine_without_haproxy_gets_it_for_the_load_balancer_test() -> None:
    fake = Fake(without("haproxy"), installs={"haproxy": {"haproxy"}})
    assert run(fake) == 0
    assert [argv for argv, _ in fake.ran][-1][-1] == "haproxy"
    assert "haproxy: standalone gateways are tested behind a real HAProxy" in fake.text


def test_the_haproxy_the_tests_run_is_installed_and_checks_their_configuration(tmp_path: Path) -> None:
    from testlib.haproxy import haproxy_binary, write_config

    config = write_config(tmp_path, listen_port=1, gateway_ports=(2, 3), stats_port=4)
    done = subprocess.run([haproxy_binary(), "-c", "-f", str(config)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "WARNING" not in done.stdout + done.stderr  # nothing this HAProxy deprecates or ignores


def test_the_build_script_caches_where_the_tests_look(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`build-llama-server --cached` and the tests (testlib.llama) find this machine's llama-server
    in one place: the unpacked portable archive of the recipe this machine's compilers make."""
    script = build_root() / "tools" / "llama" / "build-llama-server"
    env = {**os.environ, "LLMGW_LLAMA_CACHE": str(tmp_path)}
    env.pop("LLMGW_LLAMA_SERVER", None)
    done = subprocess.run([sys.executable, "-I", str(script), "--cached"], env=env, capture_output=True, timeout=60)
    assert done.returncode == prepare.NOT_BUILT, done.stderr
    monkeypatch.delenv("LLMGW_LLAMA_SERVER", raising=False)
    monkeypatch.setenv("LLMGW_LLAMA_CACHE", str(tmp_path))
    fake = llama.cached_path()
    assert fake.is_relative_to(tmp_path / "portable") and fake.name == "llama-server"
    fake.parent.mkdir(parents=True)
    fake.write_text("#!/bin/sh\necho 'version: fake'\n")
    fake.chmod(0o755)
    done = subprocess.run(
        [sys.executable, "-I", str(script), "--cached"], env=env, capture_output=True, text=True, timeout=60
    )
    assert (done.returncode, done.stdout) == (0, f"{fake}\n"), done.stderr
    assert llama.llama_server() == str(fake)
    monkeypatch.setenv("LLMGW_LLAMA_SERVER", "/usr/bin/true")  # the variable still wins
    assert llama.llama_server() == "/usr/bin/true"


def test_on_this_prepared_machine_prepare_is_quick_and_does_nothing() -> None:
    script = build_root() / "tools" / "testenv" / "prepare.py"
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-I", str(script)], capture_output=True, text=True, timeout=60)
    took = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if not line.startswith("testenv: not root:")]
    assert lines == [], done.stderr  # nothing installed or built: `./pants test` prepared it already
    assert took < 2.0, f"prepare took {took:.2f} s on a prepared machine"  # ~0.05 s measured; 2 s for a loaded machine


def test_only_the_hand_over_lines_reach_stdout_whatever_a_program_run_prints() -> None:
    """`./pants` takes every stdout line of prepare.py for a NAME=VALUE; apt-get's progress
    there ("Get:1 http://deb.debian.org/... InRelease") stopped `./pants test` on a fresh machine."""
    code = (
        "import subprocess, sys; sys.path.insert(0, sys.argv[1]); import prepare; "
        "export = prepare.handover(); "
        "subprocess.run(['echo', 'Get:1 http://deb.debian.org/debian bookworm InRelease'], check=True); "
        "print('a stray print'); export('LLMGW_LLAMA_BUILD_STATE', 'built'); "
        "prepare._run(['sh', '-c', 'echo apt-get says'], {})"
    )
    where = str(build_root() / "tools" / "testenv")
    done = subprocess.run([sys.executable, "-I", "-c", code, where], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "LLMGW_LLAMA_BUILD_STATE=built\n"
    assert done.stderr.splitlines() == [
        "Get:1 http://deb.debian.org/debian bookworm InRelease",
        "a stray print",
        "apt-get says",
    ]


@pytest.mark.parametrize(
    ("args", "prepares"),
    [
        ("test ::", True),
        ("--no-pantsd test --force tests/llmgw::", True),
        ("lint test ::", True),
        ("test tests/x.py -- -k test", True),
        ("lint ::", False),
        ("run src/python/llmgw:llmgw -- test", False),  # after --: the program's arguments
        ("help test", False),
        ("package src/python/llmgw:llmgw", False),
    ],
)
def test_pants_prepares_for_the_test_goal_only(args: str, prepares: bool) -> None:
    script = (build_root() / "pants").read_text()
    function = script[script.index("wants_tests() {") : script.index("\n}\n", script.index("wants_tests() {")) + 3]
    done = subprocess.run(["bash", "-c", f"{function}\nwants_tests {args}"], capture_output=True, timeout=30)
    assert (done.returncode == 0) == prepares, done.stderr


def test_the_build_script_builds_the_release_the_nodes_are_pinned_to(tmp_path: Path) -> None:
    """One pin: llmgw's default for the nodes (llmgw.pins) is the source the tests' llama-server is
    built from, and `--sdist` hands the tests that source from the cache (no fetch when it is there)."""
    from llmgw import pins

    script = build_root() / "tools" / "llama" / "build-llama-server"
    assert llama.sdist_path().name == pins.LLAMACPP_SDIST_URL.rsplit("/", 1)[1]
    env = {**os.environ, "LLMGW_LLAMA_CACHE": str(tmp_path)}
    kept = tmp_path / llama.sdist_path().relative_to(llama.cache_root())
    kept.parent.mkdir(parents=True)
    kept.symlink_to(llama.sdist())  # the verified file, as a build leaves it
    done = subprocess.run([str(script), "--sdist"], env=env, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (0, f"{kept}\n"), done.stderr
    assert "fetching" not in done.stderr
    # A file that is not the pinned one is fetched again, never used (no network here: it says so).
    kept.unlink()
    kept.write_bytes(b"not the source")
    env["https_proxy"] = env["HTTPS_PROXY"] = "http://127.0.0.1:9"  # nothing listens: the fetch fails at once
    done = subprocess.run([str(script), "--sdist"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stdout == ""
    assert f"fetching llama.cpp's source {pins.LLAMACPP_VERSION}" in done.stderr and "could not fetch" in done.stderr
