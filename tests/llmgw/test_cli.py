"""The command registry: help lists what works, usage errors show the command's help, exit codes."""

from __future__ import annotations

import argparse
import json
from typing import NoReturn

import pytest

from llmgw import cli
from testlib.proc import run_llmgw


def test_help_lists_exactly_the_registered_commands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    listed = [line.split()[0] for line in out.split("commands:\n")[1].splitlines() if line.startswith("  ")]
    assert listed == [c.name for c in cli.COMMANDS]


@pytest.mark.parametrize("command", [c.name for c in cli.COMMANDS])
def test_every_listed_command_has_working_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--help"])
    assert exit_info.value.code == 0
    assert f"usage: llmgw {command}" in capsys.readouterr().out


def test_no_arguments_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == cli.EXIT_USAGE
    assert "commands:" in capsys.readouterr().err


def test_unknown_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["frobnicate"])
    assert exit_info.value.code == cli.EXIT_USAGE
    names = [c.name for c in cli.COMMANDS]
    assert names == sorted(names)
    assert "ca" in names
    assert f"unknown command 'frobnicate' (one of: {', '.join(names)})" in capsys.readouterr().err


def test_usage_error_prints_that_commands_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["config", "check", "--kind", "nope", "x.toml"])
    assert exit_info.value.code == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("usage: llmgw config check")
    assert "--kind {server,agent,auto}" in err
    assert "argument --kind: invalid choice: 'nope'" in err


def test_log_options_work_before_and_after_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--log-level", "debug", "version"]) == 0
    assert cli.main(["version", "--log-format", "json"]) == 0


def test_version_json_has_version_commit_and_python(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["version", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert set(info) >= {"version", "commit", "python", "architecture", "build_date"}
    assert info["python"].startswith("3.")


def test_config_error_exits_2_with_the_path(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "server.toml"
    f.write_text('[[models]]\nname = "a"\nengine = "sim"\nreplicas = "2"\n')
    assert cli.main(["config", "check", str(f)]) == 2
    assert f"{f}: expected int, got str '2' @ $.models[0].replicas" in capsys.readouterr().err


def test_python_dash_m_runs_the_same_cli_as_a_process() -> None:
    done = run_llmgw("version", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["version"]
    done = run_llmgw("config")
    assert done.returncode == 2
    assert done.stderr.startswith("usage: llmgw config")


def test_a_service_that_fails_at_start_says_why_not_internal_error(tmp_path) -> None:
    # `llmgw agent run` without its certificates: the agent's own error and status 1, not the
    # signal watcher's complaint about a closed receiver (exit 70, "a bug in llmgw").
    config = tmp_path / "agent.toml"
    config.write_text(f'server = "wss://127.0.0.1:9"\nstate_dir = "{tmp_path / "state"}"\n')
    done = run_llmgw("agent", "run", "--config", str(config))
    assert done.returncode == 1, done.stderr
    assert "ca.crt does not exist" in done.stderr and "llmgw node add" in done.stderr
    assert "internal error" not in done.stderr


def _command_tree() -> list[tuple[str, argparse.ArgumentParser]]:
    """Every parser of the CLI, by the words that reach it: each command and each subcommand."""
    found = [("llmgw", cli._top_parser())]
    todo = [(f"llmgw {c.name}", cli.build_parser(c.name)) for c in cli.COMMANDS]
    while todo:
        path, parser = todo.pop()
        found.append((path, parser))
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo.extend((f"{path} {name}", sub) for name, sub in action.choices.items())
    return found


class _Refused(Exception):
    pass


def test_no_parser_in_the_command_tree_takes_an_abbreviated_option() -> None:
    tree = _command_tree()
    assert {"llmgw up", "llmgw agent supervise", "llmgw ctl keys create", "llmgw server backup"} <= {p for p, _ in tree}
    tried = 0
    for path, parser in tree:
        # Nothing else is required here, so an option argparse does not know ends up in the extras.
        for action in parser._actions:
            action.required = False
        for group in parser._mutually_exclusive_groups:
            group.required = False

        def error(message: str) -> NoReturn:
            raise _Refused(message)

        parser.error = error  # type: ignore[method-assign]
        spelled = {s for a in parser._actions for s in a.option_strings}
        for option in sorted(s for s in spelled if s.startswith("--") and len(s) > 4):
            abbreviation = option[:-1]
            if abbreviation in spelled:
                continue
            tried += 1
            try:
                _, extras = parser.parse_known_args([abbreviation])
            except _Refused as exc:
                raise AssertionError(f"`{path} {abbreviation}` was taken as {option}: {exc}") from None
            assert extras == [abbreviation], f"`{path} {abbreviation}` was taken as {option}"
    assert tried > 100


def test_a_typo_of_an_option_is_a_usage_error_not_another_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.build_parser("up").parse_args(["--node", "3"])  # parsed only: were it taken, nothing starts
    assert exit_info.value.code == cli.EXIT_USAGE
    assert "unrecognized arguments: --node 3" in capsys.readouterr().err
