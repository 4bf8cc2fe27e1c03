"""Running a portable llama.cpp archive where it was built: the release's smoke test.

`smoke` unpacks the archive into a temporary directory and runs its llama-server from another
directory with no LD_LIBRARY_PATH (so `$ORIGIN` alone must find the libraries): `--version`,
then, given a GGUF model, one completion of a fixed number of tokens over HTTP on 127.0.0.1,
noting which CPU backend it loaded. A foreign architecture runs under qemu-user: Debian's
qemu-user-static, with that architecture's C library and C++ runtime from the cross packages
(`QEMU_LD_PREFIX=/usr/<triplet>`; libc6-<arch>-cross, and libstdc++6-<arch>-cross that the cross
compiler brings).

Standard library only, CPython 3.9+ (see llmgw.llamarecipe).
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from llmgw import llamarecipe
from llmgw.llamarecipe import Source
from llmgw_release.llamabuild import LlamaBuildError, check_tools, run_env, this_host, unpack

SMOKE_TIMEOUT_S = 300  # under qemu, loading and 8 tokens take seconds; a loaded machine more
SMOKE_TOKENS = 8
TAIL_LINES = 30


class SmokeError(LlamaBuildError):
    """The built llama.cpp does not run, or does not answer; the message has its output."""


def smoke_needs(arch: str, host: str) -> dict[str, str]:
    """What running `arch`'s build on this machine needs: path or program -> Debian package."""
    if arch == host:
        return {}
    triplet = llamarecipe.TRIPLETS[arch]
    loader = {"arm64": "lib/ld-linux-aarch64.so.1", "amd64": "lib64/ld-linux-x86-64.so.2"}[arch]
    return {
        f"qemu-{llamarecipe.MACHINES[arch]}-static": "qemu-user-static",
        f"/usr/{triplet}/{loader}": f"libc6-{arch}-cross",
    }


@dataclass(frozen=True)
class Smoked:
    version: str  # `--version`'s first line
    backend: str  # the CPU variant llama-server loaded ("" without a model)
    completion: str  # what it wrote ("" without a model)


def runner(arch: str, host: str) -> tuple[list[str], dict[str, str]]:
    """The command prefix and environment that run `arch`'s programs on a `host` machine."""
    if arch == host:
        return [], {}
    check_tools(smoke_needs(arch, host), f"running llama.cpp for {arch} on this {host} machine")
    return [f"qemu-{llamarecipe.MACHINES[arch]}-static"], {"QEMU_LD_PREFIX": f"/usr/{llamarecipe.TRIPLETS[arch]}"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def smoke(
    archive: Path,
    source: Source,
    arch: str,
    *,
    model: Path | None,
    host: str | None = None,
    timeout: float = SMOKE_TIMEOUT_S,
    top: str | None = None,
) -> Smoked:
    """Unpack `archive` and run its llama-server: `--version`, then (with `model`) one completion.
    `top`: the archive's directory, where it is not the CPU archive's (the Vulkan archive's)."""
    prefix, extra = runner(arch, host or this_host())
    with tempfile.TemporaryDirectory(prefix="llmgw-llama-smoke-") as tmp:
        directory = unpack(archive, top or llamarecipe.top_dir(source, arch), Path(tmp) / "unpacked")
        server = [*prefix, str(directory / llamarecipe.SERVER)]
        env = run_env(extra)
        elsewhere = Path(tmp) / "elsewhere"  # not the archive's directory: $ORIGIN must find the libraries
        elsewhere.mkdir()
        try:
            done = subprocess.run(
                [*server, "--version"], capture_output=True, text=True, cwd=elsewhere, env=env, timeout=timeout
            )
        except subprocess.TimeoutExpired:
            raise SmokeError(f"{archive.name}: llama-server --version did not finish in {timeout:.0f} s") from None
        text = done.stdout + done.stderr
        expected = f"(build {source.build_number}, commit {source.version})"  # LLAMA_BUILD_NUMBER, _COMMIT
        if done.returncode != 0 or expected not in text:
            raise SmokeError(
                f"{archive.name}: `llama-server --version` exited {done.returncode} without {expected!r}:\n"
                + text[-2000:]
            )
        version = next(line for line in text.splitlines() if line.startswith("version:"))
        if model is None:
            return Smoked(version=version, backend="", completion="")
        return _complete(archive, server, env, elsewhere, model, version, timeout)


_LOADED = re.compile(r"loaded CPU backend from \S*libggml-cpu-([A-Za-z0-9_.]+)\.so")


def _complete(
    archive: Path, server: list[str], env: dict[str, str], cwd: Path, model: Path, version: str, timeout: float
) -> Smoked:
    port = _free_port()
    log = cwd / "server.log"
    args = ["-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-c", "512", "-np", "1", "-t", "2"]
    args += ["-lv", "4"]  # the verbosity at which it says which CPU backend it loaded
    with log.open("wb") as out:
        proc = subprocess.Popen([*server, *args, "--no-webui"], stdout=out, stderr=subprocess.STDOUT, cwd=cwd, env=env)
    try:
        deadline = time.monotonic() + timeout
        base = f"http://127.0.0.1:{port}"
        while True:
            if proc.poll() is not None:
                raise SmokeError(
                    f"{archive.name}: llama-server exited {proc.returncode} before it was ready:\n{_tail(log)}"
                )
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except (OSError, urllib.error.URLError):
                pass
            if time.monotonic() > deadline:
                raise SmokeError(f"{archive.name}: llama-server not ready after {timeout:.0f} s:\n{_tail(log)}")
            time.sleep(0.2)
        body = {"prompt": "hello", "n_predict": SMOKE_TOKENS, "ignore_eos": True, "temperature": 0}
        request = urllib.request.Request(
            f"{base}/completion", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=max(1.0, deadline - time.monotonic())) as response:
                answer = json.load(response)
        except (OSError, urllib.error.URLError, ValueError) as exc:
            raise SmokeError(f"{archive.name}: the completion failed: {exc}\n{_tail(log)}") from None
        if answer.get("tokens_predicted") != SMOKE_TOKENS or not isinstance(answer.get("content"), str):
            raise SmokeError(f"{archive.name}: asked for {SMOKE_TOKENS} tokens, got {answer}")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    loaded = _LOADED.search(log.read_text(errors="replace"))
    return Smoked(version=version, backend=loaded.group(1) if loaded else "", completion=answer["content"])


def _tail(log: Path) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-TAIL_LINES:])
