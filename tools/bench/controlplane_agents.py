"""Phase 3 of `tools/bench/controlplane.py`, the one that needs agents: a real `llmgw server` in a
process of its own and simulated agents linked to it, what it costs the control plane to take
them (`agents_phase`), and what it reads of the server's /metrics meanwhile. The phases that need
no agents, and the command line, are `controlplane.py`'s.

3. agents (`--agents N`, default 0: skipped): a real `llmgw server` in a process of its own (CPU
   time and RSS from /proc) and N simulated agents in `--agent-processes` processes
   (`tools/bench/agents_load.py`: the product's agent link each, with a certificate of its
   own, issued once and cached under $XDG_CACHE_HOME/llmgw-bench/controlplane with the CA that
   signed them; a real hello, 8 GPUs and 2 fabrics; heartbeats at the interval the control
   plane tells). `join_s`: from cold (a new store) until all N links are up, then checked on
   the control plane (`ctl nodes --state joined`, paged); `cpu_pct_steady` and `rss_mib`: the
   control plane's CPU over `--steady-seconds` (at least two of the heartbeat intervals the
   agents are told, `heartbeat_interval_s`, and begun one interval after the last joined: the
   heartbeats spread by then) once all have joined and the replicas placed together while few
   nodes had joined are spread (`settle_s` after all joined, `replica_moves` made; no move
   under way or ended for SETTLED_QUIET_S), and its RSS then; past the default agents'
   budget (`max_agent_connections`, an eighth of the open-file limit) the bench sets it;
   `heartbeat_p99_ms`: the 99th percentile of the time from an agent's sending a heartbeat to
   the registry's counting it, over the `heartbeats_steady` heartbeats of that window (the
   control plane's `llmgw_agent_heartbeat_delay_seconds`: the bound of the bucket it falls in,
   so "at most"), and `loop_lag_p99_ms`, its event loop's lag meanwhile, likewise;
   `reconnect_storm_s`: every link cut at once, until all are up again (the agents' own jittered
   backoff) and all joined; `storm_dials_failed`, the dials past one per agent meanwhile (each
   refused or failed, then waited its backoff), and `storm_turned_away`, the agent port's own
   sheddings and stops at its cap, by reason. The catalog has one replica a node (engine vllm,
   one GPU), which each simulated agent reports ready as soon as it is assigned, and says in
   its hello: `ready_routed` is how many a gateway worker routed to before the cut, and
   `storm_ready_routed_min` the fewest it routed to while the storm went on (its /metrics
   looked at every ROUTED_EVERY_S): equal, when no ready replica that stayed up was lost. `--gateways G` (default 4) gateway processes subscribe to the
   control plane meanwhile, as its `gateway_workers` (their CPU is their own, not counted).
"""

from __future__ import annotations

import http.client
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench import agents_load
from bench.procs import child_env, cpu_s, rss_mib, stop

from llmgw.ctl.client import AdminClient
from llmgw.http.fdlimits import default_max_connections
from llmgw.pki.ca import make_key_and_csr
from llmgw.pki.files import load_ca
from testlib.controlplane import make_state
from testlib.ports import free_port

AGENTS_TIMEOUT_S = 900.0  # joining, or settling after the cut, at the most
READY_TIMEOUT_S = 60.0
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llmgw-bench" / "controlplane"
ENGINE = agents_load.ENGINE
STORM_MODEL = "bench"  # one replica a node in the agents phase
ROUTED_EVERY_S = 2.0  # how often the gateways' routing is looked at in the storm (/metrics is large)


def certificates(cache: Path, count: int) -> tuple[Path, Path]:
    """A control plane's state (its CA, its server certificate) and `count` node certificates
    it signed, made once and kept in `cache`: the state to copy, the certificates' directory."""
    template, certs = cache / "state", cache / "certs"
    if not (cache / "state.done").exists():
        shutil.rmtree(cache, ignore_errors=True)
        make_state(template, sans=["127.0.0.1"], days=3650)
        (cache / "state.done").write_text("")
    ca = load_ca(template)
    certs.mkdir(parents=True, exist_ok=True)
    (certs / "ca.crt").write_bytes(ca.cert_pem())
    for i in range(count):
        d = certs / agents_load.node_id(i)
        if (d / "node.crt").exists():
            continue
        key, csr = make_key_and_csr(agents_load.node_id(i))
        d.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(
            d / "node.key", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600
        )  # the agent refuses a key others read
        with os.fdopen(fd, "wb") as f:
            f.write(key)
        (d / "node.crt").write_bytes(ca.sign_csr(csr, agents_load.node_id(i), validity_days=3650))
    return template, certs


class Load:
    """The agents' processes, and what each last said (`agents_load`'s JSON lines)."""

    def __init__(self, port: int, certs: Path, agents: int, processes: int, logs: Path) -> None:
        self.procs: list[subprocess.Popen] = []
        self.latest: list[dict] = []
        self.logs = logs
        per = -(-agents // processes)
        for k, first in enumerate(range(0, agents, per)):
            proc = subprocess.Popen(
                [sys.executable, "-m", agents_load.__name__, "--port", str(port), "--certs", str(certs)]
                + ["--first", str(first), "--count", str(min(per, agents - first))],
                env=child_env(),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=(logs / f"load-{k}.log").open("wb"),
                text=True,
            )
            self.procs.append(proc)
            self.latest.append({"connected": 0, "sessions": 0, "attempts": 0, "cuts": 0})
            threading.Thread(target=self._read, args=(k, proc), daemon=True).start()

    def _read(self, k: int, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.latest[k] = json.loads(line)

    def connected(self) -> int:
        """Links up now, over every process; SystemExit if a process ended (its log's tail)."""
        for k, proc in enumerate(self.procs):
            if proc.poll() is not None:
                tail = (self.logs / f"load-{k}.log").read_text(errors="replace")[-2000:]
                raise SystemExit(f"agents process {k} exited {proc.returncode}:\n{tail}")
        return sum(r["connected"] for r in self.latest)

    def attempts(self) -> int:
        """Dials ever, over every process."""
        return sum(r["attempts"] for r in self.latest)

    def sessions(self) -> int:
        """Sessions ever, over every process."""
        return sum(r["sessions"] for r in self.latest)

    def cuts(self) -> int:
        """The fewest cuts any process has made."""
        return min(r["cuts"] for r in self.latest)

    def cut(self) -> None:
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.write("cut\n")
            proc.stdin.flush()

    def stop(self) -> None:
        for proc in self.procs:
            stop(proc)


def wait_for(what: str, predicate, timeout_s: float, every_s: float = 0.1) -> float:
    """Seconds until `predicate()` holds, polled; SystemExit naming `what` past `timeout_s`."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout_s:
            raise SystemExit(f"{what}: not within {timeout_s:g} s")
        time.sleep(every_s)
    return time.monotonic() - started


def wait_for_value(what: str, value, timeout_s: float):
    """`value()` once it is truthy, polled each second; SystemExit naming `what` past `timeout_s`."""
    found = []
    wait_for(what, lambda: found.append(value()) or found[-1], timeout_s, every_s=1.0)
    return found[-1]


def ready_routed(http_port: int) -> int:
    """Replicas in state ready in one gateway worker's rotation (its series in /metrics, as its
    last heartbeat said them: one is sent at once whenever it routes by a new rotation)."""
    workers: dict[str, int] = {}
    for line in metrics_text(http_port).splitlines():
        if line.startswith("llmgw_gateway_replica_state{") and 'state="ready"' in line and line.endswith(" 1"):
            worker = line.split('worker="', 1)[1].split('"', 1)[0]
            workers[worker] = workers.get(worker, 0) + 1
    return min(workers.values()) if workers else 0


def joined_count(state: Path) -> int:
    client = AdminClient.locate(server=None, credential=None, state_dir=str(state))
    return len(client.nodes(state="joined"))


def agents_phase(
    agents: int, processes: int, steady_s: float, tmp: Path, cache: Path, gateways: int, replicas: bool = True
) -> dict:
    template, certs = certificates(cache, agents)
    state = tmp / "state"
    shutil.copytree(template, state)
    port, http_port = free_port(), free_port()
    config = tmp / "server.toml"
    # The agents' budget by default is an eighth of the open-file limit (2,484 at this machine's
    # 20,000): more agents than that need it set, as an operator would (docs/operations.md).
    cap = default_max_connections("agent")
    cap = cap if agents <= cap else agents + agents // 10
    config.write_text(
        f'[server]\nstate_dir = "{state}"\nagent_listen = "127.0.0.1:{port}"\n'
        f'http_listen = "127.0.0.1:{http_port}"\ngateway_workers = {gateways}\n'
        f'[http]\nmax_agent_connections = {cap}\n[engines.llamacpp]\nversion = ""\n'
        # One replica a node, which the agents report ready at once: the gateways route to them,
        # and the storm must not take one out of their rotation.
        + (
            f'[[models]]\nname = "{STORM_MODEL}"\nengine = "{ENGINE}"\nreplicas = {agents}\ngpus_per_replica = 1\n'
            'source = { path = "/srv/models/bench" }\n'
            if replicas
            else ""
        )
    )
    log = (tmp / "server.log").open("wb")
    server = subprocess.Popen(
        [sys.executable, "-m", "llmgw", "server", "--config", str(config)],
        env=child_env(),
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=log,
    )
    load = None
    try:
        wait_for("the control plane listening", lambda: listening(port) or server.poll() is not None, READY_TIMEOUT_S)
        if server.poll() is not None:
            raise SystemExit(f"llmgw server exited {server.returncode}:\n{(tmp / 'server.log').read_text()[-2000:]}")
        load = Load(port, certs, agents, processes, tmp)
        join_s = wait_for(f"{agents} agents linked", lambda: load.connected() == agents, AGENTS_TIMEOUT_S)
        wait_for(f"{agents} nodes joined", lambda: joined_count(state) == agents, AGENTS_TIMEOUT_S)
        join_s = max(join_s, 0.0)
        # The replicas placed while few nodes had joined share their nodes: the spreader moves
        # them to the nodes that joined since. Steady is once it has done so.
        joined_at = time.monotonic()
        wait_for("the spreading moves done", lambda: settled(http_port), AGENTS_TIMEOUT_S, every_s=SETTLED_QUIET_S)
        settle_s = time.monotonic() - joined_at - SETTLED_QUIET_S
        # What joining started settles, and the heartbeats spread over an interval (every agent
        # joined within the last seconds beat together at first); the window is at least two
        # intervals, so that it holds as many heartbeats as the rate says, no more, no fewer.
        interval = gauge(http_port, "llmgw_agent_heartbeat_interval_seconds")
        time.sleep(max(min(5.0, steady_s), interval - SETTLED_QUIET_S))
        steady_s = max(steady_s, 2 * interval)
        moves = int(sum(counters_of(http_port, MOVES).values()))
        before, counted = cpu_s(server.pid), histograms(http_port, LAG, HEARTBEAT_DELAY)
        time.sleep(steady_s)
        cpu_pct = 100 * (cpu_s(server.pid) - before) / steady_s
        now = histograms(http_port, LAG, HEARTBEAT_DELAY)
        lag_p99 = p99_of(counted[LAG], now[LAG])
        heartbeat_p99 = p99_of(counted[HEARTBEAT_DELAY], now[HEARTBEAT_DELAY])
        heartbeats = now[HEARTBEAT_DELAY].get(math.inf, 0) - counted[HEARTBEAT_DELAY].get(math.inf, 0)
        rss = rss_mib(server.pid)
        routed = (
            wait_for_value(
                f"the gateways to route to {agents} ready replicas",
                lambda: (n := ready_routed(http_port)) == agents and n,
                AGENTS_TIMEOUT_S,
            )
            if replicas
            else 0
        )
        dials, turned_away = load.attempts(), counters(http_port, TURNED_AWAY)
        sessions = load.sessions()
        load.cut()
        # Each process says it cut at once; its links may all be up again before its next report,
        # so fewer connected is not waited for. Linked again: every agent in a session begun since.
        wait_for("the links cut", lambda: load.cuts() >= 1, 30.0, every_s=0.01)
        least = [routed]

        def linked_again() -> bool:
            least[0] = min(least[0], ready_routed(http_port))  # sampled as the storm goes
            return load.connected() == agents and load.sessions() >= sessions + agents

        storm_s = wait_for(f"{agents} agents linked again", linked_again, AGENTS_TIMEOUT_S, every_s=ROUTED_EVERY_S)
        storm_s += wait_for(f"{agents} nodes joined again", lambda: joined_count(state) == agents, AGENTS_TIMEOUT_S)
        least[0] = min(least[0], ready_routed(http_port))
        time.sleep(2 * agents_load.REPORT_S)  # the agents' last counts
        storm_dials = load.attempts() - dials
        storm_turned_away = {
            k: v - turned_away.get(k, 0)
            for k, v in counters(http_port, TURNED_AWAY).items()
            if v > turned_away.get(k, 0)
        }
    finally:
        if load is not None:
            load.stop()
        stop(server)
        log.close()
    return {
        "agents": agents,
        "agent_processes": len(load.procs),
        "gateways": gateways,
        "join_s": round(join_s, 2),
        "settle_s": round(max(settle_s, 0.0), 2),  # from all joined until the spreading moves were done
        "replica_moves": moves,  # the moves made by then (spreading replicas placed together)
        "steady_seconds": steady_s,
        "heartbeat_interval_s": interval,
        "max_agent_connections": cap,
        "cpu_pct_steady": round(cpu_pct, 2),
        "rss_mib": round(rss, 1),
        "heartbeat_p99_ms": None if heartbeat_p99 is None else round(heartbeat_p99 * 1000, 1),
        "heartbeats_steady": int(heartbeats),
        "loop_lag_p99_ms": None if lag_p99 is None else round(lag_p99 * 1000, 1),
        "reconnect_storm_s": round(storm_s, 2),
        # Dials past one per agent: each was refused or failed and waited its backoff.
        "storm_dials_failed": storm_dials - agents,
        "storm_turned_away": storm_turned_away,  # the agent port's connections shed or refused, by reason
        "agents_replicas": agents if replicas else 0,  # the catalog of the agents phase
        "ready_routed": routed,  # ready replicas a gateway routed to before the cut
        "storm_ready_routed_min": least[0],  # the fewest seen while the storm went on (sampled)
    }


def metrics_text(http_port: int) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", http_port, timeout=10)
    try:
        conn.request("GET", "/metrics")
        return conn.getresponse().read().decode()
    finally:
        conn.close()


def gauge(http_port: int, name: str) -> float:
    """A gauge of the control plane's without labels (/metrics)."""
    for line in metrics_text(http_port).splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise SystemExit(f"the control plane's /metrics has no {name}")


LAG, HEARTBEAT_DELAY = "llmgw_event_loop_lag_seconds", "llmgw_agent_heartbeat_delay_seconds"


def histograms(http_port: int, *families: str) -> dict[str, dict[float, float]]:
    """The control plane's histograms `families` (/metrics): each one's cumulative count by bound."""
    text = metrics_text(http_port)
    out: dict[str, dict[float, float]] = {family: {} for family in families}
    for line in text.splitlines():
        family = line.split("_bucket{", 1)[0] if "_bucket{" in line else ""
        if family in out:
            bound = line.split('le="', 1)[1].split('"', 1)[0]
            out[family][math.inf if bound == "+Inf" else float(bound)] = float(line.rsplit(" ", 1)[1])
    return out


MOVES, UNDER_WAY = "llmgw_replica_moves_total", "llmgw_replica_moves_in_progress"
SETTLED_QUIET_S = 3.0  # no move under way, and none begun, for this long: the spreader is done
_last_moves: list[float] = []


def counters_of(http_port: int, family: str) -> dict[str, float]:
    """A family of the control plane's (/metrics), by its series' labels as written."""
    out = {}
    for line in metrics_text(http_port).splitlines():
        if line.startswith(family + "{") or line.startswith(family + " "):
            series, value = line.rsplit(" ", 1)
            out[series] = float(value)
    return out


def settled(http_port: int) -> bool:
    """Whether no move is under way and none ended since the last look (SETTLED_QUIET_S ago)."""
    ended = sum(counters_of(http_port, MOVES).values())
    quiet = gauge(http_port, UNDER_WAY) == 0 and _last_moves[-1:] == [ended]
    _last_moves.append(ended)
    return quiet


# The agent port's own turning away (not a peer's closing: the cut itself closes every link).
TURNED_AWAY = ("llmgw_connections_shed_total", "llmgw_connections_at_capacity_total")


def counters(http_port: int, families: tuple[str, ...]) -> dict[str, float]:
    """The agent port's counters `families` (/metrics), by family and reason."""
    text = metrics_text(http_port)
    out = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0]
        if name in families and 'listener="agent"' in line:
            reason = line.split('reason="', 1)[1].split('"', 1)[0] if 'reason="' in line else ""
            out[f"{name.removeprefix('llmgw_connections_').removesuffix('_total')}:{reason}".rstrip(":")] = float(
                line.rsplit(" ", 1)[1]
            )
    return out


def p99_of(before: dict[float, float], after: dict[float, float]) -> float | None:
    """The bound of the bucket holding the 99th percentile of what was counted in between."""
    bounds = sorted(after)
    total = after.get(math.inf, 0) - before.get(math.inf, 0)
    if not total:
        return None
    for bound in bounds:
        if after[bound] - before.get(bound, 0) >= 0.99 * total:
            return bound
    return None


def listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0
