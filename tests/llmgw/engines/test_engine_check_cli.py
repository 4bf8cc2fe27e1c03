"""`llmgw ctl engine-check`: where the help comes from, what it prints, and its exit status."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest

from llmgw import cli
from testlib.proc import build_root

HELP = build_root() / "tests" / "fixtures" / "help"


def engine_check(*args: str) -> int:
    return cli.main(["ctl", "engine-check", *args])


def fake_engine(tmp_path: Path, body: str) -> str:
    """A stand-in for an engine that is not installed here: a script printing a recorded help."""
    path = tmp_path / "engine"
    path.write_text(f"#!{sys.executable}\nimport os, sys\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_whole_help_from_a_file_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert engine_check("llamacpp", "--help-file", str(HELP / "llama-server.txt")) == 0
    out = capsys.readouterr().out
    assert "  ok      --alias\n" in out
    assert out.endswith("result: ok (exit 0)\n")


def test_help_given_as_text_the_way_the_docs_show(capsys: pytest.CaptureFixture[str]) -> None:
    # `--help-output "$(llama-server --help 2>&1)"`: the text starts with "-----", which
    # argparse must still take as the option's value.
    text = "".join((HELP / "llama-server.txt").read_text().splitlines(keepends=True)[:400])
    assert text.startswith("-----")
    assert engine_check("llamacpp", "--help-output", text) == 2
    out = capsys.readouterr().out
    for flag in ("--alias", "--api-key-file", "--host", "--port", "--slot-prompt-similarity"):
        assert f"  MISSING {flag}\n" in out
    assert "MISSING LLAMA_API_KEY" in out
    assert "result: 6 of llmgw's flags missing, 0 problems in models' args (exit 2)" in out


def test_warnings_only_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    # The sim's layout (flags at column 0), every flag llmgw uses, but no --help line.
    text = "".join(f"{f} X  what it does\n" for f in ("--model", "--host", "--port", "--nnodes", "--node-rank"))
    text += "--dist-init-addr A  where\n--api-key KEY  the key (env: LLMGW_SIM_API_KEY)\n--api-key-file F  its file\n"
    assert engine_check("sim", "--help-output", text) == 1
    assert "warning: the help text does not document --help itself" in capsys.readouterr().out


def test_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert engine_check("vllm", "--help-file", str(HELP / "vllm-summary.txt"), "--json") == 2
    result = json.loads(capsys.readouterr().out)
    assert result["status"] == 2
    assert result["missing"] == result["checked"]
    assert result["warnings"][0].startswith("this is vLLM's summary help")
    assert result["help_source"].endswith("vllm-summary.txt")


def test_catalog_args_are_checked_with_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    server_toml = tmp_path / "server.toml"
    server_toml.write_text(
        "[[models]]\nname = 'big'\nengine = 'sglang'\nsource = { path = '/w/big' }\n"
        "args = ['--mem-fraction-static', '0.8', '--tp', '8']\n"
        "[[models]]\nname = 'toy'\nengine = 'sim'\nargs = ['--bogus']\n"
    )
    assert engine_check("sglang", "--help-file", str(HELP / "sglang.txt"), "--config", str(server_toml)) == 2
    out = capsys.readouterr().out
    assert "args: model 'big': --tp is not in SGLang's help; check its spelling against that version\n" in out
    assert "toy" not in out  # another engine's model


def test_runs_the_installed_engine_with_what_vllm_needs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    vllm = fake_engine(
        tmp_path,
        # What vLLM 0.32.0 does: no accelerator and no VLLM_TARGET_DEVICE, no help.
        "if not os.environ.get('VLLM_TARGET_DEVICE'):\n"
        "    sys.exit('RuntimeError: Failed to infer device type')\n"
        "assert sys.argv[1:] == ['serve', '--help=all'], sys.argv\n"
        f"sys.stdout.write(open({str(HELP / 'vllm.txt')!r}).read())",
    )
    assert engine_check("vllm", "--binary", vllm) == 0
    assert f"documented by `{vllm} serve --help=all`" in capsys.readouterr().out


def test_the_engines_own_error_is_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "tpu")  # the operator's choice is passed on, not replaced
    vllm = fake_engine(tmp_path, "sys.exit('RuntimeError: no device ' + os.environ['VLLM_TARGET_DEVICE'])")
    assert engine_check("vllm", "--binary", vllm) == 2
    err = capsys.readouterr().err
    assert f"`{vllm} serve --help=all` failed (exit status 1); it said:\nRuntimeError: no device tpu" in err


def test_an_engine_that_is_not_installed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert engine_check("llamacpp", "--binary", str(tmp_path / "llama-server")) == 2
    assert "not found, so llama.cpp cannot be asked for its help; pass --binary PATH" in capsys.readouterr().err


def test_sim_asks_this_llmgw(capsys: pytest.CaptureFixture[str]) -> None:
    assert engine_check("sim") == 0
    assert "-m llmgw engine sim --help`" in capsys.readouterr().out


def test_help_and_text_are_exclusive(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        engine_check("sim", "--help-output", "x", "--help-file", "y")
    assert exit_info.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_help_says_the_exit_statuses(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        engine_check("--help")
    out = capsys.readouterr().out
    assert "exit status:\n  0  every flag llmgw uses is documented\n  1  warnings only" in out


def test_an_unreadable_help_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert engine_check("sim", "--help-file", str(tmp_path / "nope.txt")) == 2
    assert "cannot read the help file" in capsys.readouterr().err
