"""Every `llmgw doctor` command the docs show is accepted, and the ones on fixtures run."""

from __future__ import annotations

import re
import shlex

import pytest

from agent import doctor
from llmgw import cli
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
    assert {n for item in parsed.ignore for n in item.split(",")} <= set(doctor.NAMES)


@pytest.mark.parametrize(("doc", "args"), [(d, a) for d, a in commands() if any("tests/fixtures" in x for x in a)])
def test_commands_on_fixtures_run_from_a_checkout(doc: str, args: list[str]) -> None:
    done = run_llmgw("doctor", *args, cwd=build_root())
    assert done.returncode in (0, 1, 2), done.stderr
    if "--json" in args:
        assert done.stdout.startswith("{")
    else:
        lines = [line for line in done.stdout.splitlines() if not line.lstrip().startswith("fix:")]
        assert [line.split()[1] for line in lines] == [n for n in doctor.NAMES if n != "control-plane"]
        # Only this machine's own clock, disk and service manager may be other than ok on the
        # recorded hardware.
        assert {line.split()[1] for line in lines if not line.startswith("ok ")} <= {"clock", "disk", "service-manager"}
