"""A control plane that cannot start says why and exits 1 — never "internal error" (exit 70):
real `python -m llmgw server` and `llmgw up` children whose port another socket holds."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from testlib.cluster import free_port
from testlib.controlplane import make_state
from testlib.proc import run_llmgw


@pytest.fixture
def taken() -> Iterator[int]:
    """A loopback port a listening socket holds for the test's duration."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize("which", ["http_listen", "agent_listen"])
def test_llmgw_server_with_its_port_taken_exits_1_naming_the_address(tmp_path: Path, taken: int, which: str) -> None:
    state = tmp_path / "state"
    make_state(state)
    listen = {"http_listen": f"127.0.0.1:{free_port()}", "agent_listen": f"127.0.0.1:{free_port()}"}
    listen[which] = f"127.0.0.1:{taken}"
    config = tmp_path / "server.toml"
    config.write_text(
        f'[server]\nstate_dir = "{state}"\n' + "".join(f'{key} = "{value}"\n' for key, value in listen.items())
    )
    done = run_llmgw("server", "--config", str(config), timeout=60)
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"llmgw server: cannot listen on 127.0.0.1:{taken} ([server] {which}):"), done.stderr
    assert "Address already in use" in last and "server.toml" in last
    assert "internal error" not in done.stderr and "Traceback" not in done.stderr
    assert not (state / "admin.url").exists()


def test_llmgw_up_with_its_gateway_port_taken_exits_1_and_names_the_flag(tmp_path: Path, taken: int) -> None:
    done = run_llmgw("up", "--port", str(taken), "--state-dir", str(tmp_path / "up"), timeout=120)
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert f"cannot listen on 127.0.0.1:{taken}" in last, done.stderr
    assert last.endswith(f"(the gateway wants 127.0.0.1:{taken}; pick another with --port)")
    assert "internal error" not in done.stderr and "Traceback" not in done.stderr
