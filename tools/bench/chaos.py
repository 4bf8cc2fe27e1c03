"""Chaos: a local cluster under steady load, one fault at a time, and what each fault cost.

    ./pants run tools/bench/chaos.py -- --json           (as root: nodes in network namespaces)

A real cluster on this machine (`tools/bench/chaos_cluster.py`): `llmgw server` on sockets this
process owns (as a systemd .socket unit would), three nodes each running `llmgw agent run`
(as root, each in its own network namespace; otherwise on loopback addresses) and real sim
engines, the server's default heartbeats (every 5 s, lost after 30 s) unless told otherwise.
The catalog has one model, `chat`, with two replicas, so one node is spare. Through the
gateway runs a steady load (`tools/bench/chaos_load.py`): 50 non-streamed requests a second
and 20 streams in flight (`--streams`), each of `--stream-tokens` tokens, its text checked word
for word against the sim engine's deterministic answer. Then, one at a time, each fault waiting
for full capacity first:

- engine_kill      SIGKILL one replica's engine
- agent_kill       SIGKILL one node's agent alone, start it again a second later (as systemd
                   would): its engines keep serving, nothing should move, the new agent adopts them
- node_kill        SIGKILL a node's agent and engines together (a machine dies); it comes back
- node_partition   cut a node's network link (root only); restore it once its replica runs
                   elsewhere: no duplicate may survive the rejoin
- drain            `llmgw ctl drain` of a node with a replica, then uncordon
- rolling_update   the model's args changed in server.toml and `llmgw ctl reload` (`chat` is a
                   server.toml model; `ctl models update` changes those added from the Hub, by
                   the same rollout): each replica replaced by one of the new version, ready
                   before the old one drains; recovered when every replica runs the new version,
                   ready and in the gateway's rotation, and the old engines are gone. The two
                   arg lists it alternates between differ only by a sim flag at its default
                   (`--prompt-token-ms 0`), so the answers, and the load's text check, stay the
                   same and the fault can run again; `rollout_s` is `llmgw ctl reload` to the
                   control plane's `rollout_done`
- rolling_update_fails  args the sim refuses (it exits at start): recovered when the rollout
                   has stopped with its reason in `llmgw ctl models` and the old engines still
                   serve; then the args are put back (a reload), so the next fault starts at
                   full capacity
- restart          SIGTERM the control plane and start it again on the same sockets
- hostile          hostile clients (FIN/RST at every offset, garbage, slowloris, JSON 100,000
                   deep, 1,000 idle connections) against the gateway and the agent port
- adversarial_bodies  a key holder sends the bodies built to be slow to parse
                   (`testlib.bodies`, at 8 MiB each) while `/health` is timed every 50 ms
- connection_flood three times the HTTP listener's cap of idle connections and three times the
                   agent port's unproven budget of bare ones, held for 10 s, while the spare
                   node's agent is restarted: the load must not notice, the agent must rejoin

With `--store postgresql` (a PostgreSQL cluster the bench makes and starts itself) or `--store
postgresql://USER@HOST:PORT/DB` (an empty database of yours), it runs the high-availability
topology instead — two control planes on that store, one standalone gateway, two nodes — and
its faults (`tools/bench/chaos_ha.py`): `leader_kill` (SIGKILL the leading control plane) and
`store_away` (PostgreSQL stopped 30 s; only a cluster the bench started).

For each: the requests and streams started from the fault until capacity was full again (and a
few seconds after), how many failed and why; of the streams, how many moved to another replica
(`migrated_streams`: the gateway continued them, docs/gateway.md), how many ended with a text
other than the engine's answer (`streams_wrong_text`), and the longest gap between two tokens a
client saw (`migration_stall_p99_s`/`_max_s` of the moved ones, `unmoved_stall_*` of the others);
for a kill, each stream's gap across its moment (`migration_seam_*`: the stall a move cost, split
into last token to kill and kill to next token; `migration_off_seam_p99_s`, a moved stream's
longest gap elsewhere; `unmoved_gap_at_kill_p99_s`), the target's measure, and `killed_at_unix`;
the load's own CPU share and loop lag; `recovery_s` (fault to full capacity: both
replicas in the gateway's rotation), `engine_restarts` (engine processes started meanwhile: restarts and replacements), and
whether any llmgw process exited that the fault did not kill. Prints one JSON object; bounded
in time (every wait has a deadline) and loopback/namespaces only. About 7 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from datetime import datetime
from pathlib import Path

import trio
from bench import chaos_attacks as attacks
from bench import chaos_ha
from bench.chaos_cluster import ChaosCluster, poll, report, run_and_print
from bench.chaos_load import Load

from llmgw.simengine.text import MAX_WORDS

MODEL = "chat"
REPLICAS = 2
NODES = ("node-a", "node-b", "node-c")
FAULTS = (
    "engine_kill",
    "agent_kill",
    "node_kill",
    "node_partition",
    "drain",
    "rolling_update",
    "rolling_update_fails",
    "restart",
    "hostile",
    "adversarial_bodies",
    "connection_flood",
)
SETTLE_S = 3.0  # load measured this long after capacity is full again
FULL_TIMEOUT_S = 180.0
ZERO_FAILURE_FAULTS = FAULTS
# Faults that cut streams mid-answer (a replica's engine dies with them): each moved stream's gap
# between two tokens across the kill, at the 99th percentile, within this (issue 47).
CUTTING_FAULTS = ("engine_kill", "node_kill")
MIGRATION_STALL_P99_S = 1.5


# The sim's args beside --output-token-ms, by rolling update: the second sets a flag to its
# default, so both versions answer every request alike, word for word and at the same pace.
SAME_ANSWERS = ((), ("--prompt-token-ms", "0"))
REFUSED = ("--no-such-flag",)  # the sim's argparse refuses it: the engine exits at start


def sim_args(output_token_ms: int, extra: tuple[str, ...] = ()) -> list[str]:
    return ["--output-token-ms", str(output_token_ms), *extra]


def catalog(output_token_ms: int, http_cap: int = attacks.HTTP_CAP, extra: tuple[str, ...] = ()) -> str:
    # Sim models only: no node is asked for llama.cpp (the default would have each build it).
    return (
        f"[http]\nmax_connections = {http_cap}\nmax_agent_connections = {attacks.AGENT_CAP}\n\n"
        "[engines.llamacpp]\nenabled = false\n\n"
        f'[[models]]\nname = "{MODEL}"\nengine = "sim"\nreplicas = {REPLICAS}\n'
        f"args = {json.dumps(sim_args(output_token_ms, extra))}\n"
    )


def log_time(event: dict) -> float:
    """The unix time of a JSON log line (`ts`: ISO 8601, UTC)."""
    return datetime.fromisoformat(event["ts"]).timestamp()


class Bench:
    def __init__(
        self,
        cluster: ChaosCluster,
        load: Load,
        ttl_s: float,
        http_cap: int = attacks.HTTP_CAP,
        output_token_ms: int = 10,
    ) -> None:
        self.cluster, self.load, self.ttl_s, self.http_cap = cluster, load, ttl_s, http_cap
        self.output_token_ms = output_token_ms
        self.updates = 0  # rolling updates made: the catalog's args are SAME_ANSWERS[updates % 2]
        self.results: dict[str, dict] = {}
        self.unexpected_exits: list[str] = []
        self._killed: set[int] = set()

    # -- observations -------------------------------------------------------------------------

    def full(self) -> bool:
        if self.cluster.ready_in_gateway(MODEL) != REPLICAS:
            return False
        ready = [r for r in self.cluster.replicas() if r["model"] == MODEL and r["state"] == "ready"]
        return len(ready) == REPLICAS

    def settled(self) -> bool:
        """Full capacity with nothing about to move: every node joined, and the replicas on
        distinct nodes (the control plane spreads replicas placed while one node was alone;
        a fault must not start in the middle of such a move)."""
        if not self.full():
            return False
        nodes = self.cluster.nodes()
        if len(nodes) != len(NODES) or any(n["state"] != "joined" for n in nodes):
            return False
        placed = self.placed()
        return len(placed) == REPLICAS and len({r["nodes"][0] for r in placed}) == REPLICAS

    def placed(self) -> list[dict]:
        return [r for r in self.cluster.replicas() if r["model"] == MODEL and r.get("replica")]

    def watch_exits(self) -> None:
        for proc in self.cluster.procs:
            if proc.returncode is not None and proc.popen.pid not in self._killed and proc.returncode != 0:
                what = f"{proc.name} (pid {proc.popen.pid}) exited {proc.returncode}"
                if what not in self.unexpected_exits:
                    self.unexpected_exits.append(what)

    # -- one fault ----------------------------------------------------------------------------

    async def fault(self, name: str, inject, recovered, after=None, extra=None) -> None:
        if not await trio.to_thread.run_sync(lambda: poll("full capacity", self.settled, FULL_TIMEOUT_S)):
            self.results[name] = {"error": f"the cluster was not at full capacity within {FULL_TIMEOUT_S:g} s"}
            return
        before = await trio.to_thread.run_sync(self.cluster.engine_pids)
        seen: set[int] = set(before)
        started = trio.current_time()
        info = await trio.to_thread.run_sync(inject) or {}
        injected = trio.current_time()

        def watch() -> bool:
            seen.update(self.cluster.engine_pids())
            self.watch_exits()
            return recovered(info)

        ok = await trio.to_thread.run_sync(lambda: poll(f"{name} recovered", watch, FULL_TIMEOUT_S, 0.1))
        # A fault that lasts (the hostile clients) is over when `inject` returns; one that is a
        # moment (a kill, a cut) starts the clock when it is dealt.
        lasting = info.pop("_lasting", False)
        recovery_s = trio.current_time() - (injected if lasting else started) if ok else None
        if lasting:
            info["fault_s"] = round(injected - started, 2)
        if after is not None:
            info.update(await trio.to_thread.run_sync(lambda: after(info)) or {})
        await trio.sleep(SETTLE_S)
        seen.update(await trio.to_thread.run_sync(self.cluster.engine_pids))
        ended = trio.current_time()
        await self.load.settle(ended)  # the streams still going: counted once they end
        # A kill's moment (unix time, `_at`) on the load's clock: the streams' gaps across it.
        fault_at = info["_at"] - self.load.wall_offset if "_at" in info else None
        result = {
            **self.load.between(started, ended, fault_at),
            "recovery_s": round(recovery_s, 2) if recovery_s is not None else None,
            "engine_restarts": len(seen - before),
            "load_average": [round(x, 2) for x in os.getloadavg()],  # at its end: 1, 5, 15 min
        }
        if fault_at is not None:
            result["killed_at_unix"] = round(info["_at"], 3)  # to read the kept logs by
        result.update({k: v for k, v in info.items() if not k.startswith("_")})
        if extra is not None:
            result.update(extra(info))
        self.results[name] = result

    def _replica_on(self, spare_ok: bool = False) -> tuple[str, dict]:
        replica = self.placed()[0]
        return replica["nodes"][0], replica

    # -- the faults -----------------------------------------------------------------------------

    def engine_kill(self) -> dict:
        node, replica = self._replica_on()
        pid = replica["pids"][0]
        os.kill(pid, signal.SIGKILL)
        killed_at = time.time()
        self._killed.add(pid)
        return {"node": node, "replica": replica["replica"], "_at": killed_at}

    def agent_kill(self) -> dict:
        node, _ = self._replica_on()
        placements = sorted((r["replica"], tuple(r["nodes"])) for r in self.placed())
        agent = self.cluster.agents[node]
        self._killed.add(agent.popen.pid)
        self.cluster.kill_agent(node)
        time.sleep(1.0)  # systemd's RestartSec
        self.cluster.start_agent(node)
        return {"node": node, "_placements": placements}

    def agent_back(self, info: dict) -> bool:
        nodes = self.cluster.nodes()
        back = any(n["id"] == info["node"] and n["state"] == "joined" and n["connected"] for n in nodes)
        return back and self.full()

    def node_kill(self) -> dict:
        node, _ = self._replica_on()
        self._killed.add(self.cluster.agents[node].popen.pid)
        killed_at = self.cluster.kill_node(node)
        return {"node": node, "_at": killed_at}

    def moved_off(self, info: dict) -> bool:
        return self.full() and all(info["node"] not in r["nodes"] for r in self.placed())

    def node_back(self, info: dict) -> dict:
        """The machine comes back (its agent starts again): it joins, and runs nothing stale."""
        node = info["node"]
        if node in self.cluster.namespaces and info.get("_cut"):
            self.cluster.restore(node)
        else:
            self.cluster.start_agent(node)
        back_at = time.monotonic()
        rejoined = poll(
            "rejoin",
            lambda: any(n["id"] == node and n["state"] == "joined" for n in self.cluster.nodes()),
            FULL_TIMEOUT_S,
        )
        rejoin_s = time.monotonic() - back_at if rejoined else None
        clean = poll("no duplicate", lambda: len(self.cluster.engine_pids()) == REPLICAS, 60)
        return {
            "rejoin_s": round(rejoin_s, 2) if rejoin_s is not None else None,
            "duplicate_engines_left": len(self.cluster.engine_pids()) - REPLICAS,
            "stale_stopped_s": round(time.monotonic() - back_at, 2) if clean else None,
        }

    def node_partition(self) -> dict:
        node, _ = self._replica_on()
        self.cluster.cut(node)
        return {"node": node, "_cut": True}

    def drain(self) -> dict:
        node, _ = self._replica_on()
        self.cluster.ctl("drain", node)
        return {"node": node}

    def drained(self, info: dict) -> bool:
        nodes = {n["id"]: n for n in self.cluster.nodes()}
        drain = nodes[info["node"]].get("drain") or {}
        return bool(drain.get("done")) and self.full()

    def uncordon(self, info: dict) -> dict:
        self.cluster.ctl("uncordon", info["node"])
        return {}

    def _set_args(self, extra: tuple[str, ...]) -> float:
        """The model's args in server.toml, and `llmgw ctl reload`; when the reload was asked (unix time)."""
        asked = time.time()
        self.cluster.set_catalog(catalog(self.output_token_ms, self.http_cap, extra))
        self.cluster.reload()
        return asked

    def _serving(self) -> dict:
        placed = self.placed()
        return {
            "_pids": {pid for r in placed for pid in r["pids"]},
            "_versions": {r["version"] for r in placed},
        }

    def rolling_update(self) -> dict:
        serving = self._serving()
        self.updates += 1
        extra = SAME_ANSWERS[self.updates % 2]
        return {**serving, "_asked": self._set_args(extra), "args": sim_args(self.output_token_ms, extra)}

    def rolled(self, info: dict) -> bool:
        """Every replica of the new version, ready and in the gateway's rotation, the rollout
        over and the old engines gone."""
        placed = self.placed()
        versions = {r["version"] for r in placed}
        if len(placed) != REPLICAS or len(versions) != 1 or versions & info["_versions"]:
            return False
        if self.cluster.rollout(MODEL) is not None or self.cluster.engine_pids() & info["_pids"]:
            return False
        return self.full()

    def rollout_figures(self, info: dict) -> dict:
        """What the control plane logged of the rollout: the replicas it replaced, and the time
        from `llmgw ctl reload` to its `rollout_done`."""
        since = info["_asked"] - 0.01  # the log's times are to the millisecond
        events = [e for e in self.cluster.server.events() if e.get("model") == MODEL and log_time(e) >= since]
        replaced = [e for e in events if e["event"] == "rollout_replacing"]
        done = [e for e in events if e["event"] == "rollout_done"]
        return {
            "replaced": len(replaced),
            "rollout_s": round(log_time(done[0]) - info["_asked"], 2) if done else None,
            "versions_before": sorted(info["_versions"]),
            "versions_after": sorted({r["version"] for r in self.placed()}),
        }

    def rolling_update_fails(self) -> dict:
        return {**self._serving(), "_asked": self._set_args(SAME_ANSWERS[self.updates % 2] + REFUSED)}

    def update_stopped(self, info: dict) -> bool:
        """The rollout stopped with its reason shown, and the old engines serve on (the same ones)."""
        rollout = self.cluster.rollout(MODEL)
        if not rollout or rollout["state"] != "stopped" or not rollout["reason"]:
            return False
        info["_reason"] = rollout["reason"]
        placed = self.placed()
        return self.full() and {pid for r in placed for pid in r["pids"]} == info["_pids"]

    def put_back(self, info: dict) -> dict:
        """The args as they were (a reload): the hold is over, nothing is behind, nothing restarts."""
        kept = {pid for r in self.placed() for pid in r["pids"]} == info["_pids"]
        asked = self._set_args(SAME_ANSWERS[self.updates % 2])
        back = poll("the update put back", lambda: self.cluster.rollout(MODEL) is None and self.full(), 60)
        return {
            "reason": info.get("_reason", "").split("\n")[0],  # its first line: the engine's log follows
            "old_engines_kept": kept,
            "put_back_s": round(time.time() - asked, 2) if back else None,
        }

    def restart(self) -> dict:
        self._killed.add(self.cluster.server.popen.pid)
        status = self.cluster.stop_server()
        self.cluster.start_server()
        return {"old_server_exit": status}

    def hostile(self) -> dict:
        return attacks.hostile_clients(self.cluster, MODEL)

    def adversarial_bodies(self) -> dict:
        return attacks.adversarial_bodies(self.cluster, self.load.token, MODEL)

    def connection_flood(self) -> dict:
        spare = sorted(set(NODES) - {r["nodes"][0] for r in self.placed()})[0]
        self._killed.add(self.cluster.agents[spare].popen.pid)  # restarted by the flood: not an unexpected exit
        return attacks.connection_flood(self.cluster, spare, rejoin_timeout_s=FULL_TIMEOUT_S, cap=self.http_cap)

    def alive(self, info: dict) -> bool:
        return self.cluster.server.returncode is None and self.full()

    async def run(self, faults: tuple[str, ...]) -> None:
        plans = {
            "engine_kill": (self.engine_kill, lambda i: self.full(), None),
            "agent_kill": (self.agent_kill, self.agent_back, None),
            "node_kill": (self.node_kill, self.moved_off, self.node_back),
            "node_partition": (self.node_partition, self.moved_off, self.node_back),
            "drain": (self.drain, self.drained, self.uncordon),
            "rolling_update": (self.rolling_update, self.rolled, self.rollout_figures),
            "rolling_update_fails": (self.rolling_update_fails, self.update_stopped, self.put_back),
            "restart": (self.restart, lambda i: self.full(), None),
            "hostile": (self.hostile, self.alive, None),
            "adversarial_bodies": (self.adversarial_bodies, self.alive, None),
            "connection_flood": (self.connection_flood, self.alive, None),
        }
        for name in faults:
            inject, recovered, after = plans[name]
            extra = None
            if name == "agent_kill":

                def extra(info: dict) -> dict:
                    now = sorted((r["replica"], tuple(r["nodes"])) for r in self.placed())
                    return {"replicas_moved": now != info["_placements"]}

            await self.fault(name, inject, recovered, after, extra)
            print(f"chaos: {name}: {json.dumps(self.results[name])}", file=sys.stderr, flush=True)


def targets(results: dict, ttl_s: float, interval_s: float) -> dict:
    met = {}
    for name in ZERO_FAILURE_FAULTS:
        if name in results and "requests" in results[name]:
            met[f"{name}_no_failed_requests"] = results[name]["failed_requests"] == 0
            met[f"{name}_no_failed_streams"] = results[name]["failed_streams"] == 0
            met[f"{name}_no_wrong_text"] = results[name]["streams_wrong_text"] == 0
    for name in CUTTING_FAULTS:
        r = results.get(name)
        # The stall a move cost its client: its gap across the kill (`migration_seam_*`), not its
        # longest gap anywhere (`migration_stall_*`, kept), which on an engine carrying a dozen
        # streams may be a pause of its own later (another stream's continuation prefilled).
        stall = r.get("migration_seam_p99_s", r.get("migration_stall_p99_s")) if r else None
        if stall is not None:
            met[f"{name}_migration_stall_p99_within_1_5s"] = stall <= MIGRATION_STALL_P99_S
    for name in ("node_kill", "node_partition"):
        r = results.get(name)
        if r and r.get("recovery_s") is not None:
            # Lost after the TTL (plus at most one check interval), then a replica's start.
            start_s = results.get("engine_kill", {}).get("recovery_s") or 10.0
            met[f"{name}_recovery_within_ttl_plus_start"] = r["recovery_s"] <= ttl_s + interval_s + start_s + 5
        if r and "duplicate_engines_left" in r:
            met[f"{name}_no_duplicate_after_rejoin"] = r["duplicate_engines_left"] == 0
    bodies_fault = results.get("adversarial_bodies")
    if bodies_fault and "bodies" in bodies_fault:
        met["adversarial_bodies_all_answered"] = all(s in (200, 400) for s in bodies_fault["bodies"].values())
        met["adversarial_bodies_health_within_1s"] = bodies_fault["health_slowest_s"] < 1.0
        met["adversarial_bodies_no_engine_restart"] = bodies_fault["engine_restarts"] == 0
    flood = results.get("connection_flood")
    if flood and "fresh_health_s" in flood:
        met["connection_flood_fresh_client_served_within_1s"] = (
            flood["fresh_health_status"] == 200 and flood["fresh_health_s"] < 1.0
        )
        met["connection_flood_agent_rejoined"] = flood["spare_agent_rejoin_s"] is not None
    update = results.get("rolling_update")
    if update and "versions_after" in update:
        met["rolling_update_every_replica_replaced"] = update["recovery_s"] is not None and not (
            set(update["versions_after"]) & set(update["versions_before"])
        )
    failing = results.get("rolling_update_fails")
    if failing and "reason" in failing:
        met["rolling_update_fails_stopped_with_reason"] = failing["recovery_s"] is not None and bool(failing["reason"])
        met["rolling_update_fails_old_engines_kept"] = failing["old_engines_kept"]
        met["rolling_update_fails_put_back"] = failing["put_back_s"] is not None
    if "agent_kill" in results and "engine_restarts" in results["agent_kill"]:
        met["agent_kill_adopted_engines"] = results["agent_kill"]["engine_restarts"] == 0
        met["agent_kill_nothing_moved"] = results["agent_kill"].get("replicas_moved") is False
    return met


async def main_async(args: argparse.Namespace, root: Path) -> dict:
    netns = os.geteuid() == 0 and not args.no_netns
    faults = tuple(f for f in (args.faults or ",".join(FAULTS)).split(",") if f)
    unknown = set(faults) - set(FAULTS)
    if unknown:
        raise SystemExit(f"unknown faults {sorted(unknown)}; known: {', '.join(FAULTS)}")
    if not netns:
        faults = tuple(f for f in faults if f != "node_partition")
    interval = args.heartbeat_interval_s
    http_cap = attacks.http_cap(args.streams)
    cluster = await trio.to_thread.run_sync(
        lambda: ChaosCluster(
            root,
            nodes=NODES,
            netns=netns,
            catalog=catalog(args.output_token_ms, http_cap),
            heartbeat_interval_s=interval,
            heartbeat_ttl_s=args.heartbeat_ttl_s,
        )
    )
    try:
        await trio.to_thread.run_sync(cluster.start_server)
        for node in NODES:
            cluster.start_agent(node)
        token = await trio.to_thread.run_sync(lambda: cluster.token("chaos"))
        load = Load(
            "127.0.0.1",
            cluster.http_port,
            token,
            model=MODEL,
            rate=args.rate,
            streams=args.streams,
            stream_tokens=args.stream_tokens,
            spread_s=args.stream_tokens * args.output_token_ms / 1000,
        )
        bench = Bench(cluster, load, args.heartbeat_ttl_s, http_cap, args.output_token_ms)
        async with trio.open_nursery() as nursery:
            if not await trio.to_thread.run_sync(lambda: poll("full capacity", bench.full, FULL_TIMEOUT_S)):
                raise SystemExit("chaos: the cluster did not reach full capacity; see the logs under " + str(root))
            await nursery.start(load.run)
            with trio.move_on_after(FULL_TIMEOUT_S):
                await load.steady.wait()  # each stream slot has run one: the streams no longer run in step
            await bench.run(faults)
            nursery.cancel_scope.cancel()
        bench.watch_exits()
        return report(
            {
                "nodes": len(NODES),
                "network_namespaces": netns,
                "replicas": REPLICAS,
                "rate_per_s": args.rate,
                "streams": args.streams,
                "stream_tokens": args.stream_tokens,
                "output_token_ms": args.output_token_ms,
                "http_max_connections": http_cap,
                "heartbeat_interval_s": interval,
                "heartbeat_ttl_s": args.heartbeat_ttl_s,
            },
            bench,
            targets(bench.results, args.heartbeat_ttl_s, interval),
        )
    finally:
        await trio.to_thread.run_sync(cluster.close)


def main(argv: list[str]) -> int:
    if "--engine=llamacpp" in argv or ["--engine", "llamacpp"] in (argv[i : i + 2] for i in range(len(argv))):
        from bench import chaos_llama  # it imports this module: not at the top

        return chaos_llama.main(argv)  # its own options and defaults
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--json", action="store_true", help="print one JSON object (the default output too)")
    parser.add_argument(
        "--engine",
        choices=("sim", "llamacpp"),
        default="sim",
        help="llamacpp: real llama-server replicas of a made model, engine_kill and node_kill, each stream "
        "checked against the uninterrupted greedy answer (tools/bench/chaos_llama.py; --engine llamacpp --help)",
    )
    parser.add_argument(
        "--faults",
        help=f"comma-separated, in order (default: {','.join(FAULTS)}; with --store: {','.join(chaos_ha.FAULTS)})",
    )
    parser.add_argument("--rate", type=float, default=50.0, help="non-streamed requests a second (default 50)")
    parser.add_argument("--streams", type=int, default=20, help="streams in flight (default 20)")
    parser.add_argument(
        "--stream-tokens",
        type=int,
        default=60,
        help="tokens of each stream, exactly (ignore_eos): it lasts this many times --output-token-ms (default 60)",
    )
    parser.add_argument("--output-token-ms", type=int, default=10, help="the sim engine's time per token (default 10)")
    parser.add_argument("--heartbeat-interval-s", type=float, default=5.0, help="server.toml's (default 5)")
    parser.add_argument("--heartbeat-ttl-s", type=float, default=30.0, help="server.toml's (default 30)")
    parser.add_argument("--no-netns", action="store_true", help="nodes on loopback addresses even as root")
    parser.add_argument("--keep", action="store_true", help="keep the cluster's directory (logs) afterwards")
    ha = parser.add_argument_group("high availability (--store)")
    ha.add_argument(
        "--store",
        metavar="postgresql[://…]",
        help="run two control planes on this store, a standalone gateway and two nodes, with the faults "
        "leader_kill and store_away: 'postgresql' makes and starts a PostgreSQL cluster of its own "
        "(initdb in a temporary directory, on loopback; store_away stops it); a libpq url names an "
        "empty database of yours (no store_away)",
    )
    ha.add_argument(
        "--store-password-file", default="", help="the password of the --store url's role (default: libpq's files)"
    )
    ha.add_argument("--store-away-s", type=float, default=30.0, help="how long store_away stops PostgreSQL (30)")
    ha.add_argument("--lease-ttl-s", type=float, default=5.0, help="[store] lease_ttl_s (default 5, the product's)")
    ha.add_argument("--lease-renew-s", type=float, default=1.0, help="[store] lease_renew_s (default 1)")
    args = parser.parse_args(argv)
    if not 1 <= args.stream_tokens <= MAX_WORDS:
        # The sim continues a completions prompt that ends with at most MAX_WORDS words of its own
        # answer (simengine.continuation): a longer stream, moved, would not be continued exactly.
        parser.error(f"--stream-tokens {args.stream_tokens}: give 1 to {MAX_WORDS} (the sim's longest continuation)")
    if args.store is not None and args.store != "postgresql" and not args.store.startswith("postgresql://"):
        parser.error(f"--store {args.store!r}: give 'postgresql' or a postgresql:// url")
    return run_and_print(chaos_ha.main_async if args.store is not None else main_async, args, "llmgw-chaos-")


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
