"""engine-check's judgement on real help texts: the widest command, cut-short help, vLLM's
summary, and operators' args."""

from __future__ import annotations

import pytest

from llmgw.engines import SPECS, check_args, check_engine, spec_for, widest_flags, widest_launches
from llmgw.engines.check import MISSING, OK, WARNINGS
from testlib.proc import build_root, run_llmgw

HELP = build_root() / "tests" / "fixtures" / "help"  # README.md there says where each came from


def help_text(name: str) -> str:
    return (HELP / name).read_text(encoding="utf-8")


FIXTURE = {"llamacpp": "llama-server.txt", "vllm": "vllm.txt", "sglang": "sglang.txt"}


def sim_help() -> str:
    done = run_llmgw("engine", "sim", "--help")
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize("engine", sorted(SPECS))
def test_every_flag_llmgw_uses_is_in_the_recorded_help(engine: str) -> None:
    text = sim_help() if engine == "sim" else help_text(FIXTURE[engine])
    result = check_engine(engine, text)
    assert (result.missing, result.missing_env, result.warnings) == ((), (), ())
    assert result.status == OK


def test_the_widest_command_is_multi_node_where_the_engine_spans_nodes() -> None:
    assert [r.node_rank for r in widest_launches(spec_for("vllm"))] == [0, 1]
    # llama.cpp's other ranks run its rpc-server, not llama-server: rank 0's flags, --rpc and the split among them.
    assert [r.node_rank for r in widest_launches(spec_for("llamacpp"))] == [0]
    assert widest_launches(spec_for("llamacpp"))[0].rpc_servers == ("127.0.0.1:50052",)
    # Flags a worker alone gets, or only a multi-node replica, are checked too.
    assert {"--headless", "--master-addr", "--nnodes", "--max-model-len"} <= set(widest_flags(spec_for("vllm")))
    # --api-key is set through SGLang's --config file: it is checked all the same.
    assert {"--dist-init-addr", "--context-length", "--config", "--api-key"} <= set(widest_flags(spec_for("sglang")))
    assert widest_flags(spec_for("llamacpp")) == (
        "--alias",
        "--api-key-file",
        "--ctx-size",
        "--host",
        "--model",
        "--n-gpu-layers",
        "--port",
        "--rpc",
        "--slot-prompt-similarity",
        "--tensor-split",
    )


def test_llama_help_cut_to_400_lines_reports_what_it_lacks() -> None:
    cut = "".join(help_text("llama-server.txt").splitlines(keepends=True)[:400])
    result = check_engine("llamacpp", cut)
    assert result.missing == ("--alias", "--api-key-file", "--host", "--port", "--slot-prompt-similarity")
    assert result.missing_env == ("LLAMA_API_KEY",)  # documented at line 588
    assert result.warnings == ()  # --help is at line 3: nothing says it was cut
    assert result.status == MISSING


def test_help_without_its_own_help_line_is_warned_about() -> None:
    lines = help_text("llama-server.txt").splitlines(keepends=True)
    result = check_engine("llamacpp", "".join(lines[len(lines) // 2 :]))
    assert len(result.warnings) == 1
    assert "does not document --help itself" in result.warnings[0]
    assert "`llama-server --help`" in result.warnings[0]
    assert result.missing == ("--ctx-size", "--model", "--n-gpu-layers", "--rpc", "--tensor-split")


def test_warnings_alone_exit_1() -> None:
    # A help that documents every flag llmgw uses but not --help: only the warning.
    text = (
        "\n".join(f"{f} X   d" for f in (*widest_flags(spec_for("llamacpp")), "--api-key")) + "\n(env: LLAMA_API_KEY)"
    )
    result = check_engine("llamacpp", text)
    assert (result.missing, result.status) == ((), WARNINGS)


def test_vllm_summary_help_is_recognised() -> None:
    result = check_engine("vllm", help_text("vllm-summary.txt"))
    assert result.warnings[0] == "this is vLLM's summary help; give the output of `vllm serve --help=all`"
    assert result.missing == result.checked
    assert result.status == MISSING


def test_no_options_at_all() -> None:
    result = check_engine("sglang", "Traceback (most recent call last):\nImportError: no module named torch\n")
    assert result.warnings == (
        "found no options in this text; is it the output of `python3 -m sglang.launch_server --help`?",
    )


def test_operator_args_unknown_or_overriding_llmgw() -> None:
    text = help_text("llama-server.txt")
    args = ["-np", "4", "-c", "8192", "--flash-attn", "on", "--n-predict", "-1", "--bogus", "-a", "x", "--port=1"]
    assert check_args("llamacpp", args, text) == [
        "--bogus is not in llama.cpp's help; check its spelling against that version",
        "-a sets what llmgw sets itself for every replica (--alias, -a); remove it from the model's args",
        "--port sets what llmgw sets itself for every replica (--port); remove it from the model's args",
    ]
    # An alias llmgw did not list is still caught through the help's own alias groups.
    assert check_args("vllm", ["--enforce-eager", "--pipeline-parallel-size", "2"], help_text("vllm.txt")) == [
        "--pipeline-parallel-size sets what llmgw sets itself for every replica (--pipeline-parallel-size, -pp); "
        "remove it from the model's args"
    ]
    assert check_args("sglang", ["--mem-fraction-static", "0.8"], help_text("sglang.txt")) == []


def test_args_are_part_of_the_result() -> None:
    result = check_engine("vllm", help_text("vllm.txt"), extra_args=["--enforce-eager", "--no-such-flag"])
    assert result.arg_problems == ("--no-such-flag is not in vLLM's help; check its spelling against that version",)
    assert result.status == MISSING
    assert result.to_dict()["status"] == MISSING
