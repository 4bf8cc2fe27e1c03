"""`llmgw up` as a newcomer runs it: one real process tree, a working gateway, a key that works,
Ctrl-C stops everything, and a second run reuses the state."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

from testlib import hostile
from testlib.ports import free_port
from testlib.proc import build_root, llmgw_env, run_llmgw
from testlib.up import start, stop

READY_TIMEOUT_S = 90


def chat(url: str, key: str) -> dict:
    body = json.dumps({"model": "sim-small", "messages": [{"role": "user", "content": "hello"}]}).encode()
    request = urllib.request.Request(
        f"{url}/v1/chat/completions",
        data=body,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def test_up_serves_a_sim_model_through_the_gateway_and_restarts_on_its_state(tmp_path: Path) -> None:
    state, port = tmp_path / "state", free_port()
    proc, ready = start(state, port)
    try:
        assert ready["gateway_url"] == f"http://127.0.0.1:{port}" and ready["api_key"]
        answer = chat(ready["gateway_url"], ready["api_key"])
        assert answer["choices"][0]["message"]["content"]
        # The crash first reported: half a request head, then FIN. It used to end `up` (exit 70).
        for _ in range(20):
            hostile.cut_at("127.0.0.1", port, b"GET /health HTTP/1.1\r\nHo", 24, how="fin")
        assert proc.poll() is None
        assert chat(ready["gateway_url"], ready["api_key"])["choices"][0]["message"]["content"]
    finally:
        code = stop(proc)
    assert code == 0
    proc, again = start(state, port)  # the same state: same CA, same key
    try:
        assert again["api_key"] == ready["api_key"]
        assert chat(again["gateway_url"], again["api_key"])["model"] == "sim-small"
        # The key `up` made is in the audit log, once (the second start kept it), and not its token.
        audit = run_llmgw("ctl", "audit", "--json", "--state-dir", str(state), timeout=60)
        entries = [(e["actor"], e["source"], e["action"], e["target"]) for e in json.loads(audit.stdout)]
        assert entries == [("admin", "local", "key.create", "llmgw-up")] and ready["api_key"] not in audit.stdout
    finally:
        assert stop(proc) == 0


def test_up_serves_a_gguf_file_with_the_real_llama_server(tmp_path: Path) -> None:
    from testlib.llama import llama_server
    from testlib.tinygguf import write_tiny_llama

    model = write_tiny_llama(tmp_path / "tiny.gguf")
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "llmgw",
            "up",
            "--state-dir",
            str(tmp_path / "state"),
            "--port",
            str(port),
            "--model",
            str(model),
            "--llama-server",
            llama_server(),
            "--json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=llmgw_env(),
    )
    try:
        assert proc.stdout is not None
        ready = next(e for e in map(json.loads, proc.stdout) if e["event"] == "ready")
        body = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 8}).encode()
        request = urllib.request.Request(
            f"{ready['gateway_url']}/v1/completions",
            data=body,
            headers={"Authorization": f"Bearer {ready['api_key']}", "Content-Type": "application/json"},
        )
        # The llama.cpp replica may still be loading when `ready` (which waits for the sim) comes:
        # the gateway queues the request until it is ready.
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                assert response.headers["x-llmgw-replica"].startswith("tiny-")
                answer = json.loads(response.read())
        except urllib.error.HTTPError as exc:  # the gateway's reason, not urllib's
            raise AssertionError(f"{exc.code}: {exc.read()[:2000]!r}") from None
        assert answer["choices"][0]["text"] is not None and answer["usage"]["completion_tokens"] > 0
    finally:
        assert stop(proc) == 0


def test_a_plain_up_logs_no_warning_from_start_to_ctrl_c(tmp_path: Path) -> None:
    state, port, log = tmp_path / "state", free_port(), tmp_path / "up.log"
    with log.open("w") as stderr:
        proc, ready = start(state, port, "--log-format", "json", stderr=stderr)
        try:
            assert chat(ready["gateway_url"], ready["api_key"])["choices"][0]["message"]["content"]
            nodes = json.loads(run_llmgw("ctl", "nodes", "--json", "--state-dir", str(state)).stdout)
            # No llama.cpp on a sim cluster: nothing "failed" that nobody asked for.
            assert [[(e["name"], e["ok"]) for e in n["engines"]] for n in nodes] == [[("sim", True)]]
            shown = run_llmgw("ctl", "nodes", "--state-dir", str(state))
            assert shown.returncode == 0 and "failed" not in shown.stdout, shown.stdout
        finally:
            code = stop(proc)
    assert code == 0
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert records[-1]["event"] == "up_stopped"
    assert [r for r in records if r["level"] in ("warning", "error")] == []
    said = [(r["event"], r.get("model"), r.get("reason")) for r in records if r["event"] == "replica_pending"]
    assert said and len(said) == len(set(said)), said  # each event once


def test_fabric_flags_after_a_plain_up_add_sim_big_and_a_plain_up_then_removes_it(tmp_path: Path) -> None:
    state, port = tmp_path / "state", free_port()
    proc, _ = start(state, port)
    assert stop(proc) == 0
    proc, ready = start(state, port, "--nodes", "3", "--fabric", "ib-a")
    try:
        [updated] = [e for e in ready["before"] if e["event"] == "config_updated"]
        assert updated["changes"] == ["added model sim-big: one replica across 2 nodes of fabric ib-a"]
        for _ in range(300):  # the two-node replica may still be meeting at its rendezvous
            replicas = json.loads(run_llmgw("ctl", "replicas", "--json", "--state-dir", str(state)).stdout)
            if any(r["model"] == "sim-big" and r["state"] == "ready" for r in replicas):
                break
        assert any(r["model"] == "sim-big" and r["state"] == "ready" for r in replicas), replicas
    finally:
        assert stop(proc) == 0
    proc, ready = start(state, port)  # a plain `up` again: one node, no fabric, no sim-big
    try:
        [updated] = [e for e in ready["before"] if e["event"] == "config_updated"]
        assert updated["changes"][0].startswith("removed model sim-big: its replica spans 2 nodes of a fabric")
        models = json.loads(run_llmgw("ctl", "models", "--json", "--state-dir", str(state)).stdout)
        assert [m["model"] for m in models] == ["sim-small"]
    finally:
        assert stop(proc) == 0


def test_up_with_nodes_on_a_simulated_fabric_runs_a_two_node_replica(tmp_path: Path) -> None:
    state, port = tmp_path / "state", free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "llmgw",
            "up",
            "--state-dir",
            str(state),
            "--port",
            str(port),
            "--nodes",
            "2",
            "--fabric",
            "ib-a",
            "--json",
        ],
        stdout=subprocess.PIPE,
        stderr=(tmp_path / "up.log").open("w"),  # read into a failure's message: the cause, once seen
        text=True,
        env=llmgw_env(),
    )

    def log() -> str:
        return "up's log ends:\n" + "\n".join((tmp_path / "up.log").read_text(errors="replace").splitlines()[-40:])

    try:
        assert proc.stdout is not None
        joined = set()
        for event in map(json.loads, proc.stdout):
            joined |= {event["node"]} if event["event"] == "node_joined" else set()
            if event["event"] == "ready":
                break
        assert joined == {"local-1", "local-2"}, log()
        nodes = json.loads(run_llmgw("ctl", "nodes", "--json", "--state-dir", str(state)).stdout)
        assert {n["address"] for n in nodes} == {"127.0.0.1", "127.0.0.2"}
        assert all(f["name"] == "ib-a" for n in nodes for f in n["fabrics"]) and all(n["fabrics"] for n in nodes)
        for _ in range(300):  # the two-node replica may still be meeting at its rendezvous
            replicas = json.loads(run_llmgw("ctl", "replicas", "--json", "--state-dir", str(state)).stdout)
            big = [r for r in replicas if r["model"] == "sim-big"]
            if big and big[0]["state"] == "ready":
                break
        assert (
            big and big[0]["state"] == "ready" and sorted(big[0]["nodes"]) == ["local-1", "local-2"]
        ), f"{replicas}\n{log()}"
    finally:
        assert stop(proc) == 0, log()


def quickstart_commands() -> list[str]:
    """Every `./llmgw` command docs/quickstart.md shows: lines of its code blocks, and inline code."""
    text = (build_root() / "docs" / "quickstart.md").read_text()
    blocks = re.findall(r"^```\n(.*?)^```", text, flags=re.M | re.S)
    lines = [line for block in blocks for line in block.splitlines() if line.startswith("./llmgw ")]
    prose = re.sub(r"^```\n.*?^```", "", text, flags=re.M | re.S)  # inline code of the prose only
    inline = re.findall(r"`(\./llmgw [^`]+)`", prose)
    return lines + [c for c in inline if c not in lines]


def as_run_here(command: str, home: Path) -> list[str]:
    """A printed or documented `./llmgw ...` command as this test runs it: the checkout's script
    (which builds and execs dist/llmgw.pex; tests/llmgw/test_llmgw_script.py tests it) becomes
    this interpreter running llmgw, and `~` is the HOME the command runs with, as a shell does."""
    argv = shlex.split(command)
    assert argv[0] == "./llmgw", command
    return [sys.executable, "-m", "llmgw", *(str(home) + a[1:] if a.startswith("~/") else a for a in argv[1:])]


def test_the_quickstarts_commands_work_as_printed_while_up_runs(tmp_path: Path) -> None:
    documented = quickstart_commands()
    [up] = [c for c in documented if c.startswith("./llmgw up --nodes 3 --fabric ib-a")]
    ctl = [c for c in documented if c.startswith("./llmgw ctl ")]
    assert len(ctl) >= 4, documented  # nodes, replicas, drain, reload
    home = tmp_path / "home"
    home.mkdir()
    env = llmgw_env({"HOME": str(home), "LLMGW_INVOKED_AS": "./llmgw"})  # what ./llmgw sets
    env.pop("XDG_DATA_HOME", None)  # the quickstart's default state directory, under this HOME
    state = home / ".local" / "share" / "llmgw" / "up"
    port = free_port()  # not part of what is printed; 8080 may be taken where tests run
    proc = subprocess.Popen(
        [*as_run_here(up, home), "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=(tmp_path / "up.log").open("w"),  # read into a failure's message: the cause, once seen
        text=True,
        env=env,
    )
    try:
        printed = []
        assert proc.stdout is not None
        for line in proc.stdout:  # bounded: `up` gives up after its ready timeout
            printed.append(line.rstrip("\n"))
            if line.startswith("Ctrl-C stops everything"):
                break
        operate = [line.strip() for line in printed if line.startswith("  ./llmgw ")]
        assert operate == [
            f"./llmgw ctl nodes --state-dir {state}",
            f"./llmgw ctl replicas --state-dir {state}",
        ], printed
        for command in operate + ctl:
            done = subprocess.run(as_run_here(command, home), capture_output=True, text=True, env=env, timeout=120)
            assert done.returncode == 0, (
                f"`{command}` exited {done.returncode}:\n{done.stdout}\n{done.stderr}\nup's log ends:\n"
                + "\n".join((tmp_path / "up.log").read_text(errors="replace").splitlines()[-40:])
            )
            assert done.stdout.strip(), command
        nodes = subprocess.run(as_run_here(operate[0], home), capture_output=True, text=True, env=env, timeout=60)
        assert "local-2" in nodes.stdout and "cordoned" in nodes.stdout  # the drain ran: cordoned and empty
    finally:
        assert stop(proc) == 0
