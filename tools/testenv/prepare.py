#!/usr/bin/env python3
"""What `./pants test` needs of this machine, provided before Pants starts.

`./pants` runs this (with the Python 3.9 it runs Pants with) whenever its arguments name the
`test` goal; `tools/testenv/prepare.py` runs it alone. It makes sure of these, in order:

1. The Debian packages whose programs the tests run (NEEDS says which and why). It checks for
   the programs themselves, not for package records: a missing one is installed with apt-get
   when running as root; otherwise it prints the one `apt-get install` command to run and exits 1.
   `./pants run release:build` provides its own packages (the cross compiler, qemu-user) through
   this same step (`ensure_packages`, from release/llmgw_release/provide.py).
2. llama.cpp, built the way the release ships it for this machine's CPU (tools/llama/build-llama-server:
   the portable archive for this machine's architecture with the CPU variants this CPU loads, its
   baseline and its best: a third of the compiling of the release's every variant; cached under
   ~/.cache/llmgw-llama and unpacked there). The release test ships that archive; the engine
   tests and node add's test nodes run its llama-server, unless LLMGW_LLAMA_SERVER names another;
   the agent's build-from-source test finds it in its build cache under the key of the agent's
   own build (testlib.llama.agent_build_cache), so nothing compiles llama.cpp again. The first
   build takes minutes, so it does not hold the suite back: it starts in the
   background (niced, its output in dist/testenv/llama-build.log) and Pants runs the tests that
   need no llama-server meanwhile. The tests that do depend on `//tools/llama:built`, a
   shell_command that waits for the build (the build's lock) and so runs them after it; the
   run-state of the build (LLMGW_LLAMA_BUILD_STATE) is in that command's environment, so a build
   started now is waited for even where Pants remembers an earlier wait. While it builds, Pants
   runs one more process than it has cores (PANTS_PROCESS_EXECUTION_LOCAL_PARALLELISM): that
   wait holds a slot and does no work. `./pants run release:build` builds every variant (another
   key in the same cache). Beside it, llama.cpp's Vulkan build for the tests that run it
   (`build-llama-server --vulkan`: the Vulkan module compiled alone, packed with the CPU build's
   files; release/llmgw_release/llamavulkan.py), started the same way when it is not cached
   (its output in dist/testenv/llama-vulkan-build.log; it waits for the CPU build's lock first),
   waited for by `//tools/llama:built-vulkan` (LLMGW_LLAMA_VULKAN_BUILD_STATE); 5 CPU-minutes.
3. As root, the Debian 12 root that the systemd test machines boot (tools/testenv/debian_root.py,
   made once by debootstrap, cached under ~/.cache/llmgw-machine): about a minute, once, while
   llama.cpp builds.

What it hands to `./pants` (variables for Pants' environment) it prints on stdout as
NAME=VALUE lines; everything it says goes to stderr.

Everything there: it says nothing and costs a few stat() calls, one
`build-llama-server --cached` (the compilers' `--version`, which key the cache, and the cached
server's) and one `build-llama-server --vulkan --cached` (glslc's too): 0.5 s measured. Whatever it does, it says what and why. It never lets a test turn into a skip: a
need it cannot meet stops `./pants test` with a message naming it and the fix.

Runs on CPython 3.9 (Pants' own interpreter) and later; the standard library only.
"""

from __future__ import annotations

import glob
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BUILD_LOG = ROOT / "dist" / "testenv" / "llama-build.log"
VULKAN_BUILD_LOG = ROOT / "dist" / "testenv" / "llama-vulkan-build.log"
BUILD_LLAMA = ROOT / "tools" / "llama" / "build-llama-server"
DEBIAN_ROOT = ROOT / "tools" / "testenv" / "debian_root.py"
NOT_BUILT = 3  # build-llama-server --cached / debian_root.py --cached: nothing in the cache
# Where the programs are looked for, beyond PATH: sbin is not on a user's PATH on Debian.
SYSTEM_DIRS = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")
APT_GET = "/usr/bin/apt-get"


@dataclass(frozen=True)
class Need:
    package: str  # the Debian package that provides it
    # Programs (looked up like commands) or absolute paths, all required; an absolute path may be a
    # glob pattern, for what Debian installs under a versioned directory (PostgreSQL's 15, 16, ...).
    provides: tuple[str, ...]
    why: str


NEEDS: tuple[Need, ...] = (
    Need("ca-certificates", ("/etc/ssl/certs/ca-certificates.crt",), "Pants and pip reach PyPI over HTTPS"),
    Need("git", ("git",), "llmgw version and the release build read the commit"),
    Need("curl", ("curl",), "fetches llama.cpp's source; node add's node fetches the release with it"),
    Need("cmake", ("cmake",), "builds llama.cpp"),
    Need("ninja-build", ("ninja",), "builds llama.cpp"),
    Need("g++", ("gcc", "g++"), "builds llama.cpp"),
    Need("binutils", ("readelf",), "checks what each built llama.cpp library needs (readelf -d)"),
    Need("python3", ("/usr/bin/python3",), "node add's test node runs the release on the system's python3"),
    Need("openssh-server", ("/usr/sbin/sshd",), "node add's tests log into a real sshd"),
    Need(
        "openssh-client",
        ("ssh-keygen", "ssh-keyscan", "ssh-agent", "ssh-add"),
        "the SSH tests make keys, scan host keys and log in with a key held only by an ssh-agent",
    ),
    Need("iproute2", ("ip",), "tests make network namespaces and veth pairs (ip netns)"),
    Need(
        "util-linux",
        ("unshare", "nsenter", "flock", "setpriv"),
        "the test node's own mounts; one llama build at a time; an ssh-agent run as another user",
    ),
    Need("procps", ("ps",), "process tools on the test node"),
    Need("passwd", ("useradd",), "node add's sudo test makes a login on its node"),
    Need("systemd", ("systemd-analyze",), "the systemd units node add writes and the docs show are verified"),
    Need("debootstrap", ("debootstrap",), "makes the Debian 12 root that the systemd test machines boot"),
    Need("systemd-container", ("systemd-nspawn",), "boots the test machines with systemd as their init"),
    Need("sudo", ("sudo",), "node add's test logs into its node as a user with passwordless sudo"),
    Need("tmux", ("tmux",), "node add's terminal screens are tested in a real tmux pane"),
    Need("cloud-init", ("cloud-init",), "llmgw-provision-node's user-data is checked by cloud-init's own schema"),
    Need("haproxy", ("haproxy",), "standalone gateways are tested behind a real HAProxy (docs/gateway.md)"),
    Need("wrk", ("wrk",), "the gateway benchmark's load generator (tools/bench/gateway.py), run by its smoke test"),
    # Driven over the DevTools protocol (tests/testlib/browser.py): no chromedriver needed.
    Need("chromium", ("chromium",), "the cluster page is tested in a real headless Chromium"),
    Need(
        "postgresql",
        ("/usr/lib/postgresql/*/bin/initdb", "/usr/lib/postgresql/*/bin/pg_ctl"),
        "the store's tests run against a real PostgreSQL cluster they make with initdb (tests/testlib/postgres.py)",
    ),
    Need("vulkan-tools", ("vulkaninfo",), "the agent finds Vulkan devices with vulkaninfo; a test runs the real one"),
    # llama.cpp's Vulkan build (release/llmgw_release/llamavulkan.py: its headers are a pinned .deb's).
    Need("glslc", ("glslc",), "compiles llama.cpp's Vulkan shaders into its Vulkan module"),
    Need(
        "libvulkan-dev",
        (f"/usr/lib/{platform.machine()}-linux-gnu/libvulkan.so",),
        "llama.cpp's Vulkan module links against the Vulkan loader",
    ),
    Need("spirv-headers", ("/usr/include/spirv/unified1/spirv.hpp",), "llama.cpp's Vulkan shader generator needs them"),
    Need(
        "mesa-vulkan-drivers",
        ("/usr/share/vulkan/icd.d/lvp_icd.*.json",),
        "lavapipe, Mesa's software Vulkan device, is the one the real vulkaninfo test finds",
    ),
    Need(
        "fonts-dejavu-core",
        ("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",),
        "the cluster page's screenshots need a font to draw its text",
    ),
)


@dataclass
class Machine:
    """The seam to the real system: tests give a fake one."""

    has: Callable[[str], bool]
    euid: Callable[[], int]
    run: Callable[[Sequence[str], dict], int]  # argv, extra environment -> exit status (output passes through)
    capture: Callable[[Sequence[str]], tuple[int, str]]  # argv -> exit status, stdout (stderr passes through)
    quiet: Callable[[Sequence[str]], int]  # argv -> exit status, all output discarded
    env: dict
    say: Callable[[str], None]
    # argv, extra environment, log -> pid: started in its own session, niced, output to the log
    spawn: Callable[[Sequence[str], dict, Path], int]
    export: Callable[[str, str], None]  # a variable for Pants' environment (./pants reads stdout)
    cores: Callable[[], int]


def _has(item: str) -> bool:
    if item.startswith("/"):
        return any(os.path.exists(p) for p in glob.glob(item)) if glob.has_magic(item) else os.path.exists(item)
    path = os.pathsep.join([os.environ.get("PATH", ""), *SYSTEM_DIRS])
    return shutil.which(item, path=path) is not None


def _run(argv: Sequence[str], env: dict) -> int:
    return subprocess.run(list(argv), env={**os.environ, **env}, check=False).returncode


def _capture(argv: Sequence[str]) -> tuple[int, str]:
    try:
        done = subprocess.run(list(argv), stdout=subprocess.PIPE, stderr=None, text=True, check=False)
    except OSError:
        return 127, ""
    return done.returncode, done.stdout


def _quiet(argv: Sequence[str]) -> int:
    try:
        return subprocess.run(list(argv), capture_output=True, check=False).returncode
    except OSError:
        return 127


# The background build's niceness: the tests that run meanwhile come first, the build takes
# what they leave (about a third of two cores while the suite runs, measured).
BUILD_NICENESS = 10


def _spawn(argv: Sequence[str], env: dict, log: Path) -> int:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:  # a second build started while one runs waits for its lock and adds to its log
        child = subprocess.Popen(
            list(argv),
            env={**os.environ, **env},
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C on ./pants does not lose a half-done build
            preexec_fn=lambda: os.nice(BUILD_NICENESS),
        )
    return child.pid


def handover() -> Callable[[str, str], None]:
    """The stdout `./pants` reads NAME=VALUE lines from, kept for those lines alone: from here
    on this process's stdout is its stderr, and so is every program's it runs. apt-get's
    progress ("Get:1 http://deb.debian.org/... InRelease") on the hand-over stopped
    `./pants test` on a machine missing packages, before a test ran."""
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    sys.stdout = sys.stderr  # a print in order with what the programs run say

    def export(name: str, value: str) -> None:
        print(f"{name}={value}", file=out, flush=True)

    return export


def real_machine(export: Callable[[str, str], None]) -> Machine:
    return Machine(
        has=_has,
        euid=os.geteuid,
        run=_run,
        capture=_capture,
        quiet=_quiet,
        env=dict(os.environ),
        say=lambda line: print(f"testenv: {line}", file=sys.stderr, flush=True),
        spawn=_spawn,
        export=export,
        cores=lambda: os.cpu_count() or 1,
    )


# -- decisions --------------------------------------------------------------------------------


def missing(needs: Sequence[Need], has: Callable[[str], bool]) -> list[tuple[Need, list[str]]]:
    """Each need with something absent, and what is absent."""
    out = []
    for need in needs:
        absent = [item for item in need.provides if not has(item)]
        if absent:
            out.append((need, absent))
    return out


def install_argv(packages: Sequence[str]) -> list[str]:
    # Another apt-get (or a second `./pants test`) holding the lock is waited for, not failed on.
    return ["apt-get", "install", "-y", "-q", "--no-install-recommends", "-o", "DPkg::Lock::Timeout=300", *packages]


def command_for_user(packages: Sequence[str], *, has_sudo: bool) -> str:
    """The one command a user who is not root runs to install `packages`."""
    install = f"apt-get install -y --no-install-recommends {' '.join(packages)}"
    if has_sudo:
        return f"sudo apt-get update && sudo {install}"
    return f"su -c 'apt-get update && {install}'"  # sudo itself is among the missing


# -- steps ------------------------------------------------------------------------------------


def ensure_packages(
    m: Machine, needs: Sequence[Need] = NEEDS, *, need: str = "the tests need", again: str = "./pants test"
) -> bool:
    """Every package of `needs` there, installed now as root; else says the one command and is False.

    `need` and `again` word the messages for whoever asks: the release build asks too
    (release/llmgw_release/provide.py), with its own needs."""
    gaps = missing(needs, m.has)
    if not gaps:
        return True
    packages = [gap.package for gap, _ in gaps]
    m.say(f"{need} {len(packages)} Debian package(s) this machine does not have:")
    for gap, absent in gaps:
        m.say(f"  {gap.package}: {gap.why} ({', '.join(absent)} missing)")
    if not m.has(APT_GET):
        m.say(f"this machine has no {APT_GET}: install those packages (or their equivalents) and run {again} again")
        return False
    if m.euid() != 0:
        m.say(f"installing them needs root; run this, then {again} again:")
        m.say(f"  {command_for_user(packages, has_sudo=m.has('sudo'))}")
        return False
    m.say(f"installing them: apt-get install {' '.join(packages)}")
    apt_env = {"DEBIAN_FRONTEND": "noninteractive"}
    if m.run(["apt-get", "update", "-q", "-o", "DPkg::Lock::Timeout=300"], apt_env) != 0:
        m.say(f"apt-get update failed (above); fix that and run {again} again")
        return False
    if m.run(install_argv(packages), apt_env) != 0:
        m.say(f"apt-get install {' '.join(packages)} failed (above); fix that and run {again} again")
        return False
    still = missing(needs, m.has)
    if still:
        for gap, absent in still:
            m.say(f"{gap.package} is installed but {', '.join(absent)} is still missing; {need} it: {gap.why}")
        return False
    return True


def _cached(m: Machine, tool: Sequence[str]) -> bool | None:
    """`tool --cached`: True if built, None if not yet, False if it cannot be told (said)."""
    status, _ = m.capture([*tool, "--cached"])
    if status == 0:
        return True
    if status != NOT_BUILT:
        m.say(f"{' '.join(tool)} --cached failed with status {status}")
        return False
    return None


def _jobs(m: Machine) -> str:
    return m.env.get("LLAMA_BUILD_JOBS") or str(m.cores() + 1)  # niced: the extra job fills the idle moments


def start_llama_build(m: Machine, build: Path = BUILD_LLAMA, log: Path = BUILD_LOG) -> bool | None:
    """True if llama.cpp is built, None if a build was started in the background now (the tests
    that need it wait for it: //tools/llama:built), False if it cannot be told."""
    tool = [sys.executable, "-I", str(build)]
    cached = _cached(m, tool)
    if cached is not None:
        return cached
    jobs = _jobs(m)
    pid = m.spawn(tool, {"LLAMA_BUILD_JOBS": jobs}, log)
    m.say(
        "llama.cpp is not built yet: the release test ships it, and the llama.cpp engine tests, node "
        "add's test nodes and the agent's source-build test run its llama-server. Building it once, as "
        f"the release ships it but with only the CPU variants this machine loads, from llama.cpp's source, in "
        f"the background with {jobs} jobs (pid {pid}; 19 minutes beside the suite on 2 cores; LLAMA_BUILD_JOBS=N sets the "
        "jobs): its output goes "
        f"to {log.relative_to(ROOT) if log.is_relative_to(ROOT) else log}. The tests that need no llama-server "
        "run meanwhile; the others wait for it (//tools/llama:built), and fail with the build's error if it fails"
    )
    m.export("LLMGW_LLAMA_BUILD_STATE", f"building:{pid}")
    return None


def start_vulkan_build(m: Machine, build: Path = BUILD_LLAMA, log: Path = VULKAN_BUILD_LOG) -> bool | None:
    """The same for llama.cpp's Vulkan build (build-llama-server --vulkan: the CPU build's files and
    libggml-vulkan.so), which //tools/llama:built-vulkan waits for. Started beside the CPU build,
    it waits for that build's lock first (it takes the CPU archive's files), then compiles the
    Vulkan module alone."""
    tool = [sys.executable, "-I", str(build), "--vulkan"]
    cached = _cached(m, tool)
    if cached is not None:
        return cached
    jobs = _jobs(m)
    pid = m.spawn(tool, {"LLAMA_BUILD_JOBS": jobs}, log)
    m.say(
        "llama.cpp's Vulkan build is not there yet: the Vulkan engine test runs it on lavapipe. Building its "
        f"Vulkan module once, after the CPU build, in the background with {jobs} jobs (pid {pid}; measured 5 "
        "CPU-minutes for the shaders and the module, 7 minutes niced on 2 busy cores): its output goes to "
        f"{log.relative_to(ROOT) if log.is_relative_to(ROOT) else log}. That test waits for it "
        "(//tools/llama:built-vulkan)"
    )
    m.export("LLMGW_LLAMA_VULKAN_BUILD_STATE", f"building:{pid}")
    return None


def check_llama_server_variable(m: Machine) -> bool:
    given = m.env.get("LLMGW_LLAMA_SERVER", "")
    if given and m.quiet([given, "--version"]) != 0:
        m.say(
            f"LLMGW_LLAMA_SERVER={given} does not run (`{given} --version` fails); fix it, or unset it to use the cached build"
        )
        return False
    return True


def _ensure_built(m: Machine, tool: Sequence[str], announce: str, doing: str) -> bool:
    """`tool --cached` says whether it is built (status NOT_BUILT: not yet); if not, `tool` builds it."""
    status, _ = m.capture([*tool, "--cached"])
    if status == 0:
        return True
    if status != NOT_BUILT:
        m.say(f"{' '.join(tool)} --cached failed with status {status}")
        return False
    script = Path(tool[-1])
    m.say(f"{announce}: {script.relative_to(ROOT) if script.is_relative_to(ROOT) else script}")
    status, _ = m.capture(list(tool))
    if status != 0:
        m.say(f"{doing} failed (above); fix that and run ./pants test again")
        return False
    return True


def ensure_debian_root(m: Machine, script: Path = DEBIAN_ROOT) -> bool:
    if m.euid() != 0:
        return True  # debootstrap needs root; prepare() says which tests need it
    return _ensure_built(
        m,
        [str(script)],
        "the systemd test machines' Debian 12 root is not built yet: node add's systemd tests and the "
        "provisioning tests boot it. Making it once with debootstrap from Debian's packages (about a minute)",
        "building the test machines' Debian root",
    )


def prepare(m: Machine, build: Path = BUILD_LLAMA, debian: Path = DEBIAN_ROOT) -> int:
    if not ensure_packages(m):
        return 1
    built = start_llama_build(m, build)
    if built is False:
        return 1
    if built:
        m.export("LLMGW_LLAMA_BUILD_STATE", "built")
    vulkan = start_vulkan_build(m, build)
    if vulkan is False:
        return 1
    if vulkan:
        m.export("LLMGW_LLAMA_VULKAN_BUILD_STATE", "built")
    started = [b for b in (built, vulkan) if b is None]
    if started:  # each wait for a build holds a slot and does no work
        m.export("PANTS_PROCESS_EXECUTION_LOCAL_PARALLELISM", str(m.cores() + len(started)))
    if not check_llama_server_variable(m):
        return 1
    if not ensure_debian_root(m, debian):  # while llama.cpp builds, if it does
        return 1
    if m.euid() != 0:
        m.say(
            "not root: the tests that make network namespaces or boot test machines (node add end to end, "
            "the gateway's silent-peer tests, the systemd node) need root and will fail saying so; run the "
            "suite as root to run all of it"
        )
    return 0


def main() -> int:
    return prepare(real_machine(handover()))


if __name__ == "__main__":
    sys.exit(main())
