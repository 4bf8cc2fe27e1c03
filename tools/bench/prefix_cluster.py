"""The processes under `tools/bench/prefix.py`: real llama-server replicas of the bench's model,
started fresh with their caches empty (`Replicas`), and one gateway in front of them routing the
model by a policy (`Gateway`, tools/bench/gateway_runner.py), each waited for until it answers
/health. What the bench sends through them and measures is `prefix.py`'s.
"""

from __future__ import annotations

import http.client
import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

from bench import gateway_runner
from bench.llamacpp import free_port
from bench.procs import child_env, stop

from llmgw.config import Secret
from llmgw.engines import ReplicaLaunch, build_command

MODEL = "chat"  # the model's name, as the replicas serve it and the gateway routes it
READY_TIMEOUT_S = 120.0


def get_status(port: int, path: str, key: str = "") -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        conn.request("GET", path, headers={"Authorization": f"Bearer {key}"} if key else {})
        response = conn.getresponse()
        response.read()
        return response.status
    except OSError:
        return 0
    finally:
        conn.close()


def wait_for(what: str, ready, procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise SystemExit(f"{what}: a process exited with {p.returncode} before it was ready")
        if ready():
            return
        time.sleep(0.05)
    raise SystemExit(f"{what} was not ready within {READY_TIMEOUT_S:.0f} s")


class Replicas:
    """`count` llama-servers of `model`, each one thread and `slots` slots."""

    def __init__(
        self, server: str, model: Path, count: int, slots: int, context: int, cache_mib: int, tmp: Path
    ) -> None:
        self.procs: list[subprocess.Popen] = []
        self.endpoints: list[dict] = []
        for i in range(count):
            key, port = secrets.token_urlsafe(24), free_port()
            private = tmp / f"replica-{i}-{port}"
            private.mkdir(mode=0o700)
            launch = ReplicaLaunch(
                engine="llamacpp",
                model_path=str(model),
                served_name=MODEL,
                host="127.0.0.1",
                port=port,
                api_key=Secret(key),
                context=context * slots,
                extra_args=("--threads", "1", "--parallel", str(slots), "--cache-ram", str(cache_mib), "-lv", "2"),
                private_dir=str(private),
            )
            cmd = build_command(launch, server)
            for f in cmd.files:
                fd = os.open(f.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as out:
                    out.write(f.content.reveal())
            with open(private / "llama-server.log", "wb") as log:
                self.procs.append(
                    subprocess.Popen(
                        cmd.argv, env=cmd.environment(os.environ), stdin=subprocess.DEVNULL, stdout=log, stderr=log
                    )
                )
            self.command = cmd.for_log()["argv"]
            self.endpoints.append(
                {"replica_id": f"replica-{i}", "model": MODEL, "host": "127.0.0.1", "port": port, "api_key": key}
            )
        for ep in self.endpoints:
            wait_for("llama-server", lambda ep=ep: get_status(ep["port"], "/health") == 200, self.procs)

    def stop(self) -> None:
        for p in self.procs:
            stop(p)


class Gateway:
    """tools/bench/gateway_runner.py in front of `endpoints`, routing the model by `policy`."""

    def __init__(self, endpoints: list[dict], policy: str, tmp: Path, load_factor: float) -> None:
        spec = tmp / f"gateway-{policy}.json"
        details = [{"name": MODEL, "engine": "llamacpp", "routing": policy}]
        options = {"prefix_load_factor": load_factor}
        spec.write_text(json.dumps({"endpoints": endpoints, "details": details, "options": options}))
        with open(tmp / f"gateway-{policy}.log", "wb") as log:
            self.proc = subprocess.Popen(
                # By the module itself, so that Pants gives the smoke test's sandbox its files.
                [sys.executable, "-m", gateway_runner.__name__, str(spec)],
                env=child_env(),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=log,
            )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            tail = (tmp / f"gateway-{policy}.log").read_text(errors="replace")[-2000:]
            raise SystemExit(f"the gateway runner exited with {self.proc.wait(10)} before listening:\n{tail}")
        info = json.loads(line)
        self.port, self.token = info["port"], info["token"]
