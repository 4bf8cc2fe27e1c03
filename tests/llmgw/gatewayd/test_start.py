"""What `llmgw gateway` checks before any worker starts: the table file, the certificate files and
the name in them, the flags; and the table file fed as the link would feed it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmgw.commands import gateway as command
from llmgw.errors import ConfigError, MachineError, UsageError
from llmgw.gatewayd import identity, main
from llmgw.gatewayd.table import GatewayTable
from llmgw.gatewayd.tablefile import feed, load_table, parse_table
from llmgw.pki.files import init_ca, issue_gateway_to_dir, load_ca
from llmgw.wire.gateway_link import ShareChanged
from testlib.gatewaytable import key, token_of, write_table_file


class FakeSim:
    name, model, host, port, key = "chat-0", "chat", "10.0.0.1", 8000, "engine-key"


def test_a_table_file_feeds_the_table_as_the_link_would(tmp_path: Path) -> None:
    path = write_table_file(tmp_path / "table.json", [FakeSim()], share=ShareChanged(index=1, count=3))
    table = GatewayTable(now=0.0)
    feed(table, load_table(path), now=7.0, path=path)
    assert table.received and table.keys.authenticate(token_of("tests")) == key("tests")
    assert table.keys.share == ShareChanged(index=1, count=3)
    assert [ep.replica_id for ep in table.rotation.endpoints] == ["chat-0"]
    assert table.staleness(10.0) == 3.0 and not table.link_up
    # /health shows it to any caller: the file's name, not where it is on the machine.
    assert table.link_detail == "no link: serving the table read from table.json at start (--table-file)"
    assert str(tmp_path) not in table.link_detail


def test_a_table_file_without_a_share_is_alone(tmp_path: Path) -> None:
    table = load_table(write_table_file(tmp_path / "table.json", [FakeSim()]))
    assert table.share == ShareChanged(index=0, count=1)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("[]", "expected a JSON object, got a JSON list"),
        ("{", "not valid JSON"),
        ('{"rotation": {"models": [], "endpoints": []}, "keys": [], "extra": 1}', "extra fields found (extra) @ $"),
        ('{"keys": []}', "required field missing @ $.rotation"),
        (
            '{"rotation": {"models": [], "endpoints": [{"replica_id": "r", "model": "m", "host": "h", "port": "80"}]},'
            ' "keys": []}',
            "$.rotation.endpoints[0].port",
        ),
    ],
)
def test_a_bad_table_file_is_refused_with_where(text: str, problem: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_table(text, "table.json")
    assert problem in str(info.value) and str(info.value).startswith("table.json")


def _gateway_pki(tmp_path: Path, name: str) -> Path:
    """A gateway certificate for `name`, its key and the CA, as `llmgw ca issue --gateway` writes them."""
    state = tmp_path / "cp"
    init_ca(state, validity_days=30)
    return issue_gateway_to_dir(load_ca(state), name, tmp_path / "pki", validity_days=30).dir


def test_the_name_is_the_certificates_and_a_different_one_is_refused(tmp_path: Path) -> None:
    pki = _gateway_pki(tmp_path, "gw-east")
    assert identity.credentials(pki, None).name == "gw-east"
    assert identity.credentials(pki, "gw-east").name == "gw-east"
    with pytest.raises(UsageError, match="--name 'gw-west' is not the name in the certificate of .*'gw-east'"):
        identity.credentials(pki, "gw-west")
    plan = main.plan(listen="127.0.0.1:9000", server_url="wss://cp:7443", table_file=None, pki_dir=pki, name=None)
    assert (plan.name, plan.host, plan.port) == ("gw-east", "127.0.0.1", 9000)


def test_missing_certificate_files_are_named_with_how_to_get_them(tmp_path: Path) -> None:
    with pytest.raises(MachineError) as info:
        main.plan(listen="0.0.0.0:8080", server_url="wss://cp:7443", table_file=None, pki_dir=tmp_path, name=None)
    message = str(info.value)
    assert f"{tmp_path / 'gateway.crt'} does not exist" in message
    assert "llmgw ca issue --gateway NAME" in message


@pytest.mark.parametrize("listen", ["8080", "host:", ":8080", "host:0", "host:65536", "host:http"])
def test_a_bad_listen_address_is_a_usage_error(listen: str) -> None:
    with pytest.raises(UsageError, match="must be ADDR:PORT"):
        main.split_listen(listen)


def test_listen_addresses_of_both_families() -> None:
    assert main.split_listen("[::]:8080") == ("::", 8080)
    assert main.split_listen("0.0.0.0:80") == ("0.0.0.0", 80)


def test_only_a_wss_server_is_taken(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="wss://HOST:PORT"):
        main.plan(listen="0.0.0.0:8080", server_url="https://cp:7443", table_file=None, pki_dir=tmp_path, name=None)


def test_workers_are_a_count_or_auto() -> None:
    assert command.workers_arg("3") == 3
    assert command.workers_arg("auto") >= 1
    for bad in ("0", "-1", "two"):
        with pytest.raises(Exception, match="1 or more, or auto"):
            command.workers_arg(bad)


def test_the_workers_command_line_carries_the_plan(tmp_path: Path) -> None:
    path = write_table_file(tmp_path / "t.json", [FakeSim()])
    plan = main.plan(listen="[::1]:9000", server_url=None, table_file=path, pki_dir=tmp_path, name=None)
    args = main.worker_args(plan, log_level="debug", log_format="json")
    assert args == (
        "--log-level",
        "debug",
        "--log-format",
        "json",
        "gateway",
        "--listen",
        "[::1]:9000",
        "--table-file",
        str(path),
        "--name",
        "gateway",
    )
    assert json.loads(path.read_text())["keys"][0]["name"] == "tests"


def test_the_commands_default_pki_dir_is_the_gateways() -> None:
    assert Path(command.DEFAULT_PKI_DIR) == identity.DEFAULT_PKI_DIR


def test_every_control_plane_given_goes_to_each_worker_in_its_order(tmp_path: Path) -> None:
    """`--server` once per control plane (several sharing a store): each worker's link tries them."""
    pki = _gateway_pki(tmp_path, "gw-east")
    servers = ["wss://cp-a:7443", "wss://cp-b:7443"]
    plan = main.plan(listen="127.0.0.1:9000", server_url=servers, table_file=None, pki_dir=pki, name=None)
    assert plan.servers == tuple(servers) and plan.server_url == "wss://cp-a:7443"
    args = main.worker_args(plan, log_level="info", log_format="kv")
    assert [args[i + 1] for i, a in enumerate(args) if a == "--server"] == servers
    with pytest.raises(UsageError, match="names one control plane twice"):
        main.plan(listen="127.0.0.1:9000", server_url=[*servers, servers[0]], table_file=None, pki_dir=pki, name=None)
    with pytest.raises(UsageError, match="'https://cp-c:7443' must be a control plane's agent port"):
        main.plan(
            listen="127.0.0.1:9000", server_url=[*servers, "https://cp-c:7443"], table_file=None, pki_dir=pki, name=None
        )
