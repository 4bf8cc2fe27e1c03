"""Reading documented flags out of help texts: both layouts, aliases, paired switches, and what
must not be taken for an option (usage blocks, descriptions, free text)."""

from __future__ import annotations

import pytest

from llmgw.engines.helptext import documented_flags
from testlib.proc import build_root

HELP = build_root() / "tests" / "fixtures" / "help"  # README.md there says where each came from


def help_text(name: str) -> str:
    return (HELP / name).read_text(encoding="utf-8")


def test_llama_server_help() -> None:
    flags = documented_flags(help_text("llama-server.txt"), "column0")
    assert len(flags.groups) == 256  # `grep -c '^-'` of the same file, less the "-----" section rules
    assert flags.aliases("-h") == {"-h", "--help", "--usage"}
    assert flags.aliases("--ctx-size") == {"-c", "--ctx-size"}
    assert flags.aliases("-ngl") == {"-ngl", "--gpu-layers", "--n-gpu-layers"}
    assert flags.aliases("--no-kv-offload") == {"-kvo", "--kv-offload", "-nkvo", "--no-kv-offload"}
    assert {"--perf", "--no-perf", "--api-key", "--alias"} <= flags.flags
    # Descriptions at column 40 are not options, even when they start with a dash.
    assert "-" not in flags.flags and "--threads" in flags.flags


def test_vllm_help_all() -> None:
    flags = documented_flags(help_text("vllm.txt"), "argparse")
    assert flags.aliases("--nnodes") == {"--nnodes", "-n"}
    assert flags.aliases("-tp") == {"-tp", "--tensor-parallel-size"}
    assert flags.aliases("--enable-log-requests") == {"--enable-log-requests", "--no-enable-log-requests"}
    assert {"--help", "--headless", "--master-addr", "--served-model-name", "--api-key"} <= flags.flags
    assert len(flags.flags) > 400


def test_vllm_summary_documents_no_flag() -> None:
    # Its description mentions "--help=ModelConfig" at column 0: free text, not an option.
    text = help_text("vllm-summary.txt")
    assert "\n--help=ModelConfig" in text
    assert documented_flags(text, "argparse").flags == frozenset()


def test_sglang_help() -> None:
    flags = documented_flags(help_text("sglang.txt"), "argparse")
    assert flags.aliases("--tp-size") == {"--tp-size", "--tensor-parallel-size"}
    assert flags.aliases("--dist-init-addr") == {"--dist-init-addr", "--nccl-init-addr"}
    assert flags.aliases("--model-path") == {"--model-path", "--model"}
    # The usage block lists every flag too, indented 20 columns: it is not documentation.
    assert "--tp" not in flags.flags


SYNTHETIC = """\
usage: engine [-h] [--alpha N]
  -h, --help            show this help message and exit
  --[no-]color          colour the output
  --beta=VALUE, -b      one with an = and a short alias
  --gamma[=LEVEL]       an optional value
    --nested X          argparse indents nested groups by 2 more
                        --not-an-option describing something
--column0               free text at column 0 in an argparse help
"""


def test_argparse_layout_details() -> None:
    flags = documented_flags(SYNTHETIC, "argparse")
    assert flags.groups == (
        frozenset({"-h", "--help"}),
        frozenset({"--color", "--no-color"}),
        frozenset({"--beta", "-b"}),
        frozenset({"--gamma"}),
        frozenset({"--nested"}),
    )


def test_column0_layout_ignores_indented_lines() -> None:
    assert documented_flags(SYNTHETIC, "column0").flags == {"--column0"}


def test_unknown_layout_is_a_bug() -> None:
    with pytest.raises(ValueError, match="unknown help style"):
        documented_flags("", "markdown")
