"""The control plane's own gateway workers, what is decided before they start: how many, the
identity it issues them, the port it holds for them, where they dial it and what name its
certificate must cover there. The workers themselves run in
tests/integration/test_control_plane_workers.py."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest

from llmgw import paths
from llmgw.pki.ca import ROLE_GATEWAY, cert_info
from llmgw.pki.files import gateway_paths, issue_server_cert, load_cert
from llmgw.server.gateways.workers import WORKER_NAME, hold_port, issue_identity, link_url, tls_name, worker_count
from testlib.controlplane import make_state


def test_the_setting_or_the_commands_default_and_auto_is_one_per_cpu() -> None:
    cpus = len(os.sched_getaffinity(0))
    assert worker_count(None, "auto") == cpus  # `llmgw server`
    assert worker_count(None, 1) == 1  # `llmgw up`
    assert worker_count(3, "auto") == 3 and worker_count("auto", 1) == cpus
    assert worker_count(0, "auto") == 0  # the gateway on the control plane's loop


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_workers_identity_is_private_and_new_at_each_start(tmp_path: Path) -> None:
    state = tmp_path / "state"
    ca = make_state(state)
    pki = issue_identity(ca, state, validity_days=3)
    files = gateway_paths(pki)
    assert pki == paths.workers_pki_dir(state)
    assert mode(pki) == 0o700 and mode(files.key) == 0o600
    first = cert_info(load_cert(files.cert))
    assert (first.common_name, first.role) == (WORKER_NAME, ROLE_GATEWAY)
    key = files.key.read_bytes()
    again = cert_info(load_cert(issue_identity(ca, state, validity_days=3) / "gateway.crt"))
    assert again.serial != first.serial and files.key.read_bytes() != key  # the last start's replaced
    paths.check_state_dir(state)  # as the control plane checks at start: nothing open to others
    files.key.chmod(0o644)
    with pytest.raises(Exception, match="gateway workers' key"):
        paths.check_state_dir(state)


def test_port_0_becomes_one_port_the_workers_share_and_no_other_program_takes() -> None:
    held = hold_port("127.0.0.1", 0)
    try:
        [sock] = held
        port = sock.getsockname()[1]
        assert port != 0
        with pytest.raises(ConnectionRefusedError):  # held, not listening: no connection comes to it
            socket.create_connection(("127.0.0.1", port), timeout=2)
        other = socket.socket()
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        with pytest.raises(OSError), other:  # a program without SO_REUSEPORT
            other.bind(("127.0.0.1", port))
        for _ in range(2):  # a worker, and the same worker started again
            worker = socket.socket()
            with worker:
                worker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                worker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                worker.bind(("127.0.0.1", port))
                worker.listen()
                socket.create_connection(("127.0.0.1", port), timeout=2).close()
    finally:
        for sock in held:
            sock.close()


def test_a_port_taken_by_another_program_is_said_at_once() -> None:
    other = socket.socket()
    with other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        with pytest.raises(OSError):
            hold_port("127.0.0.1", other.getsockname()[1])


def test_they_dial_the_agent_port_on_loopback_and_check_a_name_the_certificate_covers(tmp_path: Path) -> None:
    assert link_url(("0.0.0.0", 7443)) == "wss://127.0.0.1:7443"
    assert link_url(("::", 7443)) == "wss://[::1]:7443"
    assert link_url(("10.0.0.5", 7443)) == "wss://10.0.0.5:7443"
    state = tmp_path / "state"
    ca = make_state(state)  # the server certificate covers 127.0.0.1
    assert tls_name(state, "127.0.0.1") == ""  # the address dialled itself
    issue_server_cert(ca, state, ["cp.example.net"], validity_days=3)
    assert tls_name(state, "127.0.0.1") == "cp.example.net"
