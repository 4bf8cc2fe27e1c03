"""The node-add screen in a real terminal: a tmux pane runs screen_driver.py under `trio.run`,
keys go in with `send-keys` and what is drawn comes back with `capture-pane`.

Each test has its own tmux server (`-L`), killed at the end; every wait is bounded.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmgw.config import FabricDecl
from llmgw.nodeadd.screen import offered_name, typed_name
from llmgw.wire.agent_link import FabricGroup
from testlib.terminal import Terminal, words

DRIVER = Path(__file__).with_name("screen_driver.py")
TIMEOUT = 10.0

# What screen_driver.py shows (kept here too: the test says what it expects, not what the driver has).
TITLE = "llmgw node add ubuntu@10.0.0.21"
FINGERPRINT = "ssh-ed25519 SHA256:q9Xh3vS0mB1T7rV2LkP4zW8yN6aJcE5dFgHiUoKtQwA"
LONG_DETAIL = (
    "ubuntu@10.0.0.21 refused every key offered (publickey): tried ~/.ssh/id_ed25519 and ~/.ssh/id_rsa, "
    "neither is in the node's authorized_keys; copy one there with ssh-copy-id ubuntu@10.0.0.21\n"
    "then run llmgw node add again"
)


class Pane(Terminal):
    """The pane running the driver, and what the driver got from run_with_screen."""

    def __init__(self, tmp_path: Path, scenario: str) -> None:
        self.out = tmp_path
        super().__init__(tmp_path, [sys.executable, str(DRIVER), scenario, str(tmp_path)], timeout_s=TIMEOUT)

    def result(self) -> dict:
        path = self.out / "result.json"
        self.wait_exit()
        assert path.exists(), f"the driver wrote no result; the pane:\n{self.scrollback()}"
        return json.loads(path.read_text())

    def release(self) -> None:
        (self.out / "release").write_text("")


@pytest.fixture
def pane(tmp_path: Path) -> Iterator:
    panes: list[Pane] = []

    def start(scenario: str) -> Pane:
        panes.append(Pane(tmp_path, scenario))
        return panes[-1]

    try:
        yield start
    finally:
        for p in panes:
            p.close()


def test_the_checklist_and_the_three_questions_answered_by_keys(pane) -> None:
    p = pane("questions")
    screen = p.wait_for("is not in known_hosts", FINGERPRINT)
    assert TITLE in screen
    assert "[ok] read the certificate authority" in screen
    assert "[..] connect over SSH and verify the host key" in screen
    assert "[  ] run llmgw doctor on the node" in screen
    p.keys("y")

    screen = p.wait_for("llmgw doctor failed 2 check(s) on the node")
    assert "[ok] connect over SSH and verify the host key" in screen and "host key added" in screen
    for needle in ("gpu-driver: nvidia-smi not found", "fix: install the NVIDIA driver 550 or later"):
        assert needle in screen
    for needle in ("clock: clock off by 12 s", "fix: enable chrony or systemd-timesyncd"):
        assert needle in screen
    p.keys("n")

    # A --fabric naming one of the group's adapters is offered for the group.
    screen = p.wait_for("group 1 of 3: infiniband adapters mlx5_0, mlx5_1")
    assert "fabrics in the cluster: ib-a, ib-b" in screen and "subnet manager 0x0002c9" in screen
    assert "fabric name: rail-0" in screen
    p.keys("Enter")

    # Else the cluster's first fabric; an invalid name is refused with the reason, then a valid one.
    screen = p.wait_for("group 2 of 3: infiniband adapters mlx5_2")
    assert "fabric name: ib-a" in screen
    p.keys("C-u")
    p.type("bad name!")
    p.keys("Enter")
    p.wait_for("fabric name 'bad name!' may use only letters, digits")
    p.keys("C-u")
    p.type("ib-b")
    p.keys("Enter")

    # An empty name leaves the group out.
    screen = p.wait_for("group 3 of 3: roce adapters mlx5_3")
    assert "fabric name: ib-a" in screen  # ib-b is taken on this node now
    p.keys("C-u", "Enter")

    screen = p.wait_for("[XX] make the node's key and CSR there, sign it here")
    assert "[!!] run llmgw doctor on the node" in screen and "2 checks failed, gone past" in screen
    assert words(LONG_DETAIL) in words(screen)  # in full, wrapped
    assert "fabric name:" not in screen  # the panel is gone once answered
    p.release()

    assert p.result() == {
        "terminal_restored": True,
        "returned": {
            "host_key": True,
            "doctor": False,
            "fabrics": [
                {"name": "rail-0", "adapters": ["mlx5_0", "mlx5_1"]},
                {"name": "ib-b", "adapters": ["mlx5_2"]},
            ],
        },
    }


def test_the_bodys_error_comes_out_as_itself_and_the_summary_stays(pane) -> None:
    p = pane("failing")
    screen = p.wait_for("[XX] connect over SSH and verify the host key", LONG_DETAIL)
    first_line = LONG_DETAIL.splitlines()[0]
    assert not any(first_line in line for line in screen.splitlines())  # wrapped, not one cut line
    p.release()

    assert p.result() == {"raised": "AuthFailed", "message": LONG_DETAIL, "original": True, "terminal_restored": True}
    # The screen is gone (the normal buffer is back) and the summary was printed there.
    after = p.scrollback()
    assert "[XX]" not in after and "q or Ctrl-C: stop" not in after
    lines = after.splitlines()
    assert TITLE in lines
    assert "ok      read the certificate authority" in lines
    assert "failed  connect over SSH and verify the host key" in lines
    assert "pending wait for the node to join and install llama.cpp" in lines
    assert "        then run llmgw node add again" in lines
    assert words(LONG_DETAIL) in words(after)


@pytest.mark.parametrize("key", ["q", "C-c"])
def test_q_or_ctrl_c_cancels_the_body(pane, key: str) -> None:
    p = pane("waiting")
    p.wait_for("[..] read the certificate authority", "q or Ctrl-C: stop")
    p.keys(key)

    result = p.result()
    assert result["raised"] == "UsageError" and result["terminal_restored"]
    assert "stopped by the operator" in result["message"] and "during step 'authority'" in result["message"]
    assert (p.out / "body-cancelled").exists()
    assert "started read the certificate authority" in p.scrollback().splitlines()


GROUP = FabricGroup(identity="ib:0xfe80aa", kind="infiniband", adapters=("mlx5_0", "mlx5_1"))


def test_the_name_offered_for_a_group() -> None:
    given = (FabricDecl(name="other", adapters=("mlx5_7",)), FabricDecl(name="rail-0", adapters=("mlx5_1",)))
    assert offered_name(GROUP, ["ib-a"], given, taken=[]) == "rail-0"
    assert offered_name(GROUP, ["ib-a", "ib-b"], (), taken=["ib-a"]) == "ib-b"
    assert offered_name(GROUP, ["ib-a"], (), taken=["ib-a"]) == ""
    assert offered_name(GROUP, [], (FabricDecl(name="all"),), taken=[]) == ""  # no adapters: none to match


def test_a_typed_name_is_checked() -> None:
    assert typed_name("  ib-a ", GROUP, []) == "ib-a"
    assert typed_name("   ", GROUP, []) == ""
    with pytest.raises(ValueError, match="may use only letters"):
        typed_name("ib a", GROUP, [])
    with pytest.raises(ValueError, match=r"name only.*mlx5_0, mlx5_1"):
        typed_name("ib-a:mlx5_0", GROUP, [])
    with pytest.raises(ValueError, match="already names mlx5_4"):
        typed_name("ib-a", GROUP, [FabricDecl(name="ib-a", adapters=("mlx5_4",))])
