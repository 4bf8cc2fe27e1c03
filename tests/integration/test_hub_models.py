"""A model by its Hub name, on a real cluster on loopback: `llmgw server` with `[hub] endpoint`
naming a Hub-compatible server the test runs (testlib.hubserver: redirects to a storage port,
ranged downloads, gated repositories), an agent with a real llama-server, and `llmgw ctl models`.

One cluster for the module (its start and the engine's are most of the cost): models are added,
served through the gateway, refused with what to fix, removed with their files, and found again
after the control plane restarts. The token of a gated repository reaches no log, no `ctl`
output and no process's command line.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import re
import shlex
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from testlib.browser import Chromium, no_console_errors, open_tab, unlabelled_controls
from testlib.cluster import OPERATORS_LLAMACPP, Cluster, wait_until
from testlib.hubrepos import gguf_repo, safetensors_repo
from testlib.hubserver import HubServer
from testlib.llama import llama_server
from testlib.proc import build_root, run_llmgw, tails

READY_S = 120.0  # download, the engine's start and the model's load, on a loaded 2-core machine
GGUF = "llmgw-tests/Tiny-Llama-GGUF"
GATED = "llmgw-tests/Gated-Llama-GGUF"
TOKEN = "hf_llmgwtestsgatedtoken0123456789"
DOCUMENTED = "Qwen/Qwen3-0.6B-GGUF"
ENGINE_ARGS = ("--args", "--ctx-size", "512", "--threads", "1", "--parallel", "1")


@attrs.frozen
class Live:
    cluster: Cluster
    hub: HubServer
    http_port: int
    key: str


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    root = tmp_path_factory.mktemp("hub")
    repos = [
        gguf_repo(GGUF),
        gguf_repo(GATED, gated="manual", token=TOKEN),
        gguf_repo(DOCUMENTED, model="Qwen3-0.6B"),  # the repository the docs' commands name
        safetensors_repo(),
    ]
    with HubServer(repos) as hub:
        cluster = Cluster(
            root,
            server_toml="gateway_workers = 1\n",
            fixed_http_port=True,
            engines_toml=OPERATORS_LLAMACPP + f'[hub]\nendpoint = "{hub.url}"\n',
        )
        try:
            cluster.init_ca()
            cluster.add_node("n1", f'llamacpp_bin = "{llama_server()}"\n')
            server = cluster.start_server()
            cluster.start_agent("n1")
            cluster.wait_nodes("n1 to join with llama.cpp", lambda ns: _has_llama(ns.get("n1")))
            admin_url = server.events("server_ready")[0]["admin_url"]
            yield Live(
                cluster=cluster,
                hub=hub,
                http_port=int(admin_url.rsplit(":", 1)[1]),
                key=cluster.ctl("keys", "create", "hub-tests")["token"],
            )
        finally:
            cluster.close()


def _has_llama(node: dict[str, Any] | None) -> bool:
    return bool(
        node and node["state"] == "joined" and any(e["name"] == "llamacpp" and e["ok"] for e in node["engines"])
    )


def models(live: Live, *args: str, ok: bool = True) -> subprocess.CompletedProcess:
    """`llmgw ctl models ARGS` (the admin options before ARGS: `--args` takes what follows)."""
    done = run_llmgw("ctl", "models", *args[:1], "--state-dir", str(live.cluster.state), *args[1:], timeout=120)
    if ok and done.returncode != 0:
        raise AssertionError(
            f"ctl models {' '.join(args)} exited {done.returncode}: {done.stderr}\n{tails(live.cluster.latest())}"
        )
    return done


def listed(live: Live) -> dict[str, dict[str, Any]]:
    return {m["model"]: m for m in json.loads(models(live, "list", "--json").stdout)}


def chat(live: Live, model: str) -> dict[str, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", live.http_port, timeout=60)
    try:
        body = {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
        conn.request(
            "POST",
            "/v1/chat/completions",
            body=json.dumps(body),
            headers={"content-type": "application/json", "authorization": f"Bearer {live.key}"},
        )
        response = conn.getresponse()
        data = json.loads(response.read() or b"{}")
    finally:
        conn.close()
    assert response.status == 200, data
    return data


def wait_ready(live: Live, model: str) -> None:
    live.cluster.wait_replicas(
        f"a replica of {model} to be ready",
        lambda rs: any(r["model"] == model and r["state"] == "ready" for r in rs),
        timeout=READY_S,
    )


def test_a_gguf_model_by_name_is_pinned_downloaded_verified_and_served(live: Live) -> None:
    done = models(live, "add", "tiny", "--hf", GGUF, "--quant", "Q4_K_M", "--json", *ENGINE_ARGS)
    added = json.loads(done.stdout)
    repo = live.hub.repos[GGUF]
    commit = repo.resolve("main")
    assert added["commit"] == commit.sha and added["revision"] == "main"
    [f] = added["files"]
    content = commit.files[f["path"]].content
    assert f["path"] == "Tiny-Llama-Q4_K_M.gguf" and f["size"] == len(content)
    assert f["sha256"] == hashlib.sha256(content).hexdigest()
    # Sized from its own header: the weights are the tensors, the cache 512 tokens of 2 layers.
    e = added["estimate"]
    assert 0 < e["weights_bytes"] < len(content) <= e["total_bytes"] and e["context"] == 512
    assert listed(live)["tiny"]["from"] == "hub"
    wait_ready(live, "tiny")
    assert chat(live, "tiny")["choices"][0]["message"]["content"] is not None
    # The file crossed to the node once, from the storage port the Hub redirected to, in pieces: one
    # request from its first piece to its end. The other request, the same, is the control plane's
    # read of its header to size it (this tiny file is smaller than the header's first read).
    crossed = live.hub.log.requests(kind="cdn", path=f["path"])
    assert [(r.status, r.range) for r in crossed] == [(206, f"bytes=0-{len(content) - 1}")] * 2, crossed


def test_the_node_reports_its_cache_and_staging_asks_only_nodes_lacking_the_files(live: Live) -> None:
    # n1 serves tiny: its cache holds the file, and it told the control plane so.
    [f] = listed(live)["tiny"]["files"]
    node = wait_until(
        "n1 to report tiny's file in its weights cache",
        lambda: (n := (live.cluster.nodes() or {}).get("n1")) and n["weights"]["files"] >= 1 and n,
        procs=live.cluster.latest(),
    )
    assert node["weights"]["bytes"] >= f["size"] and node["weights"]["free_bytes"] > 0
    done = json.loads(models(live, "stage", "tiny", "--nodes", "n1", "--json").stdout)
    assert done == {"model": "tiny", "staging": [], "holding": ["n1"]}
    refused = models(live, "stage", "tiny", "--nodes", "n9", ok=False)
    assert refused.returncode != 0 and "no node n9" in refused.stderr


def test_split_parts_are_fetched_together_and_the_engine_loads_the_first(live: Live) -> None:
    added = json.loads(
        models(live, "add", "tiny-split", "--hf", GGUF, "--quant", "Q6_K", "--json", *ENGINE_ARGS).stdout
    )
    assert [f["path"] for f in added["files"]] == [
        "Tiny-Llama-Q6_K-00001-of-00002.gguf",
        "Tiny-Llama-Q6_K-00002-of-00002.gguf",
    ]
    wait_ready(live, "tiny-split")
    chat(live, "tiny-split")


def test_bad_input_names_the_problem_and_the_fix_and_changes_nothing(live: Live) -> None:
    before = set(listed(live))
    cases = [
        (("add", "x1", "--hf", "llmgw-tests/No-Such-Repo"), "no repository llmgw-tests/No-Such-Repo"),
        (("add", "x2", "--hf", GGUF, "--revision", "v9"), "no revision 'v9'"),
        (("add", "x3", "--hf", GGUF), "pick one with --quant"),
        (("add", "x4", "--hf", GGUF, "--quant", "Q2_K"), "has no Q2_K quantisation"),
        (("add", "x5", "--hf", GGUF, "--file", "*.bin"), "matches no GGUF model"),
        (("add", "x6", "--hf", "not a repo"), "ORG/NAME"),
        (
            ("add", "x7", "--hf", GGUF, "--quant", "Q8_0", "--engine", "vllm"),
            "--quant picks one of a repository's GGUF",
        ),
        (("add", "x8", "--hf", GGUF, "--quant", "Q8_0", "--args", "--port", "9"), "--port"),
        (("add", "x9", "--hf", GGUF, "--quant", "Q8_0", "--memory-gb", "100000"), "fits no node"),
    ]
    for args, says in cases:
        done = models(live, *args, ok=False)
        assert done.returncode != 0 and says in done.stderr, (args, done.stderr)
    assert set(listed(live)) == before


def test_a_gated_repository_takes_a_token_that_is_never_shown(live: Live, tmp_path: Path) -> None:
    refused = models(live, "add", "gated", "--hf", GATED, "--quant", "Q4_K_M", ok=False)
    assert refused.returncode != 0 and "gated" in refused.stderr and "--token-file" in refused.stderr
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    done = models(
        live, "add", "gated", "--hf", GATED, "--quant", "Q4_K_M", "--token-file", str(token_file), *ENGINE_ARGS
    )
    wait_ready(live, "gated")
    chat(live, "gated")
    shown = done.stdout + done.stderr + models(live, "list", "--json").stdout
    assert TOKEN not in shown and json.loads(models(live, "list", "--json").stdout)
    assert listed(live)["gated"]["token"] == "set"
    # Not in any file of the cluster: logs, the store (sealed there), the agents' state, engine logs.
    for path in live.cluster.root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            assert TOKEN.encode() not in path.read_bytes(), path
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            assert TOKEN.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue  # gone meanwhile
    # The agent sent it to the Hub (never to the storage port), and its downloads were granted.
    granted = [r for r in live.hub.log.requests(repo_id=GATED, kind="resolve") if r.status in (200, 206, 302)]
    assert granted and all(r.authorization == f"Bearer {TOKEN}" for r in granted)
    assert not [r for r in live.hub.log.requests(kind="cdn") if r.authorization]


def test_removed_model_stops_and_its_files_leave_the_node(live: Live) -> None:
    added = json.loads(models(live, "add", "to-remove", "--hf", GGUF, "--quant", "Q8_0", "--json", *ENGINE_ARGS).stdout)
    wait_ready(live, "to-remove")
    [f] = added["files"]
    weights = live.cluster.nodes_files["n1"].state_dir / "weights"
    assert (weights / f["sha256"] / f["path"]).is_file()
    models(live, "remove", "to-remove")
    live.cluster.wait_replicas("to-remove's replica to stop", lambda rs: all(r["model"] != "to-remove" for r in rs))
    wait_until(
        "the node to delete to-remove's file",
        lambda: not (weights / f["sha256"]).exists() or None,
        procs=live.cluster.latest(),
    )
    assert "to-remove" not in listed(live)
    again = models(live, "remove", "to-remove", ok=False)
    assert again.returncode != 0 and "no model to-remove" in again.stderr


def documented_commands(doc: str, heading: str) -> list[list[str]]:
    """The `llmgw ctl models` lines of the ```sh block under `heading` in docs/`doc`, as argv."""
    text = (build_root() / "docs" / doc).read_text()
    section = text.split(heading, 1)[1]
    block = re.search(r"^```sh\n(.*?)^```", section, flags=re.M | re.S)
    assert block, f"docs/{doc} has no sh block under {heading!r}"
    out = []
    for line in block.group(1).splitlines():
        argv = shlex.split(line.split("#", 1)[0])
        if argv[:1] in (["llmgw"], ["./llmgw"]) and argv[1:3] == ["ctl", "models"]:
            out.append(argv[3:])
    return out


def test_the_documented_commands_work_as_written(live: Live) -> None:
    """docs/configuration.md's and the quickstart's commands, against the test Hub holding the
    repository they name (the state directory given as this cluster's)."""
    for doc, heading in (
        ("configuration.md", "### Models from the Hub"),
        ("quickstart.md", "## A model from the Hugging Face Hub"),
    ):
        commands = documented_commands(doc, heading)
        assert any(c[:1] == ["add"] for c in commands), (doc, commands)
        for argv in commands:
            if "--state-dir" in argv:  # the quickstart's, for `up`'s default directory
                at = argv.index("--state-dir")
                argv = argv[:at] + argv[at + 2 :]
            done = models(live, *(argv or ["list"]))
            assert done.stdout.strip(), argv
            if argv[:1] == ["search"]:
                assert DOCUMENTED in done.stdout and "Q8_0" in done.stdout, done.stdout
    wait_ready(live, "qwen3")
    chat(live, "qwen3")


async def add_and_remove_on_the_page(live: Live) -> None:
    url = run_llmgw("ctl", "page", "--actions", "--state-dir", str(live.cluster.state)).stdout.split()[0]
    browser = Chromium(live.cluster.root / "chromium")
    try:
        async with open_tab(browser) as tab:
            await tab.goto(url)
            await tab.wait_for("!document.getElementById('add-model').hidden && document.getElementById('model-tiny')")
            # Search, take a result's quantisation into the form, name it, add it.
            await tab.evaluate(
                "document.getElementById('hub-search-text').value = 'Tiny-Llama';"
                "document.getElementById('hub-search-go').click()"
            )
            use = f'document.querySelector(\'[data-repo="{GGUF}"] button[aria-label$="Q8_0"]\')'
            await tab.wait_for(use, 30)
            await tab.evaluate(f"{use}.click()")
            assert await tab.evaluate("document.getElementById('add-repo').value") == GGUF
            assert await tab.evaluate("document.getElementById('add-quant').value") == "Q8_0"
            await tab.evaluate(
                "document.getElementById('add-name').value = 'from-page';"
                "document.getElementById('add-model-go').click()"
            )
            await tab.wait_for("document.querySelector('[data-source=\"from-page\"]')", 60)
            # The page's feed may show the model before the add's own answer says so: wait for both.
            await tab.wait_for("!document.getElementById('message').textContent.startsWith('Adding ')", 60)
            message = await tab.evaluate("document.getElementById('message').textContent")
            assert message.startswith("Added from-page: " + GGUF), message
            assert await unlabelled_controls(tab) == []
            # Its Remove button asks first; confirmed, the model leaves the page.
            await tab.evaluate("document.getElementById('remove-from-page').click()")
            await tab.wait_for("document.getElementById('confirm').open")
            await tab.evaluate("document.getElementById('confirm-ok').click()")
            await tab.wait_for("!document.getElementById('model-from-page')", 60)
            no_console_errors(tab)
    finally:
        browser.close()


def test_the_page_searches_adds_and_removes_a_model(live: Live) -> None:
    trio.run(add_and_remove_on_the_page, live)
    assert "from-page" not in listed(live)
    done = live.cluster.server.events("admin_call") if live.cluster.server else []
    assert [e["status"] for e in done if e["path"] == "/admin/v1/models" and e["method"] == "POST"][-1:] == [201]


def test_the_catalog_survives_a_control_plane_restart(live: Live) -> None:
    before = listed(live)
    assert {"tiny", "tiny-split"} <= set(before)
    cluster = live.cluster
    assert cluster.server is not None and cluster.server.stop(signal.SIGTERM) == 0
    cluster.start_server()
    cluster.wait_nodes("n1 to come back", lambda ns: _has_llama(ns.get("n1")))
    after = listed(live)
    assert {k: (v["commit"], v["files"]) for k, v in after.items() if v["from"] == "hub"} == {
        k: (v["commit"], v["files"]) for k, v in before.items() if v["from"] == "hub"
    }
