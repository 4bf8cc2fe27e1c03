"""Prefix routing with a real llama-server: the gateway records what the replica was given, and
believes the engine over its own record when the two disagree. llama-server restarted in place
(the same replica, the same address: the rotation never changed) reports its task count begun
again on /slots; the gateway then takes it to hold nothing, and says so on the next answer."""

from __future__ import annotations

import os
import secrets
import subprocess
import time
from pathlib import Path

import pytest
import trio

from llmgw.config import Secret
from llmgw.engines import SPECS, ReplicaLaunch, build_command
from llmgw.gateway.cachewatch import CACHE_REPORT_INTERVAL_S
from llmgw.gateway.routing import Endpoint
from llmgw.wire import gateway_link as g
from testlib.gateway import request, start_gateway
from testlib.llama import llama_server
from testlib.ports import free_port
from testlib.tinygguf import write_tiny_llama
from testlib.waiting import await_true

pytestmark = pytest.mark.trio
READY_TIMEOUT_S = 60.0
SYSTEM = "the of and to in is it you that he was for on are with as his they be at one " * 8


def start(launch: ReplicaLaunch, binary: str, log: Path) -> subprocess.Popen:
    cmd = build_command(launch, binary)
    for f in cmd.files:
        Path(f.path).unlink(missing_ok=True)
        fd = os.open(f.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(f.content.reveal())
    with log.open("ab") as out:
        return subprocess.Popen(cmd.argv, env=cmd.environment(os.environ), stdout=out, stderr=out)


def wait_healthy(port: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"llama-server exited with {proc.returncode}"
        try:
            if request(port, "GET", "/health", timeout=2)[0] == 200:
                return
        except OSError:
            pass  # not listening yet
        time.sleep(0.05)  # a poll interval, bounded by the deadline
    pytest.fail(f"llama-server did not answer /health within {READY_TIMEOUT_S:.0f} s")


async def test_a_replica_restarted_in_place_is_taken_to_hold_nothing(tmp_path: Path, nursery: trio.Nursery) -> None:
    binary = llama_server()
    model = write_tiny_llama(tmp_path / "tiny.gguf", seed=2)
    private = tmp_path / "keys"
    private.mkdir(mode=0o700)
    launch = ReplicaLaunch(
        engine="llamacpp",
        model_path=str(model),
        served_name="tiny",
        host="127.0.0.1",
        port=free_port(),
        api_key=Secret(secrets.token_urlsafe(24)),
        context=2048,
        extra_args=("--threads", "1", "--parallel", "2", "-lv", "2"),
        private_dir=str(private),
    )
    proc = start(launch, binary, tmp_path / "llama.log")
    try:
        await trio.to_thread.run_sync(wait_healthy, launch.port, proc)
        ep = Endpoint(
            replica_id="tiny-0", model="tiny", host=launch.host, port=launch.port, api_key=launch.api_key.reveal()
        )
        gw = await start_gateway(nursery, tmp_path, (ep,))
        info = g.ModelInfo(name="tiny", engine="llamacpp", routes=SPECS["llamacpp"].routes(()), routing="prefix")
        gw.provider.set((ep,), None, (info,))
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello model"}]

        def ask(*more: dict, stream: bool = False) -> str:
            body = {"model": "tiny", "messages": [*messages, *more], "max_tokens": 2, "temperature": 0}
            body["stream"] = stream
            status, headers, raw = request(gw.port, "POST", "/v1/chat/completions", body, token=gw.token, timeout=60)
            assert status == 200, raw
            return headers["x-llmgw-route"]

        assert await trio.to_thread.run_sync(ask) == "prefix;matched=0;only"
        later = ({"role": "assistant", "content": "the model"}, {"role": "user", "content": "and then"})
        route = await trio.to_thread.run_sync(ask, *later)
        held = int(route.split(";")[1].removeprefix("matched="))
        assert held > len(SYSTEM), route  # the system prompt and the first question, at least
        assert await trio.to_thread.run_sync(lambda: ask(*later, stream=True)) == f"prefix;matched={held};only"
        # The prompts it was given are work ahead of others until their answers begin: none now.
        assert gw.gateway.router.prefilling == {} and gw.gateway.router.outstanding == {}
        # Reports of the engine's tasks heard since (two: the first may have been under way).
        reports = lambda: gw.gateway.metrics.cache_reports.get(model="tiny")  # noqa: E731
        heard = reports()
        await await_true(
            lambda: reports() >= heard + 2, "two reports of the engine's tasks", timeout=CACHE_REPORT_INTERVAL_S * 5
        )
        assert gw.gateway.metrics.cache_resets.get(model="tiny") == 0

        proc.terminate()
        proc.wait(timeout=30)
        proc = start(launch, binary, tmp_path / "llama.log")  # the same port and key: the rotation is unchanged
        await trio.to_thread.run_sync(wait_healthy, launch.port, proc)
        await await_true(
            lambda: gw.gateway.metrics.cache_resets.get(model="tiny") > 0,
            "the restarted engine's report taken as a reset",
            timeout=CACHE_REPORT_INTERVAL_S * 5,
        )
        # Without the engine's word the gateway would claim `held` again; it claims nothing.
        assert await trio.to_thread.run_sync(ask, *later) == "prefix;matched=0;only"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
