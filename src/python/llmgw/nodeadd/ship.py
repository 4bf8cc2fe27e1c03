"""The `ship`, `doctor` and `fabrics` steps of `llmgw node add`: what the node gets to run, and
what it has.

`choose` decides where the release comes from (release.py): by default the node downloads it
from the control plane's agent port (`fetch_from_plane`: python3 on the node, the server checked
against the CA root node add puts in the stage for that one download, never the node's system
trust), else it is copied over SSH. Nothing here changes the node outside its stage: the
release is staged in a private directory
under /tmp (layout.STAGE_PREFIX), its sha256 checked on the node before anything runs it, and
doctor run from the stage, its report deciding whether the run goes on (`tried`: the release runs
there, for a machine that gets no doctor). `fabrics` names the
adapter groups doctor found, asking the operator (questions.py) for names not given.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import trio

from llmgw import config as cfg
from llmgw import driverpaths
from llmgw.errors import MachineError, PeerError, UsageError
from llmgw.nodeadd import layout, ssh
from llmgw.nodeadd.context import DOCTOR_S, FETCH_S, SHORT_S, Facts, Options, put_text, said, staged_llmgw
from llmgw.nodeadd.questions import DoctorFailure, Questions
from llmgw.nodeadd.release import HTTPS, Artifact, find_artifact, from_plane, how_to_ship, local_release
from llmgw.nodeadd.steps import OK, WARN
from llmgw.wire.agent_link import FabricGroup

# -- ship ----------------------------------------------------------------------------------

MAX_RELEASE_BYTES = 1 << 30  # a release file is tens of MB; the node stops a download past this
# Run by the node's python3 (-I: nothing from its environment or user site): download argv[1]
# to argv[3] (created, never overwritten), trusting the CA root in argv[2] alone and no proxy;
# the exit status says what went wrong (FETCH_* below). Python 3.7+, as old as a node may have.
FETCH_PY = """
import ssl, sys, urllib.error, urllib.request
url, cafile, dest, cap = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
def fail(code, text):
    sys.stderr.write(text + "\\n")
    sys.exit(code)
try:
    ctx = ssl.create_default_context(cafile=cafile)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=ctx))
    with opener.open(url, timeout=30) as r, open(dest, "xb") as f:
        n = 0
        while True:
            block = r.read(1 << 20)
            if not block:
                break
            n += len(block)
            if n > cap:
                fail(4, "more than %d bytes" % cap)
            f.write(block)
except urllib.error.HTTPError as e:
    fail(5, "HTTP %d: %s" % (e.code, e.read(600).decode("utf-8", "replace").strip()))
except urllib.error.URLError as e:
    if isinstance(e.reason, ssl.SSLCertVerificationError):
        fail(3, e.reason.verify_message or str(e.reason))
    fail(2, str(e.reason))
except ssl.SSLCertVerificationError as e:
    fail(3, e.verify_message or str(e))
except OSError as e:
    fail(2, str(e))
"""
FETCH_UNREACHABLE, FETCH_NOT_OURS, FETCH_TOO_BIG, FETCH_HTTP = 2, 3, 4, 5


async def choose(opts: Options, facts: Facts, ca_pem: bytes) -> str:
    """Set `facts.artifact` (`--release`, the control plane's, or one copied over SSH); returns
    why the file goes over SSH when the default fell back to it, else ""."""
    way = how_to_ship(release=opts.release, via=opts.release_via, plane_serves=opts.server_config.release.serve)
    if way == "given":
        facts.artifact = await trio.to_thread.run_sync(find_artifact, opts.release, facts.arch)
        return ""
    why = ""
    if way == HTTPS:
        art, why = await trio.to_thread.run_sync(from_plane, facts.address, facts.port, ca_pem, facts.arch)
        if art is not None:
            facts.artifact = art
            return ""
        if opts.release_via == HTTPS:
            raise UsageError(
                f"--release-via https: the control plane holds no release for this {facts.arch} node: {why}"
            )
    try:
        facts.artifact = await trio.to_thread.run_sync(local_release, opts.server_config.release.dir, facts.arch)
    except UsageError as exc:
        raise UsageError(
            f"{exc}" + (f" (the control plane serves none for the node either: {why})" if why else "")
        ) from None
    return f"the control plane serves no {facts.arch} release ({why}), so it went over SSH" if why else ""


async def ship(s: ssh.Session, facts: Facts, ca_pem: bytes = b"") -> None:
    art = facts.artifact
    assert art is not None
    res = await s.run(["mktemp", "-d", f"{layout.STAGE_PREFIX}XXXXXXXX"], timeout_s=SHORT_S)
    stage = res.stdout.strip()
    if res.exit_status != 0 or not stage.startswith(layout.STAGE_PREFIX) or "/" in stage[len("/tmp/") :]:
        raise PeerError(f"{s.target}: cannot make a staging directory under /tmp ({said(res)})")
    facts.stage = stage
    staged = f"{stage}/llmgw"
    if art.path is not None:
        await s.put(art.path, staged, mode=0o755, timeout_s=FETCH_S)
    elif art.from_plane:
        await fetch_from_plane(s, art, staged, ca_pem)
    else:
        await _fetch_on_node(s, art.url, staged)
    actual = await _remote_sha256(s, staged)
    if actual != art.sha256:
        fix = (
            "The control plane's file is not the one its SHA256SUMS lists (damaged on its disk, or replaced): "
            "download the release again into its directory ([release] dir, docs/install.md)"
            if art.from_plane
            else "The transfer was damaged or the file at the source changed: run again"
        )
        raise PeerError(
            f"{s.target}: {art.name} arrived with sha256 {actual or 'unreadable'}, not {art.sha256}; "
            f"nothing ran it. {fix}"
        )
    facts.installed_sha256 = await _remote_sha256(s, layout.BIN)
    res = await s.run(["mkdir", "-m", "0700", f"{stage}/pyz"], sudo=True, timeout_s=SHORT_S)
    if res.exit_status != 0:
        raise PeerError(f"{s.target}: cannot make {stage}/pyz ({said(res)})")


async def fetch_from_plane(s: ssh.Session, art: Artifact, dest: str, ca_pem: bytes) -> None:
    """The node downloads `art` from the control plane, the server checked against `ca_pem`
    (put in the stage for this download only)."""
    ca_file = dest.rsplit("/", 1)[0] + "/release-ca.crt"
    await put_text(s, ca_pem.decode(), ca_file, mode=0o644)
    res = await s.run(
        ["python3", "-I", "-c", FETCH_PY, art.url, ca_file, dest, str(MAX_RELEASE_BYTES)], timeout_s=FETCH_S
    )
    err = (res.stderr.strip().splitlines() or [""])[-1]
    origin = art.url.split("/v1/", 1)[0]
    if res.exit_status == 0:
        return
    if res.exit_status == FETCH_UNREACHABLE:
        raise PeerError(
            f"{s.target}: the node cannot reach the control plane at {origin} ({err}), the address its agent "
            "would dial too; open the way there (route, firewall, agent_listen), or have the release copied over "
            "SSH with --release-via ssh"
        )
    if res.exit_status == FETCH_NOT_OURS:
        raise PeerError(
            f"{s.target}: what answers the node at {origin} is not this control plane: its certificate is not from "
            f"the cluster's CA ({err}); nothing was downloaded. Something else holds that address for the node, or "
            "its traffic is intercepted; fix that, or have the release copied over SSH with --release-via ssh"
        )
    if res.exit_status == 127:
        raise PeerError(f"{s.target}: python3 is not installed there; llmgw runs on python3 3.10 to 3.13: install it")
    raise PeerError(f"{s.target}: fetching {art.url} from the control plane failed ({said(res)})")


async def _fetch_on_node(s: ssh.Session, url: str, dest: str) -> None:
    for argv in (
        ["curl", "-fsSL", "--retry", "3", "-o", dest, url],
        ["wget", "-q", "-O", dest, url],
    ):
        res = await s.run(argv, timeout_s=FETCH_S)
        if res.exit_status == 0:
            return
        if res.exit_status != 127:  # 127: the tool is not there, try the next
            raise PeerError(f"{s.target}: fetching {url} failed ({said(res)}); check that the node reaches it")
    raise PeerError(
        f"{s.target}: neither curl nor wget is installed there to fetch {url}; install one, "
        "or give --release a directory here so the file is copied over SSH"
    )


async def _remote_sha256(s: ssh.Session, path: str) -> str:
    res = await s.run(["sha256sum", "--", path], timeout_s=SHORT_S)
    if res.exit_status != 0:
        return ""
    return res.stdout.split()[0] if res.stdout.split() else ""


async def tried(s: ssh.Session, facts: Facts) -> str:
    """Run the staged release (`llmgw version`) before anything outside the stage changes: a
    python3 that cannot run it is said now, with nothing installed."""
    res = await s.run(staged_llmgw(facts, "version"), sudo=True, timeout_s=DOCTOR_S)
    if res.exit_status != 0:
        raise PeerError(
            f"{s.target}: the release does not run there ({said(res)}); llmgw runs on python3 3.10 to 3.13: install "
            "one as python3. Nothing was changed on the machine"
        )
    return res.stdout.strip().splitlines()[0] if res.stdout.strip() else ""


def ship_detail(facts: Facts, machine: str = "node") -> str:
    """What `ship` did, in words; `machine` is what the target is called (a node, a gateway's machine)."""
    art = facts.artifact
    assert art is not None
    if art.path:
        how = "copied over SSH"
    elif art.from_plane:
        how = f"fetched by the {machine} from the control plane ({art.url}, checked against the CA root)"
    else:
        how = f"fetched by the {machine} from {art.url}"
    if not facts.installed_sha256:
        was = f"new install at {layout.BIN}"
    elif facts.installed_sha256 == art.sha256:
        was = f"the same as {layout.BIN} there"
    else:
        was = f"will replace {layout.BIN} there (sha256 {facts.installed_sha256[:12]})"
    return f"{art.name} {how}, sha256 {art.sha256[:12]} verified on the {machine}; {was}"


# -- doctor --------------------------------------------------------------------------------


async def doctor(opts: Options, s: ssh.Session, facts: Facts, questions: Questions) -> tuple[str, str, dict[str, Any]]:
    await check_driver_paths(opts, s)
    host = f"[{facts.address}]" if ":" in facts.address else facts.address
    args = ["doctor", "--json", "--server", f"{host}:{facts.port}"]
    if facts.existing is not None:
        args += ["--config", layout.CONFIG]  # its paths (nvidia_smi, ib_root, ...) as the agent will use them
    for key, path in opts.driver_paths.items():  # the flags given win over that file, as in the agent.toml written
        args += [driverpaths.by_key(key).flag, path]
    for decl in facts.given_fabrics(opts):
        args += ["--fabric", f"{decl.name}:{','.join(decl.adapters)}" if decl.adapters else decl.name]
    if opts.ignore_doctor:
        args += ["--ignore", ",".join(sorted(opts.ignore_doctor))]
    res = await s.run(staged_llmgw(facts, *args), sudo=True, timeout_s=DOCTOR_S)
    try:
        report = json.loads(res.stdout)
        checks = report["checks"]
    except (ValueError, KeyError, TypeError):
        raise PeerError(
            f"{s.target}: llmgw doctor did not run there ({said(res)}); nothing was changed on the node"
        ) from None
    failures = [
        DoctorFailure(check=c["name"], detail=c["detail"], fix=c.get("fix", ""))
        for c in checks
        if c["status"] == "fail" and not c.get("ignored")
    ]
    warnings = [c for c in checks if c["status"] in ("warn", "unknown") and not c.get("ignored")]
    ignored = [c["name"] for c in checks if c.get("ignored")]
    inventory = report.get("inventory") or {}
    # The GPUs doctor found, said where the operator reads: a wrong --nvidia-smi looks like none.
    gpus = f"; GPUs: {inventory.get('gpu_detail')}" if inventory.get("gpu_status") == "present" else ""
    tail = gpus + (f"; ignored: {', '.join(ignored)}" if ignored else "")
    if failures:
        listed = "; ".join(f"{f.check}: {f.detail}" + (f" (fix: {f.fix})" if f.fix else "") for f in failures)
        if not await questions.go_past_doctor(failures):
            names = ",".join(f.check for f in failures)
            raise MachineError(
                f"doctor failed on {facts.node_id}: {listed}. Nothing was changed on the node. Fix this and run "
                f"again, or go on past it with --ignore-doctor {names}"
            )
        return WARN, f"went on past failed checks: {listed}{tail}", inventory
    if warnings:
        listed = "; ".join(f"{c['name']}: {c['detail']}" for c in warnings)
        return WARN, f"{len(checks) - len(warnings)} checks ok; warnings: {listed}{tail}", inventory
    return OK, f"{len(checks)} checks ok{tail}", inventory


async def check_driver_paths(opts: Options, s: ssh.Session) -> None:
    """Each --nvidia-smi, --ib-root, --sminfo given is there on the node (as root sees it), or a
    UsageError naming the flag: doctor would otherwise report a node without GPUs or adapters."""
    for key, path in opts.driver_paths.items():
        res = await s.run(driverpaths.test_argv(key, path), sudo=True, timeout_s=SHORT_S)
        if res.exit_status == 1:
            raise driverpaths.missing(key, path, str(s.target))
        if res.exit_status != 0:
            raise PeerError(f"{s.target}: checking {path} failed ({said(res)})")


# -- fabrics -------------------------------------------------------------------------------


async def fabrics(
    opts: Options, facts: Facts, inventory: dict[str, Any], nodes: list[dict[str, Any]], questions: Questions
) -> tuple[str, str]:
    groups = [
        FabricGroup(identity=g["identity"], kind=g["kind"], adapters=tuple(g["adapters"]), detail=g.get("detail", ""))
        for g in inventory.get("fabric_groups") or ()
    ]
    existing = sorted({f["name"] for n in nodes for f in n.get("fabrics") or ()})
    given = facts.given_fabrics(opts)
    if not groups and not given:
        return OK, "no active InfiniBand or RoCE adapter: the node is its own island"
    answered = tuple(await questions.name_fabrics(groups, existing, given)) if groups else ()
    # A declaration no group accounts for (doctor has checked it) is kept: the answer covers groups only.
    grouped = {a for g in groups for a in g.adapters}
    kept = tuple(d for d in given if d.name not in {a.name for a in answered} and not set(d.adapters) & grouped)
    facts.fabrics = answered + kept
    named = {a for d in facts.fabrics for a in d.adapters}
    text = "; ".join(f"{d.name}: {','.join(d.adapters) or 'the next two adapters'}" for d in facts.fabrics)
    unnamed = [g for g in groups if not set(g.adapters) & named and not _default_covers(facts.fabrics)]
    if unnamed:
        flags = " ".join(f"--fabric NAME:{','.join(g.adapters)}" for g in unnamed)
        left = "; ".join(f"{','.join(g.adapters)} on {g.identity}" for g in unnamed)
        return WARN, f"{text + '; ' if text else ''}not named, so unused for multi-node replicas: {left} ({flags})"
    return OK, text


def _default_covers(decls: Sequence[cfg.FabricDecl]) -> bool:
    return any(not d.adapters for d in decls)
