"""The `ship` step every onboarding flow shares: what the machine gets to run.

`choose` decides where the release comes from (release.py): by default the machine downloads it
from the control plane's agent port (`fetch_from_plane`: python3 there, the server checked
against the CA root the flow puts in the stage for that one download, never the machine's system
trust), else it is copied over SSH. Nothing here changes the machine outside its stage: each file
is staged in a private directory under /tmp (layout.STAGE_PREFIX) and its sha256 checked there
(`deliver`) before anything runs or installs it; `tried` runs the staged release (`llmgw
version`) for a flow whose machine gets no doctor.
"""

from __future__ import annotations

import trio

from llmgw.errors import PeerError, UsageError
from llmgw.nodeadd import layout, ssh
from llmgw.nodeadd.context import DOCTOR_S, FETCH_S, SHORT_S, Facts, Options, put_text, said, staged_llmgw
from llmgw.nodeadd.release import HTTPS, Artifact, find_artifact, from_plane, how_to_ship, local_release

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


async def ship(s: ssh.SshSession, facts: Facts, ca_pem: bytes = b"") -> None:
    """Make the stage and deliver the release chosen into it (`deliver`), and read the sha256 of
    the llmgw installed there, if any (whether `install` replaces it)."""
    art = facts.artifact
    assert art is not None
    res = await s.run(["mktemp", "-d", f"{layout.STAGE_PREFIX}XXXXXXXX"], timeout_s=SHORT_S)
    stage = res.stdout.strip()
    if res.exit_status != 0 or not stage.startswith(layout.STAGE_PREFIX) or "/" in stage[len("/tmp/") :]:
        raise PeerError(f"{s.target}: cannot make a staging directory under /tmp ({said(res)})")
    facts.stage = stage
    await deliver(s, art, f"{stage}/llmgw", ca_pem)
    facts.installed_sha256 = await remote_sha256(s, layout.BIN)
    res = await s.run(["mkdir", "-m", "0700", f"{stage}/pyz"], sudo=True, timeout_s=SHORT_S)
    if res.exit_status != 0:
        raise PeerError(f"{s.target}: cannot make {stage}/pyz ({said(res)})")


async def deliver(s: ssh.SshSession, art: Artifact, staged: str, ca_pem: bytes = b"") -> None:
    """`art` at `staged` (in the stage), copied over SSH or fetched by the machine, and its sha256
    found there to be the one its SHA256SUMS lists; else a PeerError, and nothing runs it."""
    if art.path is not None:
        await s.put(art.path, staged, mode=0o755, timeout_s=FETCH_S)
    elif art.from_plane:
        await fetch_from_plane(s, art, staged, ca_pem)
    else:
        await _fetch_on_node(s, art.url, staged)
    actual = await remote_sha256(s, staged)
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


async def fetch_from_plane(s: ssh.SshSession, art: Artifact, dest: str, ca_pem: bytes) -> None:
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


async def _fetch_on_node(s: ssh.SshSession, url: str, dest: str) -> None:
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


async def remote_sha256(s: ssh.SshSession, path: str) -> str:
    res = await s.run(["sha256sum", "--", path], timeout_s=SHORT_S)
    if res.exit_status != 0:
        return ""
    return res.stdout.split()[0] if res.stdout.split() else ""


async def tried(s: ssh.SshSession, facts: Facts) -> str:
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
