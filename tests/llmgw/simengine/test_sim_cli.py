"""`llmgw engine sim`'s command line: an engine's help (so engine-check can read it), and every
bad flag or combination refused with exit 2 before anything listens."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from llmgw import cli
from llmgw.commands.engine import api_key_of
from llmgw.errors import UsageError
from llmgw.simengine.options import SimOptions, format_addr, parse_addr

FLAGS = [
    "--help",
    "--version",
    "--model",
    "--host",
    "--port",
    "--api-key",
    "--api-key-file",
    "--prompt-token-ms",
    "--output-token-ms",
    "--max-tokens-default",
    "--nnodes",
    "--node-rank",
    "--dist-init-addr",
    "--rendezvous-timeout-s",
    "--startup-delay-s",
    "--fail-after-s",
]


def sim(*args: str) -> int:
    try:
        return cli.main(["engine", "sim", *args])
    except SystemExit as exit_info:
        return int(exit_info.code or 0)


def test_help_has_one_line_per_flag_like_llama_server(capsys: pytest.CaptureFixture[str]) -> None:
    assert sim("--help") == 0
    out = capsys.readouterr().out
    flag_lines = [line for line in out.splitlines() if line.startswith("-")]
    documented = {m for line in flag_lines for m in re.findall(r"--[a-z][a-z0-9-]*", line.split("  ")[0])}
    assert set(FLAGS) <= documented
    assert "-h, --help" in out  # engine-check's sign that the help is whole
    for line in flag_lines:  # the flag at column 0, its description at column 40, on one line
        assert len(line) > 40 and line[38:40] == "  " and line[40] != " ", line
    assert "LLMGW_SIM_API_KEY" in out and "heartbeats every 1 s" in out


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert sim("--version") == 0
    assert capsys.readouterr().out.startswith("llmgw sim engine ")


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ([], "the following arguments are required: --model"),
        (["--model", "m", "--port", "70000"], "argument --port: 70000 is not a port (0..65535)"),
        (["--model", "m", "--output-token-ms", "-1"], "argument --output-token-ms: -1 must be a finite number, 0 or more"),
        (["--model", "m", "--nnodes", "0"], "argument --nnodes: 0 must be 1 or more"),
        (["--model", "m", "--dist-init-addr", "node01"], "argument --dist-init-addr: 'node01' is not HOST:PORT"),
    ],
)  # fmt: skip
def test_bad_flags_print_the_help_and_exit_2(args: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert sim(*args) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("usage: llmgw engine sim") and says in err


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--nnodes", "2"], "--nnodes 2 needs --dist-init-addr HOST:PORT"),
        (["--nnodes", "2", "--node-rank", "2", "--dist-init-addr", "h:1"], "--node-rank 2 is out of range for --nnodes 2; use 0..1"),
        (["--api-key", ""], "--api-key is empty"),
    ],
)  # fmt: skip
def test_bad_combinations_exit_2_naming_the_flag(
    args: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert sim("--model", "m", *args) == 2
    assert says in capsys.readouterr().err


def test_addresses() -> None:
    assert parse_addr("10.0.0.1:29500") == ("10.0.0.1", 29500)
    assert parse_addr("node01:1") == ("node01", 1)
    assert parse_addr("[fd00::1]:29500") == ("fd00::1", 29500)
    assert format_addr(("fd00::1", 29500)) == "[fd00::1]:29500"
    for bad, says in (
        ("fd00::1:5", "in brackets"),
        ("h:0", "not in 1..65535"),
        ("h:", "not HOST:PORT"),
        (":5", "not HOST:PORT"),
    ):
        with pytest.raises(ValueError, match=re.escape(says)):
            parse_addr(bad)


def test_options_defaults_serve_one_node_on_localhost() -> None:
    options = SimOptions(model="m").check()
    assert (options.host, options.nnodes, options.node_rank, options.is_worker) == ("127.0.0.1", 1, 0, False)
    assert "k3y" not in repr(SimOptions(model="m", api_key="k3y"))


def key_args(api_key: str | None = None, api_key_file: Path | None = None) -> argparse.Namespace:
    return argparse.Namespace(api_key=api_key, api_key_file=None if api_key_file is None else str(api_key_file))


def test_the_key_comes_from_the_flag_or_the_file_before_the_environment(tmp_path: Path) -> None:
    env = {"LLMGW_SIM_API_KEY": "from-env"}
    key_file = tmp_path / "api-key"
    key_file.write_text("from-file\n# a comment line llama-server would skip\n")
    assert api_key_of(key_args(api_key_file=key_file), env) == "from-file"
    assert api_key_of(key_args(api_key="from-flag"), env) == "from-flag"
    assert api_key_of(key_args(), env) == "from-env"
    assert api_key_of(key_args(), {}) is None


@pytest.mark.parametrize(
    ("content", "both", "says"),
    [
        (None, False, "cannot read --api-key-file {path}: No such file or directory"),
        ("\n", False, "--api-key-file {path} holds no key on its first line"),
        ("k\n", True, "give --api-key or --api-key-file, not both"),
    ],
)
def test_a_bad_key_file_is_refused_naming_it(tmp_path: Path, content: str | None, both: bool, says: str) -> None:
    key_file = tmp_path / "api-key"
    if content is not None:
        key_file.write_text(content)
    with pytest.raises(UsageError, match=re.escape(says.format(path=key_file))):
        api_key_of(key_args(api_key="k" if both else None, api_key_file=key_file), {})
