"""A real HAProxy (Debian's, which `./pants test` installs) in front of gateway processes, on
127.0.0.1 ports only, with the configuration docs/gateway.md shows ("Behind a load balancer").

`CONFIG` is that configuration, its `{placeholders}` filled by `config_text`; the test of the docs
checks the page shows exactly this text. `HAProxy` runs `haproxy -f CONFIG -db` (in the
foreground, a child of the test), waits until it serves, reads its view of the backend's servers
from its stats page (`servers`: UP or DOWN, how often each was picked, its retries and
redispatches), and stops it.
"""

from __future__ import annotations

import csv
import http.client
import io
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import attrs

from testlib.cluster import free_port

READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
POLL_S = 0.05
BACKEND = "gateways"
SERVERS = ("gw-a", "gw-b")
SYSTEM_DIRS = ("/usr/local/sbin", "/usr/sbin", "/sbin")  # Debian installs it in /usr/sbin, not on a user's PATH

CONFIG = """\
global
    log stdout format raw local0

defaults
    mode http
    log global
    option httplog
    option forwardfor
    option http-no-delay
    timeout connect 2s
    timeout client 10m
    timeout server 10m
    timeout http-request 30s
    timeout http-keep-alive 60s
    timeout queue 30s
    timeout check 2s
    retries 3
    option redispatch 1
    option http-buffer-request
    retry-on conn-failure empty-response response-timeout

frontend llmgw
    bind {listen}
    default_backend gateways

backend gateways
    balance leastconn
    option httpchk GET /health
    http-check expect status 200
    default-server check inter 1s fall 2 rise 2
    server gw-a {gateway_a}
    server gw-b {gateway_b}

frontend stats
    bind {stats}
    stats enable
    stats uri /stats
"""


def haproxy_binary() -> str:
    found = shutil.which("haproxy", path=os.pathsep.join([os.environ.get("PATH", ""), *SYSTEM_DIRS]))
    if found is None:
        raise AssertionError("no haproxy on this machine: ./pants test installs it (tools/testenv/prepare.py)")
    return found


def config_text(*, listen_port: int, gateway_ports: tuple[int, int], stats_port: int) -> str:
    """CONFIG on loopback: the frontend, the two gateways and the stats page on those ports."""
    return CONFIG.format(
        listen=f"127.0.0.1:{listen_port}",
        gateway_a=f"127.0.0.1:{gateway_ports[0]}",
        gateway_b=f"127.0.0.1:{gateway_ports[1]}",
        stats=f"127.0.0.1:{stats_port}",
    )


def write_config(directory: Path, *, listen_port: int, gateway_ports: tuple[int, int], stats_port: int) -> Path:
    path = directory / "haproxy.cfg"
    path.write_text(config_text(listen_port=listen_port, gateway_ports=gateway_ports, stats_port=stats_port))
    return path


@attrs.frozen
class ServerState:
    """One server of the backend as HAProxy sees it (its stats page's CSV, `/stats;csv`)."""

    status: str  # "UP", "DOWN", "UP 1/2" (going down), "DOWN 1/2" (coming up), "MAINT", ...
    picked: int  # lbtot: times the balancer chose it (a redispatch counts for the new server)
    retries: int  # wretr: requests sent to it again after a failure
    redispatches: int  # wredis: requests taken away from it to another server after a failure

    @property
    def up(self) -> bool:
        """In rotation, every recent check passed."""
        return self.status == "UP"

    @property
    def down(self) -> bool:
        """Out of rotation ("DOWN 1/2": out, its checks passing again but not yet enough)."""
        return self.status.startswith("DOWN")


class HAProxy:
    """`haproxy -f CONFIG -db` on 127.0.0.1, a child of this process; `stop` (or `kill`) ends it."""

    def __init__(self, directory: Path, gateway_ports: tuple[int, int]) -> None:
        self.port, self.stats_port = free_port(), free_port()
        self.config = write_config(
            directory, listen_port=self.port, gateway_ports=gateway_ports, stats_port=self.stats_port
        )
        self.log_path = directory / "haproxy.log"
        with self.log_path.open("wb") as log:
            self.popen = subprocess.Popen(
                [haproxy_binary(), "-f", str(self.config), "-db"],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            self._wait_serving()
        except BaseException:
            self.stop()
            raise

    def _wait_serving(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if self.popen.poll() is not None:
                raise AssertionError(f"haproxy exited with {self.popen.returncode}\n{self.tail()}")
            try:
                self.servers()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise AssertionError(f"haproxy did not serve within {READY_TIMEOUT_S:g} s\n{self.tail()}") from None
            time.sleep(POLL_S)

    def servers(self) -> dict[str, ServerState]:
        """The backend's servers by name, from the stats page."""
        conn = http.client.HTTPConnection("127.0.0.1", self.stats_port, timeout=10)
        try:
            conn.request("GET", "/stats;csv")
            response = conn.getresponse()
            text = response.read().decode()
        finally:
            conn.close()
        assert response.status == 200, text[:200]
        rows = csv.DictReader(io.StringIO(text.lstrip("# ")))
        return {
            row["svname"]: ServerState(
                status=row["status"],
                picked=int(row["lbtot"] or 0),
                retries=int(row["wretr"] or 0),
                redispatches=int(row["wredis"] or 0),
            )
            for row in rows
            if row["pxname"] == BACKEND and row["svname"] in SERVERS
        }

    def tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        status = "running" if self.popen.poll() is None else f"exited {self.popen.returncode}"
        return f"--- haproxy ({status}) {self.log_path} ---\n" + "\n".join(text)

    def stop(self) -> None:
        """SIGTERM (HAProxy's hard stop: it closes everything and exits), then SIGKILL."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(STOP_TIMEOUT_S)
