"""The release artifacts, built the way `./pants run release:build` builds them, then run for real.

The build runs twice into separate directories (the second from the wheel cache the first one
filled, so only a cold cache needs the network) and must give the same bytes. The amd64 artifact
runs under each of pyenv's CPython 3.10-3.13; the arm64 one is inspected: every ELF object in it
must be aarch64. Every run unpacks under this test's temporary directories (SHIV_ROOT), never
under the user's cache.

llama.cpp's archive ships for this machine's architecture only: the one `./pants test` built
into the llama.cpp cache before the tests (tools/testenv/prepare.py), which the build takes from
there, not compiling it again (arm64's is cross-compiled and run under qemu-user by
`./pants run release:build` itself, outside the suite's time budget: docs/development.md).

To check another command under every Python, add one line to COMMANDS (a command that prints
and exits) or SERVICES (a command that serves HTTP until SIGTERM).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import platform
import shutil
import signal
import struct
import subprocess
import tarfile
import time
import urllib.error
import urllib.request
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs
import pytest
from llmgw_release import build, llamabuild, llamacpp, llamasmoke, wheels

import llmgw
from llmgw import llamarecipe
from testlib import llama, llamavulkan
from testlib.ports import free_port
from testlib.proc import build_root
from testlib.pythons import find_python, find_python39
from testlib.tinygguf import write_tiny_llama

VERSION = "0.0.0-test"
COMMIT = "0123456789ab"
EPOCH = 1795965623  # 2026-11-29T15:20:23Z
MINORS = (10, 11, 12, 13)
RUN_TIMEOUT_S = 60
READY_DEADLINE_S = 30
POLL_S = 0.1
E_MACHINE = {"x86_64": 0x3E, "aarch64": 0xB7}

# One gateway worker (the default, one a core, is two here: each another start of the artifact,
# about 0.7 CPU-s, which tells nothing more about the Python it runs under).
SERVER_TOML = """\
[server]
state_dir = "{tmp}/state"
agent_listen = "127.0.0.1:0"
http_listen = "127.0.0.1:0"
advertise = ["127.0.0.1"]
gateway_workers = 1
"""


# -- building --------------------------------------------------------------------------------


def release_inputs(model: Path) -> build.Inputs:
    root = build_root()
    requirements = root / "3rdparty" / "python" / "requirements.txt"
    lock = root / "3rdparty" / "python" / "default.lock"
    if not requirements.is_file() or not lock.is_file():
        pytest.fail(
            f"{requirements} and {lock} are not here. Under Pants the test needs them as files: "
            'add `files(name="release-inputs", sources=["requirements.txt", "default.lock"])` to '
            '3rdparty/python/BUILD and "3rdparty/python:release-inputs" to tests/release/BUILD\'s dependencies.'
        )
    return build.Inputs(
        version=VERSION,
        commit=COMMIT,
        source_date_epoch=EPOCH,
        src_root=Path(llmgw.__file__).parent.parent,
        requirements_txt=requirements,
        lockfile=lock,
        wheel_cache=wheels.default_cache(),
        provision_tool=root / "tools" / "provision" / build.PROVISION_TOOL,
        llama_cache=llama.cache_root(),
        llama_arches=(HOST,),
        llama_this_cpu=True,  # the build `./pants test` made (the release's own carries every variant)
        llama_smoke_model=model,
    )


HOST = llamarecipe.host_arch(platform.machine())


@attrs.frozen
class Release:
    out: Path
    again: Path  # the same inputs built a second time
    model: Path  # the tiny GGUF the build ran llama.cpp on
    said: tuple[str, ...]  # the first build's progress lines

    def artifact(self, arch: str) -> Path:
        return self.out / build.artifact_name(VERSION, arch)

    @property
    def llama(self) -> Path:
        return self.out / llamacpp.archive_name(llamabuild.pinned_source(), HOST)

    @property
    def vulkan(self) -> Path:
        return self.out / llamacpp.archive_name(llamabuild.pinned_source(), HOST, llamarecipe.VULKAN)


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> Release:
    model = write_tiny_llama(tmp_path_factory.mktemp("model") / "tiny.gguf", seed=1)
    inputs = release_inputs(model)
    first, second = tmp_path_factory.mktemp("release"), tmp_path_factory.mktemp("release-again")
    said: list[str] = []
    build.build_release(inputs, first, progress=said.append)
    build.build_release(inputs, second, progress=lambda _: None)
    return Release(out=first, again=second, model=model, said=tuple(said))


def names(artifact: Path) -> set[str]:
    with zipfile.ZipFile(artifact) as z:
        return set(z.namelist())


def heads(artifact: Path, size: int) -> dict[str, bytes]:
    """Each member's first `size` bytes: only so much of each is decompressed (the whole
    artifact is 19 MB of deflate, about a CPU-second to read)."""
    with zipfile.ZipFile(artifact) as z:
        out = {}
        for name in z.namelist():
            with z.open(name) as member:
                out[name] = member.read(size)
        return out


# -- the files -------------------------------------------------------------------------------


def test_sha256sums_lists_every_artifact_and_verifies(release: Release) -> None:
    lines = (release.out / "SHA256SUMS").read_text().splitlines()
    files = [release.llama, release.vulkan, release.artifact("amd64"), release.artifact("arm64")]
    files.append(release.out / build.PROVISION_TOOL)
    expected = [f"{hashlib.sha256(path.read_bytes()).hexdigest()}  {path.name}" for path in sorted(files)]
    assert lines == expected
    # What docs/install.md tells the operator to run.
    done = subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=release.out, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_proxmox_tool_ships_beside_the_zipapps_saying_the_release_version(release: Release) -> None:
    shipped = release.out / build.PROVISION_TOOL
    assert shipped.stat().st_mode & 0o777 == 0o755
    source = (build_root() / "tools" / "provision" / build.PROVISION_TOOL).read_text()
    assert shipped.read_text() == source.replace('__version__ = "dev"', f'__version__ = "{VERSION}"')
    done = subprocess.run(
        [str(shipped), "--version"], capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False
    )
    assert done.returncode == 0 and done.stdout.strip() == f"llmgw-provision-node {VERSION}", done.stdout + done.stderr


def test_two_builds_of_one_commit_are_byte_identical(release: Release) -> None:
    names = sorted(p.name for p in release.out.iterdir())
    assert names == sorted(p.name for p in release.again.iterdir())
    for name in names:
        assert (release.out / name).read_bytes() == (release.again / name).read_bytes(), name


@pytest.mark.parametrize("arch", ["amd64", "arm64"])
def test_every_minor_has_its_compiled_modules_and_conditional_dependencies(release: Release, arch: str) -> None:
    shipped = names(release.artifact(arch))
    machine = wheels.MACHINES[arch]
    for minor in MINORS:
        for module in ("_cffi_backend", "greenlet/_greenlet"):
            assert f"site-packages/{module}.cpython-3{minor}-{machine}-linux-gnu.so" in shipped
    assert "site-packages/cryptography/hazmat/bindings/_rust.abi3.so" in shipped
    # Needed below 3.11 only, shipped to all: one artifact serves every minor.
    assert "site-packages/tomli/__init__.py" in shipped
    assert "site-packages/exceptiongroup/__init__.py" in shipped
    # The runtime only: no test or build tools.
    tops = {n.split("/")[1] for n in shipped if n.startswith("site-packages/")}
    assert not tops & {"pytest", "_pytest", "ruff", "shiv", "pip", "click", "setuptools"}
    clients = {"openai", "langchain_openai", "langchain_core", "litellm", "pydantic", "httpx2"}  # tests' only
    assert not tops & clients


def elf_machine(data: bytes) -> int | None:
    if not data.startswith(b"\x7fELF") or len(data) < 20:
        return None
    endian = "<" if data[5] == 1 else ">"  # EI_DATA: 1 little-endian, 2 big-endian
    return struct.unpack(f"{endian}H", data[18:20])[0]  # e_machine


def test_the_cluster_page_is_package_data_in_the_artifact(release: Release) -> None:
    shipped = names(release.artifact("amd64"))
    files = ("index.html", "app.js", "render.js", "nodelist.js", "plots.js", "style.css")
    page = {f"site-packages/llmgw/page/{n}" for n in files}
    assert page <= shipped, sorted(page - shipped)


@pytest.mark.parametrize("arch", ["amd64", "arm64"])
def test_every_elf_object_is_for_the_target_machine(release: Release, arch: str) -> None:
    machines = {name: elf_machine(data) for name, data in heads(release.artifact(arch), 20).items()}
    elves = {name: m for name, m in machines.items() if m is not None}
    assert len(elves) >= 10, sorted(elves)
    wrong = {name: hex(m) for name, m in elves.items() if m != E_MACHINE[wheels.MACHINES[arch]]}
    assert not wrong, f"{arch} artifact holds objects for other machines: {wrong}"


# -- llama.cpp -------------------------------------------------------------------------------


def test_llama_cpp_is_the_cached_archive_not_a_new_build(release: Release) -> None:
    cached = llamabuild.archive_path(llama.cache_root(), llama.portable_recipe())
    assert release.llama.read_bytes() == cached.read_bytes()
    assert not any(line.startswith("building llama.cpp") for line in release.said), release.said
    [line] = [line for line in release.said if line.startswith(f"{release.llama}: ")]
    assert "from the cache" in line and "ran: version: " in line and "CPU backend " in line, line


def test_the_vulkan_build_is_the_cached_one_the_cpu_archives_files_and_the_vulkan_module(
    release: Release, tmp_path: Path
) -> None:
    assert release.vulkan.read_bytes() == llamavulkan.vulkan_archive().read_bytes()
    [line] = [line for line in release.said if line.startswith(f"{release.vulkan}: ")]
    assert "from the cache" in line and "ran: version: " in line, line
    source = llamabuild.pinned_source()
    cpu_top, top = llamarecipe.top_dir(source, HOST), llamarecipe.backend_top_dir(source, HOST, llamarecipe.VULKAN)
    with tarfile.open(release.llama) as tar:
        cpu = [i.name.removeprefix(cpu_top) for i in tar.getmembers()]
    with tarfile.open(release.vulkan) as tar:
        infos = tar.getmembers()
    assert sorted([i.name.removeprefix(top) for i in infos]) == sorted([*cpu, f"/{llamarecipe.VULKAN_MODULE}"])
    directory = llamabuild.unpack(release.vulkan, top, tmp_path / "x")
    module = directory / llamarecipe.VULKAN_MODULE
    done = subprocess.run(["readelf", "-d", "-W", str(module)], capture_output=True, text=True, check=True)
    dynamic = llamacpp.dynamic_section(done.stdout)
    assert dynamic["RUNPATH"] == ["$ORIGIN"] and dynamic["RPATH"] == [], dynamic
    outside = set(dynamic["NEEDED"]) - {p.name for p in directory.iterdir()}
    assert outside <= {"libc.so.6", "libm.so.6", "libstdc++.so.6", "libgcc_s.so.1", "libvulkan.so.1"}, outside
    assert "libvulkan.so.1" in outside


def test_llama_cpp_is_one_directory_of_the_server_its_libraries_and_its_cpu_variants(release: Release) -> None:
    top = llamarecipe.top_dir(llamabuild.pinned_source(), HOST)
    with tarfile.open(release.llama) as tar:
        infos = tar.getmembers()
    assert infos[0].name == top and infos[0].isdir()
    names = [i.name.removeprefix(f"{top}/") for i in infos[1:]]
    assert all(i.name.startswith(f"{top}/") and (i.isfile() or i.issym()) for i in infos[1:])
    assert all("/" not in n for n in names) and names == sorted(names)
    assert {"llama-server", "LICENSE", "libllama.so", "libggml-base.so", "libggml.so"} <= set(names), names
    assert {"ggml-rpc-server", "libggml-rpc.so"} <= set(names), names  # one model over several nodes
    assert all(i.mode == 0o755 for i in infos if i.name.endswith(("/llama-server", "/ggml-rpc-server"))), infos
    # The suite's build carries this CPU's variants (the baseline and the one it loads); the
    # release's every one, which its build checks as it packs (llamacpp.check_members, against
    # llamarecipe.expected_variants: test_llamarecipe, test_llamacpp).
    variants = llamarecipe.cpu_variants(names)
    assert variants == llamarecipe.expected_variants(llama.portable_recipe()), variants
    assert llamarecipe.VARIANTS[HOST][0][0] in variants
    assert set(variants) <= set(llamarecipe.expected_variants(llama.release_recipe()))
    assert {(i.uid, i.gid, i.mtime) for i in infos} == {(0, 0, infos[0].mtime)}


def test_every_llama_cpp_object_finds_its_libraries_beside_it_and_needs_only_the_c_runtime(
    release: Release, tmp_path: Path
) -> None:
    directory = llamabuild.unpack(release.llama, llamarecipe.top_dir(llamabuild.pinned_source(), HOST), tmp_path / "x")
    elves = [p for p in sorted(directory.iterdir()) if not p.is_symlink() and p.name != "LICENSE"]
    # llama-server, libllama, libggml, libggml-base, ... and one library per CPU variant it carries.
    assert len(elves) >= 5 + len(llamarecipe.expected_variants(llama.portable_recipe())), elves
    for path in elves:
        done = subprocess.run(["readelf", "-d", "-W", str(path)], capture_output=True, text=True, check=True)
        dynamic = llamacpp.dynamic_section(done.stdout)
        assert dynamic["RUNPATH"] == ["$ORIGIN"] and dynamic["RPATH"] == [], (path.name, dynamic)
        outside = set(dynamic["NEEDED"]) - {p.name for p in directory.iterdir()}
        assert outside <= {"libc.so.6", "libm.so.6", "libstdc++.so.6", "libgcc_s.so.1", "ld-linux-x86-64.so.2",
                           "ld-linux-aarch64.so.1"}, (path.name, outside)  # fmt: skip


def test_llama_server_runs_from_anywhere_and_answers_with_a_cpu_backend_it_ships(release: Release) -> None:
    source = llamabuild.pinned_source()
    smoked = llamasmoke.smoke(release.llama, source, HOST, model=release.model)
    assert (
        smoked.version.startswith("version: ")
        and f"(build {source.build_number}, commit {source.version})" in smoked.version
    )
    with tarfile.open(release.llama) as tar:
        assert smoked.backend in llamarecipe.cpu_variants(Path(n).name for n in tar.getnames())


# -- running it under every Python -----------------------------------------------------------


@pytest.fixture(scope="module")
def shiv_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("unpacked")


def artifact_env(root: Path, **extra: str) -> dict[str, str]:
    """The environment an operator's shell would give it: no PYTHONPATH (this test's own, which
    would put the checkout's llmgw first), no PEX or shiv settings; SHIV_ROOT under the test's tmp."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PEX", "SHIV_"))}
    return {**env, "SHIV_ROOT": str(root), **extra}


def run(python: Path, artifact: Path, args: Sequence[str], root: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(python), str(artifact), *args],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        env=artifact_env(root, **env),
        check=False,
    )


def expect_version(done: subprocess.CompletedProcess, minor: int) -> None:
    info = json.loads(done.stdout)
    assert info["version"] == VERSION
    assert info["commit"] == COMMIT
    assert info["build_date"] == "2026-11-29T15:20:23Z"
    assert info["build_target"] == "linux-amd64"
    assert info["architecture"] == "x86_64"
    assert info["python"].startswith(f"3.{minor}.")


def expect_help(done: subprocess.CompletedProcess, minor: int) -> None:
    assert done.stdout.startswith("usage: llmgw")
    assert "config" in done.stdout and "version" in done.stdout


def expect_ok(done: subprocess.CompletedProcess, minor: int) -> None:
    assert done.stdout.strip().endswith("ok (server configuration)")


def expect_json(done: subprocess.CompletedProcess, minor: int) -> None:
    json.loads(done.stdout)


IMPORT_COMPILED = (
    "import sys, _cffi_backend, greenlet, cryptography.hazmat.bindings._rust, wcwidth, trio_asyncio, asyncssh, urwid\n"
    "import psycopg\n"  # the PostgreSQL store's driver, with the libpq psycopg-binary carries
    "assert psycopg.pq.__impl__ == 'binary' and psycopg.pq.version() >= 140000, psycopg.pq.__impl__\n"
    "from cryptography.hazmat.primitives.asymmetric import ec\n"
    "ec.generate_private_key(ec.SECP256R1())\n"
    "if sys.version_info < (3, 11):\n"
    "    import tomli, exceptiongroup\n"
    "print(_cffi_backend.__file__)\n"
)


def expect_own_cffi(done: subprocess.CompletedProcess, minor: int) -> None:
    assert f"_cffi_backend.cpython-3{minor}-x86_64-linux-gnu.so" in done.stdout


def expect_doctor(done: subprocess.CompletedProcess, minor: int) -> None:
    report = json.loads(done.stdout)
    names = {c["name"] for c in report["checks"]}
    assert {"cpu-features", "python", "nvidia-smi", "fabrics"} <= names, names
    python = next(c for c in report["checks"] if c["name"] == "python")
    assert f"3.{minor}." in python["detail"], python


@attrs.frozen
class Command:
    """A command the artifact runs to completion, exiting with one of `statuses`; `{tmp}` in
    `args` is a fresh directory holding `server.toml`."""

    args: tuple[str, ...]
    expect: Callable[[subprocess.CompletedProcess, int], None]
    env: tuple[tuple[str, str], ...] = ()
    statuses: tuple[int, ...] = (0,)


COMMANDS = {
    "version --json": Command(("version", "--json"), expect_version),
    "--help": Command(("--help",), expect_help),
    "config check": Command(("config", "check", "{tmp}/server.toml"), expect_ok),
    # shiv's interpreter mode: every compiled module loads on this minor.
    "imports": Command(("-c", IMPORT_COMPILED), expect_own_cffi, env=(("SHIV_INTERPRETER", "1"),)),
    # Exit 1 where the clock is unsynchronised (this machine): a warning, not a failure.
    "doctor --json": Command(("doctor", "--json"), expect_doctor, statuses=(0, 1)),
}


@attrs.frozen
class Service:
    """A command that serves HTTP until SIGTERM: after `setup`, it must answer `method` on each
    of `paths` (with `body`, as JSON) with 200, and exit 0 on SIGTERM.

    It says where it listens either in a file (`url_file`, holding a base URL) or on a port the
    test chose (`url`, with `{port}`).
    """

    args: tuple[str, ...]
    paths: tuple[str, ...]
    setup: tuple[tuple[str, ...], ...] = ()
    url_file: str | None = None
    url: str | None = None
    method: str = "GET"
    body: bytes | None = None


SERVICES = {
    "server": Service(
        ("server", "--config", "{tmp}/server.toml"),
        (
            "/metrics",  # the gateway worker's families and, through the relay, the control plane's
            "/page/app.js",  # the cluster page's files are package data: served from inside the artifact
        ),
        setup=(("ca", "init", "--config", "{tmp}/server.toml"),),
        url_file="{tmp}/state/admin.url",
    ),
    "engine sim": Service(
        ("engine", "sim", "--model", "tiny", "--port", "{port}"),
        ("/v1/completions",),
        url="http://127.0.0.1:{port}",
        method="POST",
        body=b'{"model": "tiny", "prompt": "hello", "max_tokens": 4}',
    ),
}


def fill(template: str, tmp: Path, port: int) -> str:
    return template.replace("{tmp}", str(tmp)).replace("{port}", str(port))


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    (tmp_path / "server.toml").write_text(SERVER_TOML.format(tmp=tmp_path))
    return tmp_path


@pytest.mark.parametrize("minor", MINORS, ids=lambda m: f"3.{m}")
@pytest.mark.parametrize("name", list(COMMANDS))
def test_command_runs_under_every_python(
    release: Release, shiv_root: Path, workdir: Path, name: str, minor: int
) -> None:
    command = COMMANDS[name]
    args = [fill(a, workdir, 0) for a in command.args]
    done = run(find_python(minor), release.artifact("amd64"), args, shiv_root, **dict(command.env))
    assert (
        done.returncode in command.statuses
    ), f"llmgw {' '.join(args)} on 3.{minor}: exit {done.returncode}\n{done.stderr}"
    command.expect(done, minor)


@pytest.mark.parametrize("minor", MINORS, ids=lambda m: f"3.{m}")
@pytest.mark.parametrize("name", list(SERVICES))
def test_service_answers_under_every_python(
    release: Release, shiv_root: Path, workdir: Path, name: str, minor: int
) -> None:
    service, python, artifact = SERVICES[name], find_python(minor), release.artifact("amd64")
    port = free_port()
    for step in service.setup:
        done = run(python, artifact, [fill(a, workdir, port) for a in step], shiv_root)
        assert done.returncode == 0, f"llmgw {' '.join(step)}: exit {done.returncode}\n{done.stderr}"
    log = (workdir / "service.log").open("wb")
    proc = subprocess.Popen(
        [str(python), str(artifact), *(fill(a, workdir, port) for a in service.args)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=artifact_env(shiv_root),
    )
    try:
        base = wait_for_url(service, workdir, port, proc)
        headers = {"Content-Type": "application/json"} if service.body is not None else {}
        for path in service.paths:
            request = urllib.request.Request(base + path, data=service.body, headers=headers, method=service.method)
            with urllib.request.urlopen(request, timeout=10) as response:
                assert response.status == 200, path
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            status = proc.wait(timeout=RUN_TIMEOUT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
            log.close()
    assert status == 0, (workdir / "service.log").read_text()


def wait_for_url(service: Service, tmp: Path, port: int, proc: subprocess.Popen) -> str:
    deadline = time.monotonic() + READY_DEADLINE_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"exited {proc.returncode} before answering:\n{(tmp / 'service.log').read_text()}")
        if service.url_file is not None:
            url_file = Path(fill(service.url_file, tmp, port))
            if url_file.is_file() and url_file.read_text().strip():
                return url_file.read_text().strip()
        elif service.url is not None:
            try:
                with urllib.request.urlopen(fill(service.url, tmp, port), timeout=1):
                    pass
                return fill(service.url, tmp, port)
            except urllib.error.HTTPError:
                return fill(service.url, tmp, port)  # it answers; the status is the test's business
            except OSError:
                pass
        time.sleep(POLL_S)
    pytest.fail(f"not answering after {READY_DEADLINE_S}s:\n{(tmp / 'service.log').read_text()}")


def test_a_python_it_was_not_built_for_gets_a_message(release: Release, tmp_path: Path) -> None:
    done = run(find_python39(), release.artifact("amd64"), ["version"], tmp_path)
    assert done.returncode == 70
    assert "llmgw needs CPython 3.10 to 3.13; this is Python 3.9." in done.stderr
    assert not list(tmp_path.iterdir()), "nothing may be unpacked for a Python that cannot run it"


def test_an_artifact_for_another_machine_gets_a_message(release: Release, tmp_path: Path) -> None:
    other = "arm64" if platform.machine() == "x86_64" else "amd64"
    done = run(find_python(11), release.artifact(other), ["version"], tmp_path)
    assert done.returncode == 70
    assert f"this llmgw is built for {wheels.MACHINES[other]}, but this machine is {platform.machine()}" in done.stderr


# -- where it unpacks ------------------------------------------------------------------------


def unpacked(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if not p.name.startswith("."))


def test_older_unpacked_versions_are_removed_unless_in_use(release: Release, tmp_path: Path) -> None:
    """Copies of one artifact under other names unpack to other directories, as other versions do."""
    python, root = find_python(11), tmp_path / "root"
    copies = {}
    for name in ("a", "b", "c"):
        copies[name] = tmp_path / f"llmgw-{name}.pyz"
        shutil.copyfile(release.artifact("amd64"), copies[name])
    foreign = root / "someone-else.pyz_0123456789abcdef"  # another shiv app sharing a SHIV_ROOT
    foreign.mkdir(parents=True)

    def start(name: str) -> None:
        done = run(python, copies[name], ["version"], root)
        assert done.returncode == 0, done.stderr

    start("a")
    (dir_a,) = (n for n in unpacked(root) if n.startswith("llmgw-a.pyz_"))
    assert dir_a.endswith(f"_llmgw-{VERSION}-" + dir_a.rsplit("-", 1)[-1])  # the versioned build id
    start("b")
    (dir_b,) = (n for n in unpacked(root) if n.startswith("llmgw-b.pyz_"))
    assert unpacked(root) == [dir_b, foreign.name]
    assert not (root / f".{dir_a}_lock").exists()

    # A process still running b (an agent not yet restarted after an upgrade) keeps b's files.
    held = os.open(root / dir_b, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(held, fcntl.LOCK_SH)
        start("c")
        (dir_c,) = (n for n in unpacked(root) if n.startswith("llmgw-c.pyz_"))
        assert unpacked(root) == [dir_b, dir_c, foreign.name]
    finally:
        os.close(held)
    start("c")
    assert unpacked(root) == [dir_c, foreign.name]
