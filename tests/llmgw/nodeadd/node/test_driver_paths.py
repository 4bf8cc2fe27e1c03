"""--nvidia-smi, --ib-root and --sminfo on `node add` and `agent run`: how they parse, what they
write to agent.toml when a node is added and added again, and what a missing one says."""

from __future__ import annotations

import argparse
from pathlib import Path

import attrs
import pytest

from llmgw import config as cfg
from llmgw import driverpaths
from llmgw.cli import build_parser
from llmgw.commands.agent import checked_driver_paths
from llmgw.errors import UsageError
from llmgw.nodeadd.node import layout

SERVER = "wss://10.0.0.1:7443"
SMI = "/opt/nvidia/bin/nvidia-smi"


def _parse(command: str, *argv: str) -> argparse.Namespace:
    return build_parser(command).parse_args(list(argv))


def test_node_add_and_agent_run_take_the_three_paths_by_their_agent_toml_keys() -> None:
    flags = ("--nvidia-smi", SMI, "--ib-root", "/host/sys/class/infiniband", "--sminfo", "/opt/ib/sminfo")
    want = {"nvidia_smi": SMI, "ib_root": "/host/sys/class/infiniband", "sminfo": "/opt/ib/sminfo"}
    assert driverpaths.given(_parse("node", "add", "root@10.0.0.2", *flags)) == want
    assert driverpaths.given(_parse("agent", "run", *flags)) == want
    assert driverpaths.given(_parse("node", "add", "root@10.0.0.2")) == {}  # not given: left to agent.toml
    assert set(want) <= {f.name for f in attrs.fields(cfg.AgentConfig)}  # the keys the agent reads


@pytest.mark.parametrize("command", [("node", "add", "root@10.0.0.2"), ("agent", "run")])
def test_a_relative_path_is_a_usage_error_naming_the_flag_and_an_example(
    command: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        _parse(command[0], *command[1:], "--nvidia-smi", "bin/nvidia-smi")
    assert exited.value.code == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert "--nvidia-smi takes an absolute path" in err and "'bin/nvidia-smi'" in err
    assert "e.g. --nvidia-smi /opt/nvidia/bin/nvidia-smi" in err


def test_doctor_still_takes_a_relative_path_for_fixtures_in_a_checkout() -> None:
    args = _parse("doctor", "--nvidia-smi", "tests/fixtures/nvidia-smi/h100")
    assert args.nvidia_smi == "tests/fixtures/nvidia-smi/h100"


def test_agent_run_checks_a_given_path_is_there_and_names_the_flag(tmp_path: Path) -> None:
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\n")
    smi.chmod(0o755)
    args = _parse("agent", "run", "--nvidia-smi", str(smi), "--ib-root", str(tmp_path))
    assert checked_driver_paths(args) == {"nvidia_smi": str(smi), "ib_root": str(tmp_path)}

    smi.chmod(0o644)  # there, but not a program
    with pytest.raises(UsageError) as caught:
        checked_driver_paths(args)
    message = str(caught.value)
    assert message.startswith(f"--nvidia-smi {smi}: this machine has no executable file at that path")
    assert (
        "command -v nvidia-smi" in message and "leave --nvidia-smi out for the default /usr/bin/nvidia-smi" in message
    )

    args = _parse("agent", "run", "--ib-root", str(tmp_path / "nowhere"))
    with pytest.raises(UsageError, match=r"--ib-root .*/nowhere: this machine has no directory at that path"):
        checked_driver_paths(args)


def _written(text: str, tmp_path: Path) -> cfg.AgentConfig:
    (tmp_path / "agent.toml").write_text(text)
    return cfg.load_agent_config(tmp_path / "agent.toml")


def test_the_paths_given_are_written_to_agent_toml(tmp_path: Path) -> None:
    text = layout.agent_toml(server=SERVER, node_id="node-a", driver_paths={"nvidia_smi": SMI, "sminfo": "/opt/sminfo"})
    loaded = _written(text, tmp_path)
    assert (loaded.nvidia_smi, loaded.sminfo, loaded.ib_root) == (SMI, "/opt/sminfo", cfg.DEFAULT_IB_ROOT)
    assert "ib_root" not in text


def test_adding_again_keeps_the_paths_not_given_and_replaces_those_given(tmp_path: Path) -> None:
    before = cfg.agent_config_from_dict(
        {"server": SERVER, "node_id": "node-a", "nvidia_smi": SMI, "ib_root": "/host/ib", "sminfo": "/opt/sminfo"}
    )
    # Not given: kept as they were.
    again = _written(layout.agent_toml(server=SERVER, node_id="node-a", keep=before), tmp_path)
    assert (again.nvidia_smi, again.ib_root, again.sminfo) == (SMI, "/host/ib", "/opt/sminfo")
    # Given: replaces; the default path given: the key goes, and the node is back at the default.
    text = layout.agent_toml(
        server=SERVER,
        node_id="node-a",
        driver_paths={"nvidia_smi": "/usr/local/nvidia/bin/nvidia-smi", "ib_root": cfg.DEFAULT_IB_ROOT},
        keep=before,
    )
    replaced = _written(text, tmp_path)
    assert replaced.nvidia_smi == "/usr/local/nvidia/bin/nvidia-smi"
    assert replaced.ib_root == cfg.DEFAULT_IB_ROOT and "ib_root" not in text
    assert replaced.sminfo == "/opt/sminfo"


def test_the_check_on_the_node_is_test_1_of_the_right_kind() -> None:
    assert driverpaths.test_argv("nvidia_smi", SMI) == ["test", "-x", SMI]
    assert driverpaths.test_argv("sminfo", "/s") == ["test", "-x", "/s"]
    assert driverpaths.test_argv("ib_root", "/d") == ["test", "-d", "/d"]
    message = str(driverpaths.missing("nvidia_smi", SMI, "root@10.0.0.2"))
    assert message.startswith(f"--nvidia-smi {SMI}: root@10.0.0.2 has no executable file at that path")
