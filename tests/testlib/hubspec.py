"""testlib.hubserver as a process of its own, for integration tests that run real llmgw
processes: the spec file that defines its repos, the command line, a remote control for its
faults and log, and `HubProcess`, which runs it.

The spec (JSON; unknown keys are errors, file paths relative to the spec's directory):

    {"users": ["hf_valid_but_granted_nothing"],
     "repos": [{"id": "org/model", "files": {"README.md": "readme.md", ...},
                "gated": false, "private": false, "disabled": false, "tokens": [], "tags": [],
                "lfs_patterns": ["*.gguf"], "lfs_threshold": 10485760,
                "commits": [{"files": {...}, "parent": null, "replace": true, "delete": [],
                             "message": "...", "branches": ["main"], "tags": ["v1"], "prs": [1]}]}],
     "faults": [{"kind": "cut", "target": "model.gguf", "after": 1000, "times": 1}]}

"files" is a first commit on main; each of "commits" is made on the one before it (or
"parent": a sha or null) and the refs it lists point at it. `write_spec` writes one from HubRepos.

Remote control (on the hub's port): GET /_hubserver/log (the requests, as JSON), POST
/_hubserver/faults (a fault as in the spec), POST /_hubserver/release (every stall goes on).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import attrs

from testlib.hubfaults import Fault
from testlib.hubrepo import DEFAULT_LFS_PATTERNS, DEFAULT_LFS_THRESHOLD, HubRepo
from testlib.hubserver import HubServer

REPO_KEYS = {"id", "files", "commits", "gated", "private", "disabled", "tokens", "tags", "pipeline_tag",
             "library_name", "lfs_patterns", "lfs_threshold"}  # fmt: skip
COMMIT_KEYS = {"files", "parent", "replace", "delete", "message", "branches", "tags", "prs"}
FAULT_KEYS = {"kind", "target", "repo", "times", "after", "at", "status", "where"}


class SpecError(ValueError):
    pass


def _keys(value: object, allowed: set[str], where: str) -> dict:
    if not isinstance(value, dict):
        raise SpecError(f"{where}: expected an object, got {type(value).__name__}")
    if extra := set(value) - allowed:
        raise SpecError(f"{where}: unknown keys {sorted(extra)}; allowed: {sorted(allowed)}")
    return value


def load_spec(path: Path) -> tuple[list[HubRepo], list[str], list[dict]]:
    """The repos, users and faults a spec file defines."""
    spec = _keys(json.loads(path.read_text()), {"repos", "users", "faults"}, f"{path}: $")
    base = path.parent

    def read(files: dict, where: str) -> dict[str, bytes]:
        try:
            return {name: (base / disk).read_bytes() for name, disk in _keys(files, set(files), where).items()}
        except OSError as e:
            raise SpecError(f"{where}: {e}; give paths relative to {base}") from e

    repos = []
    for i, entry in enumerate(spec.get("repos", [])):
        where = f"{path}: $.repos[{i}]"
        entry = _keys(entry, REPO_KEYS, where)
        repo = HubRepo(
            entry["id"],
            read(entry["files"], f"{where}.files") if "files" in entry else None,
            **{
                k: entry[k]
                for k in ("gated", "private", "disabled", "tokens", "tags", "pipeline_tag", "library_name")
                if k in entry
            },  # fmt: skip
            lfs_patterns=entry.get("lfs_patterns", DEFAULT_LFS_PATTERNS),
            lfs_threshold=entry.get("lfs_threshold", DEFAULT_LFS_THRESHOLD),
        )
        previous = repo.branches.get("main")
        for j, c in enumerate(entry.get("commits", [])):
            c = _keys(c, COMMIT_KEYS, f"{where}.commits[{j}]")
            commit = repo.add_commit(
                read(c.get("files", {}), f"{where}.commits[{j}].files"),
                parent=c.get("parent", previous),
                replace=c.get("replace", False),
                delete=c.get("delete", ()),
                message=c.get("message"),
            )
            previous = commit.sha
            for name in c.get("branches", []):
                repo.branches[name] = commit.sha
            for name in c.get("tags", []):
                repo.tag_refs[name] = commit.sha
            for number in c.get("prs", []):
                repo.branches[f"refs/pr/{number}"] = commit.sha
        if not repo.branches.get("main"):
            raise SpecError(f'{where}: no commit on main; give "files" or a commit with "branches": ["main"]')
        repos.append(repo)
    faults = [_keys(f, FAULT_KEYS, f"{path}: $.faults[{i}]") for i, f in enumerate(spec.get("faults", []))]
    return repos, list(spec.get("users", [])), faults


def write_spec(
    repos: Iterable[HubRepo], directory: Path, *, users: Iterable[str] = (), faults: Iterable[dict] = ()
) -> Path:
    """A spec for `repos` in `directory` (their files under blobs/, by sha256); its path. The
    process's repos have the same commit shas as these."""
    (directory / "blobs").mkdir(parents=True, exist_ok=True)
    entries = []
    for repo in repos:
        refs: dict[str, dict[str, list]] = {}
        for name, sha in repo.branches.items():
            kind, name = ("prs", int(name.split("/")[-1])) if name.startswith("refs/pr/") else ("branches", name)
            refs.setdefault(sha, {}).setdefault(kind, []).append(name)
        for name, sha in repo.tag_refs.items():
            refs.setdefault(sha, {}).setdefault("tags", []).append(name)
        commits = []
        for commit in repo.commits.values():
            files = {}
            for path, blob in commit.files.items():
                disk = directory / "blobs" / blob.sha256
                if not disk.exists():
                    disk.write_bytes(blob.content)
                files[path] = f"blobs/{blob.sha256}"
            commits.append({"files": files, "parent": commit.parent, "replace": True, "message": commit.message,
                            **refs.get(commit.sha, {})})  # fmt: skip
        entries.append({
            "id": repo.repo_id, "gated": repo.gated, "private": repo.private, "disabled": repo.disabled,
            "tokens": sorted(repo.tokens), "tags": repo.tags, "pipeline_tag": repo.pipeline_tag,
            "library_name": repo.library_name, "lfs_patterns": list(repo.lfs_patterns),
            "lfs_threshold": repo.lfs_threshold, "commits": commits,
        })  # fmt: skip
    spec = directory / "hubspec.json"
    spec.write_text(json.dumps({"repos": entries, "users": list(users), "faults": list(faults)}, indent=1))
    return spec


def arm(hub: HubServer, fault: dict) -> Fault:
    """A fault given as in the spec: {"kind": "cut", "target": ..., "after": N, ...}."""
    fault = _keys(dict(fault), FAULT_KEYS, "fault")
    kind = fault.pop("kind", None)
    method = getattr(hub.faults, kind, None) if kind in ("cut", "stall", "corrupt", "fail", "refuse_range") else None
    if method is None:
        raise SpecError(f"fault kind {kind!r}: give one of cut, stall, corrupt, fail, refuse_range")
    target = fault.pop("target")
    try:
        return method(target, **fault)
    except TypeError as e:
        raise SpecError(f"fault {kind} on {target!r}: {e}") from e


def admin(hub: HubServer, method: str, what: str, body: bytes) -> tuple[object, int]:
    """The remote control's answers: (JSON value, status)."""
    if method == "GET" and what == "log":
        return [attrs.asdict(s, filter=lambda a, _: a.name != "finished") for s in hub.log], 200
    if method == "POST" and what == "faults":
        try:
            arm(hub, json.loads(body))
        except (SpecError, ValueError, KeyError) as e:
            return {"error": str(e)}, 400
        return {"armed": True}, 200
    if method == "POST" and what == "release":
        hub.faults.release_all()
        return {"released": True}, 200
    return {"error": f"no {method} /_hubserver/{what}; see testlib.hubspec"}, 404


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testlib.hubserver", description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", type=Path, required=True, help="the repos (JSON; see testlib.hubspec)")
    parser.add_argument("--port-file", type=Path, help="written with the port once listening")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        repos, users, faults = load_spec(args.spec)
    except (SpecError, ValueError, OSError) as e:
        print(f"hubserver: bad spec {args.spec}: {e}", file=sys.stderr)
        return 2
    # Only sigwait below sees these: the server's threads inherit the mask.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    with HubServer(repos, users=users, host=args.host, port=args.port) as hub:
        for fault in faults:
            arm(hub, fault)
        port = hub.url.rsplit(":", 1)[1]
        if args.port_file:
            temporary = args.port_file.with_name(args.port_file.name + ".tmp")
            temporary.write_text(port + "\n")
            os.replace(temporary, args.port_file)  # readers see the whole port or no file
        print(f"hubserver listening on {hub.url} (CDN {hub.cdn_url})", flush=True)
        signal.sigwait({signal.SIGTERM, signal.SIGINT})
    return 0


class HubProcess:
    """`python -m testlib.hubserver` on a spec: `url` once it listens; stopped by SIGTERM."""

    def __init__(self, spec: Path, *, port_file: Path | None = None, python: str = sys.executable) -> None:
        self.spec = spec
        self.port_file = port_file or spec.with_name("hubserver.port")
        self.python = python
        self.process: subprocess.Popen[str] | None = None
        self.url = ""

    def __enter__(self) -> HubProcess:
        tests = str(Path(__file__).resolve().parent.parent)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}
        command = [self.python, "-m", "testlib.hubserver", "--spec", str(self.spec), "--port-file", str(self.port_file)]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)
        assert self.process.stdout is not None
        line = self.process.stdout.readline()  # the child's first line says it listens, or EOF: it died
        if not line.startswith("hubserver listening on "):
            code = self.process.wait()
            raise RuntimeError(f"hubserver exited {code} before listening ({command}); its stderr is above")
        self.url = line.split()[3]
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=30)
        assert self.process.stdout is not None
        self.process.stdout.close()
