"""Remote commands are quoted: hostile words reach the program as they are and run nothing.

The commands are run by a real POSIX shell (`sh -c`), as sshd runs them on the node."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from llmgw.errors import UsageError
from llmgw.nodeadd.remote import command, pipeline, sudo_command

HOSTILE = [
    "node; touch {canary}",
    "$(touch {canary})",
    "`touch {canary}`",
    "a' ; touch {canary} ; '",
    'a" ; touch {canary} ; "',
    "node\ntouch {canary}",
    "--help && touch {canary}",
    "*",
    "~root",
    "${{IFS}}touch${{IFS}}{canary}",
]


@pytest.mark.parametrize("template", HOSTILE)
def test_a_hostile_word_is_one_literal_argument(tmp_path: Path, template: str) -> None:
    canary = tmp_path / "pwned"
    word = template.format(canary=canary)
    echo_argv = [sys.executable, "-c", "import sys, json; print(json.dumps(sys.argv[1:]))", word, "second"]
    done = subprocess.run(["sh", "-c", command(echo_argv)], capture_output=True, text=True, cwd=tmp_path, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == json.dumps([word, "second"])
    assert not canary.exists()


def test_sudo_is_added_for_other_users_and_never_prompts() -> None:
    assert (
        sudo_command(["systemctl", "restart", "llmgw-agent"], user="ubuntu")
        == "sudo -n -- systemctl restart llmgw-agent"
    )
    assert sudo_command(["systemctl", "restart", "llmgw-agent"], user="root") == "systemctl restart llmgw-agent"


def test_a_pipeline_stops_at_the_first_failure(tmp_path: Path) -> None:
    canary = tmp_path / "after"
    script = pipeline(["false"], ["touch", str(canary)])
    assert subprocess.run(["sh", "-c", script], check=False).returncode != 0
    assert not canary.exists()


def test_nul_bytes_are_refused() -> None:
    with pytest.raises(UsageError):
        command(["echo", "a\x00b"])
