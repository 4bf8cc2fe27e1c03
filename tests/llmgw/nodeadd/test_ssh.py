"""The SSH session of `llmgw node add`, against a real OpenSSH server on 127.0.0.1.

Host keys are the point: a new host runs nothing until accepted, an accepted key lands in
known_hosts where ssh-keygen finds it, and a changed key is refused with both fingerprints.
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import subprocess
from pathlib import Path

import pytest
import trio

from llmgw.errors import MachineError, PeerError, UsageError
from llmgw.nodeadd.errors import AuthFailed, ChangedHostKey, RemoteTimeout, UnknownHostKey
from llmgw.nodeadd.ssh import open_session, parse_target
from testlib.sshagent import SshAgent
from testlib.sshd import Sshd, fingerprint_of, keygen

TIMEOUT_S = 20  # every test's bound: a hung connection fails rather than stalls


@pytest.fixture
def sshd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)  # only the keys a test names are offered
    server = Sshd(tmp_path / "sshd")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def known_hosts(tmp_path: Path) -> Path:
    return tmp_path / "home" / ".ssh" / "known_hosts"


def session(sshd: Sshd, known_hosts: Path, *, accept=True, client_key: Path | None = None):
    return open_session(
        sshd.target,
        known_hosts=known_hosts,
        accept_new_host_key=accept,
        client_keys=[client_key or sshd.client_key],
        port=sshd.port,
        connect_timeout_s=10,
    )


@pytest.mark.trio
async def test_stdout_and_stderr_come_back_apart(sshd: Sshd, known_hosts: Path) -> None:
    with trio.fail_after(TIMEOUT_S):
        async with session(sshd, known_hosts) as s:
            result = await s.run(["sh", "-c", "echo out; echo err >&2"], timeout_s=10)
    assert (result.exit_status, result.stdout, result.stderr) == (0, "out\n", "err\n")


@pytest.mark.trio
async def test_exit_status_is_passed_on_and_the_session_stays_usable(sshd: Sshd, known_hosts: Path) -> None:
    with trio.fail_after(TIMEOUT_S):
        async with session(sshd, known_hosts) as s:
            failed = await s.run(["sh", "-c", "exit 3"], timeout_s=10)
            again = await s.run(["true"], sudo=True, timeout_s=10)  # as root: no sudo in between
    assert failed.exit_status == 3
    assert again.exit_status == 0


@pytest.mark.trio
async def test_a_hostile_argument_is_one_word_and_runs_nothing(sshd: Sshd, known_hosts: Path, tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    words = [f"x; touch {canary}", f"$(touch {canary})", f"`touch {canary}`", f"'; touch {canary}; '"]
    with trio.fail_after(TIMEOUT_S):
        async with session(sshd, known_hosts) as s:
            result = await s.run(["printf", "%s\\n", *words], timeout_s=10)
    assert result.stdout.splitlines() == words
    assert not canary.exists()


@pytest.mark.trio
async def test_a_command_past_its_deadline_is_abandoned(sshd: Sshd, known_hosts: Path, tmp_path: Path) -> None:
    pidfile = tmp_path / "sleeper.pid"
    try:
        with trio.fail_after(TIMEOUT_S):
            async with session(sshd, known_hosts) as s:
                started = trio.current_time()
                with pytest.raises(RemoteTimeout, match="sleep"):
                    await s.run(["sh", "-c", f"echo $$ > {pidfile}; exec sleep 60"], timeout_s=0.3)
                assert trio.current_time() - started < 5  # the deadline plus a short grace
                assert (await s.run(["echo", "still here"], timeout_s=10)).stdout == "still here\n"
    finally:
        if pidfile.exists():  # sshd does not pass signals to a root session: end it here
            with contextlib.suppress(ProcessLookupError, ValueError):  # ValueError: not written yet
                os.kill(int(pidfile.read_text()), signal.SIGKILL)


@pytest.mark.trio
async def test_a_new_host_not_accepted_runs_nothing(sshd: Sshd, known_hosts: Path) -> None:
    offered: list[str] = []

    async def operator_says_no(fp: str) -> bool:
        offered.append(fp)
        return False

    with trio.fail_after(TIMEOUT_S):
        for accept in (False, operator_says_no):
            with pytest.raises(UnknownHostKey) as caught:
                async with session(sshd, known_hosts, accept=accept) as s:
                    await s.run(["touch", str(sshd.root / "ran")], timeout_s=10)
            assert caught.value.fingerprint == sshd.host_key_fingerprint
            assert sshd.host_key_fingerprint in str(caught.value)
    assert offered == [sshd.host_key_fingerprint]  # the operator saw what ssh-keygen -lf prints
    assert not known_hosts.exists()
    assert not (sshd.root / "ran").exists()
    assert sshd.sessions_started() == 0
    assert "Accepted publickey" not in sshd.log_text()


@pytest.mark.trio
async def test_a_new_host_accepted_is_remembered(sshd: Sshd, known_hosts: Path) -> None:
    async def operator_says_yes(fp: str) -> bool:
        return True

    with trio.fail_after(TIMEOUT_S):
        async with session(sshd, known_hosts, accept=operator_says_yes) as s:
            assert (await s.run(["echo", "1"], timeout_s=10)).stdout == "1\n"
        lines = known_hosts.read_text().splitlines()
        # The second connection asks nobody: the key is known now.
        async with session(sshd, known_hosts, accept=False) as s:
            assert (await s.run(["echo", "2"], timeout_s=10)).stdout == "2\n"
    assert known_hosts.read_text().splitlines() == lines
    assert len(lines) == 1 and lines[0].startswith(f"[127.0.0.1]:{sshd.port} ssh-ed25519 ")
    found = subprocess.run(
        ["ssh-keygen", "-F", f"[127.0.0.1]:{sshd.port}", "-f", str(known_hosts)], capture_output=True, timeout=30
    )
    assert found.returncode == 0  # OpenSSH reads what was written


@pytest.mark.trio
async def test_a_known_hosts_file_written_by_openssh_is_trusted(sshd: Sshd, known_hosts: Path) -> None:
    scan = subprocess.run(
        ["ssh-keyscan", "-H", "-T", "5", "-p", str(sshd.port), "127.0.0.1"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    known_hosts.parent.mkdir(parents=True)
    known_hosts.write_text("# hashed, as ssh(1) writes with HashKnownHosts\n" + scan.stdout)
    with trio.fail_after(TIMEOUT_S):
        async with session(sshd, known_hosts, accept=False) as s:
            assert (await s.run(["true"], timeout_s=10)).exit_status == 0


@pytest.mark.trio
async def test_a_changed_host_key_is_refused_with_both_fingerprints(sshd: Sshd, known_hosts: Path) -> None:
    with trio.fail_after(TIMEOUT_S):
        async with session(sshd, known_hosts, accept=True) as s:
            await s.run(["true"], timeout_s=10)
    old = sshd.host_key_fingerprint
    before = known_hosts.read_text()
    sshd.restart(new_host_key=True)
    new = sshd.host_key_fingerprint
    with trio.fail_after(TIMEOUT_S):
        with pytest.raises(ChangedHostKey) as caught:
            async with session(sshd, known_hosts, accept=True) as s:
                await s.run(["touch", str(sshd.root / "ran")], timeout_s=10)
    assert (caught.value.offered, caught.value.known) == (new, (old,))
    message = str(caught.value)
    assert all(part in message for part in ("127.0.0.1", old, new, "ssh-keygen -R"))
    assert known_hosts.read_text() == before
    assert not (sshd.root / "ran").exists()
    assert sshd.log_text().count("Starting session:") == 1  # the first connection's only


@pytest.mark.trio
async def test_put_writes_the_file_with_its_mode(sshd: Sshd, known_hosts: Path, tmp_path: Path) -> None:
    local = tmp_path / "llmgw-release"
    local.write_bytes(os.urandom(300_000))
    remote = sshd.root / "installed" / "llmgw"
    remote.parent.mkdir()
    with trio.fail_after(TIMEOUT_S):
        async with session(sshd, known_hosts) as s:
            await s.put(local, str(remote), mode=0o750)
            with pytest.raises(MachineError, match="not a file"):
                await s.put(tmp_path / "missing", str(remote))
    assert remote.read_bytes() == local.read_bytes()
    assert stat.S_IMODE(remote.stat().st_mode) == 0o750
    assert sorted(p.name for p in remote.parent.iterdir()) == ["llmgw"]  # no partial file left


@pytest.mark.trio
async def test_a_refused_key_names_the_user_and_the_key_file(sshd: Sshd, known_hosts: Path, tmp_path: Path) -> None:
    stranger = keygen(tmp_path / "stranger", "not-authorized")
    with trio.fail_after(TIMEOUT_S):
        with pytest.raises(AuthFailed) as caught:
            async with session(sshd, known_hosts, client_key=stranger):
                pass
    message = str(caught.value)
    assert all(part in message for part in (repr(sshd.user), str(stranger), "ssh-copy-id", "SSH_AUTH_SOCK"))
    assert sshd.sessions_started() == 0


@pytest.mark.trio
async def test_with_no_key_named_the_agents_key_is_used(
    sshd: Sshd, known_hosts: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "empty-home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))  # no ~/.ssh keys to fall back on
    fingerprint = fingerprint_of(sshd.client_key.with_suffix(".pub"))
    agent = SshAgent().start()
    try:
        agent.add(sshd.client_key)  # the private key now exists only in the agent
        monkeypatch.setenv("SSH_AUTH_SOCK", str(agent.socket))
        with trio.fail_after(TIMEOUT_S):
            async with open_session(
                sshd.target, known_hosts=known_hosts, accept_new_host_key=True, port=sshd.port, connect_timeout_s=10
            ) as s:
                assert (await s.run(["true"], timeout_s=10)).exit_status == 0
    finally:
        agent.stop()
    assert not sshd.client_key.exists()
    assert f"Accepted publickey for {sshd.user}" in sshd.log_text() and fingerprint in sshd.log_text()


@pytest.mark.trio
async def test_no_key_and_no_agent_names_both_fixes(
    sshd: Sshd, known_hosts: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "empty-home"))
    with trio.fail_after(TIMEOUT_S):
        with pytest.raises(AuthFailed) as caught:
            async with open_session(
                sshd.target, known_hosts=known_hosts, accept_new_host_key=True, port=sshd.port, connect_timeout_s=10
            ):
                pass
    message = str(caught.value)
    assert "tried no key files and no SSH agent (SSH_AUTH_SOCK is not set)" in message, message
    assert f"ssh-copy-id -p {sshd.port} -i KEY.pub {sshd.target}" in message
    assert "`ssh -A`" in message and "sudo --preserve-env=SSH_AUTH_SOCK llmgw node add" in message
    assert sshd.sessions_started() == 0


@pytest.mark.trio
async def test_an_error_inside_the_session_comes_out_bare(sshd: Sshd, known_hosts: Path) -> None:
    """The asyncio loop under the session runs in a nursery; its exception group stays inside ssh.py."""
    with trio.fail_after(TIMEOUT_S):
        with pytest.raises(PeerError, match="the caller's own") as caught:
            async with session(sshd, known_hosts) as s:
                assert (await s.run(["true"], timeout_s=10)).exit_status == 0
                raise PeerError("the caller's own")
    assert type(caught.value) is PeerError


@pytest.mark.parametrize(
    "target",
    [
        "10.0.0.21",
        "@10.0.0.21",
        "ubuntu@",
        "-oProxyCommand=x@h",
        "ub untu@h",
        "u@h;rm",
        "u@-h",
        "u@h..x",
        "u@[h]",
        "a@b@c",
    ],
)
def test_a_bad_target_is_a_usage_error_naming_it(target: str) -> None:
    with pytest.raises(UsageError) as caught:
        parse_target(target)
    assert repr(target) in str(caught.value)


@pytest.mark.parametrize(
    ("target", "user", "host"),
    [
        ("ubuntu@10.0.0.21", "ubuntu", "10.0.0.21"),
        ("root@Node04.Lab", "root", "node04.lab"),
        ("ops@[fe80::1]", "ops", "fe80::1"),
        ("ops@::1", "ops", "::1"),
    ],
)
def test_a_good_target_is_parsed(target: str, user: str, host: str) -> None:
    parsed = parse_target(target)
    assert (parsed.user, parsed.host) == (user, host)
