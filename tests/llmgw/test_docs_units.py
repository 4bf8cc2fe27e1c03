"""The systemd units docs/operations.md shows for the control plane are units systemd accepts."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from testlib.needs import program
from testlib.proc import build_root


def units() -> dict[str, str]:
    text = (build_root() / "docs" / "operations.md").read_text()
    found = dict(
        re.findall(r"`/etc/systemd/system/([\w.-]+)`(?:(?!/etc/systemd/system/).)*?```ini\n(.*?)```", text, re.S)
    )
    assert set(found) == {"llmgw-server.socket", "llmgw-server.service"}, found.keys()
    return found


def test_the_documented_server_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    program("systemd-analyze", "systemd")
    for name, text in units().items():
        # ExecStart must name an executable that exists for verify to pass: this Python stands in.
        (tmp_path / name).write_text(text.replace("/usr/local/bin/llmgw", sys.executable))
    out = subprocess.run(
        ["systemd-analyze", "verify", str(tmp_path / "llmgw-server.socket"), str(tmp_path / "llmgw-server.service")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and out.stderr.strip() == "", out.stderr


def test_the_documented_sockets_are_the_documented_listeners() -> None:
    socket_unit = units()["llmgw-server.socket"]
    assert re.findall(r"^ListenStream=(.*)$", socket_unit, re.M) == ["0.0.0.0:7443", "127.0.0.1:8080"]
    service = units()["llmgw-server.service"]
    assert "Requires=llmgw-server.socket" in service and "TimeoutStopSec=40" in service
