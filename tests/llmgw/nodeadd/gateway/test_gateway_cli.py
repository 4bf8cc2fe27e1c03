"""`llmgw gateway add`, `remove` and `csr` as the command line takes them: a bad argument is a
usage error before anything is read, the authority is read before the machine is touched, and
`csr` makes a key once."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from llmgw import cli
from llmgw.pki.ca import ROLE_GATEWAY, cert_info, parse_cert
from llmgw.pki.files import init_ca, load_ca
from testlib.proc import llmgw_env

UNREACHABLE = "root@192.0.2.1"  # TEST-NET-1: nothing answers there; a run that dialled it would hang


def test_llmgw_gateway_without_a_source_or_a_verb_says_what_it_takes(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["gateway"]) == 2
    err = capsys.readouterr().err
    assert "give --server wss://HOST:PORT" in err and "or a verb: add USER@HOST, remove NAME, csr" in err


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--listen", "8080"], "--listen '8080' must be ADDR:PORT"),
        (["--workers", "0"], "--workers '0' must be a whole number of workers"),
        (["--name", "gw/1"], "gateway name 'gw/1' may use only"),
        (["--join-timeout", "0"], "--join-timeout must be positive"),
    ],
)
def test_a_bad_argument_is_refused_before_anything_is_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], said: str
) -> None:
    missing = tmp_path / "no-such-state"
    assert cli.main(["gateway", "add", UNREACHABLE, "--plain", "--state-dir", str(missing), *args]) == 2
    assert said in capsys.readouterr().err
    assert not missing.exists()


def test_a_bad_target_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["gateway", "add", "192.0.2.1", "--plain"]) == 2
    assert "names no login: give the node as USER@HOST" in capsys.readouterr().err


def test_the_authority_is_read_before_the_machine_is_touched(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "state"
    init_ca(state, validity_days=30)  # a CA but no server certificate and no control plane running
    status = cli.main(["gateway", "add", UNREACHABLE, "--plain", "--state-dir", str(state)])
    out = capsys.readouterr().out
    assert status != 0
    [line] = out.splitlines()  # the authority's failure, and no connect step after it
    assert line.startswith("failed authority  read the certificate authority and the gateways connected: ")
    assert "server.crt is missing" in line and "llmgw ca server-cert" in line


def test_csr_makes_the_gateways_key_once_and_a_request_the_ca_signs_as_a_gateways(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pki = tmp_path / "pki"
    assert cli.main(["gateway", "csr", "--pki-dir", str(pki), "--name", "gw1"]) == 0
    assert f"certificate signing request for gateway 'gw1': {pki / 'gateway.csr'}" in capsys.readouterr().out
    key = (pki / "gateway.key").read_bytes()
    assert cli.main(["gateway", "csr", "--pki-dir", str(pki), "--name", "gw1"]) == 0
    assert (pki / "gateway.key").read_bytes() == key
    init_ca(tmp_path / "plane", validity_days=30)
    cert = load_ca(tmp_path / "plane").sign_gateway_csr((pki / "gateway.csr").read_bytes(), "gw1", validity_days=1)
    assert cert_info(parse_cert(cert)).role == ROLE_GATEWAY
    with pytest.raises(SystemExit) as usage:  # argparse's own: --name is required
        cli.main(["gateway", "csr", "--pki-dir", str(pki)])
    assert usage.value.code == 2


def test_remove_takes_a_gateways_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["gateway", "remove", "gw 1"]) == 2
    assert "gateway name 'gw 1' may use only" in capsys.readouterr().err


def test_llmgw_gateway_loads_neither_the_control_plane_nor_the_admin_client() -> None:
    # Every gateway process (each worker too) builds `llmgw gateway`'s parser, verbs and all: they
    # must not bring the control plane's modules onto a gateway's machine, nor slow each start.
    code = (
        "import sys; import llmgw.commands.gateway; "
        "print(' '.join(m for m in sys.modules if m.startswith(('llmgw.server', 'llmgw.ctl', 'agent'))))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=llmgw_env())
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ""
