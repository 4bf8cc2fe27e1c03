"""What the docs and doctor say about llmgw-provision-node is what it does."""

from __future__ import annotations

import re
import shlex
from types import ModuleType

from agent.discovery import cpu
from testlib.proc import build_root
from testlib.provision import Host

DOCS = ("node-onboarding.md", "install.md")


def doc(name: str) -> str:
    return (build_root() / "docs" / name).read_text()


def test_every_command_the_docs_show_is_accepted(tool: ModuleType) -> None:
    shown = [line for name in DOCS for line in doc(name).splitlines() if line.startswith("llmgw-provision-node ")]
    assert len(shown) >= 2
    for line in shown:
        args = tool.parser().parse_args(shlex.split(line)[1:])  # exits 2 on a flag it does not know
        assert args.vmid == 144 and args.name == "llmgw-node04"


def test_the_runs_commands_in_the_docs_are_the_ones_it_runs(host: Host, tool: ModuleType) -> None:
    block = doc("node-onboarding.md").split("A run does, in order:\n\n```\n", 1)[1].split("```", 1)[0]
    shown = [shlex.split(line) for line in block.splitlines()]
    done = host.run()  # the command the docs show first, on the test host's files
    assert done.returncode == 0, done.stderr
    mac = tool.derived_mac(144, "llmgw-node04").upper()
    replaced = {str(host.image): tool.DEFAULT_IMAGE, str(host.keys): "/root/.ssh/authorized_keys", mac: "MAC"}
    ran = [
        [re.sub("|".join(map(re.escape, replaced)), lambda m: replaced[m.group(0)], a) for a in c]
        for c in host.fake.mutating_calls()
    ]
    assert ran == shown


def test_doctor_names_the_tool_and_its_default_accurately(tool: ModuleType) -> None:
    assert "llmgw-provision-node" in cpu.FIX_PROXMOX and "`--cpu host` is the default" in cpu.FIX_PROXMOX
    args = tool.parser().parse_args(["--vmid", "144", "--name", "n", "--ip", "10.0.0.1/24"])
    assert args.cpu == "host"
