"""Runs `run_with_screen` in a real terminal for test_screen.py: a scripted body per scenario.

    python screen_driver.py SCENARIO OUT_DIR

The body emits events and asks questions as `llmgw node add` would; what the screen returned
or raised goes to OUT_DIR/result.json. Where the test must look at the screen before it goes,
the body waits for OUT_DIR/release (bounded) before it ends.
"""

from __future__ import annotations

import json
import sys
import termios
from pathlib import Path

import attrs
import trio

from llmgw.config import FabricDecl
from llmgw.nodeadd.errors import AuthFailed
from llmgw.nodeadd.node.steps import STEPS
from llmgw.nodeadd.questions import DoctorFailure
from llmgw.nodeadd.screen import run_with_screen
from llmgw.nodeadd.steps import FAILED, OK, STARTED, WARN, Event
from llmgw.wire.agent_link import FabricGroup

TITLE = "llmgw node add ubuntu@10.0.0.21"
FINGERPRINT = "ssh-ed25519 SHA256:q9Xh3vS0mB1T7rV2LkP4zW8yN6aJcE5dFgHiUoKtQwA"
FAILURES = (
    DoctorFailure(check="gpu-driver", detail="nvidia-smi not found", fix="install the NVIDIA driver 550 or later"),
    DoctorFailure(check="clock", detail="clock off by 12 s", fix="enable chrony or systemd-timesyncd"),
)
GROUPS = (
    FabricGroup(
        identity="ib:0xfe80aa", kind="infiniband", adapters=("mlx5_0", "mlx5_1"), detail="subnet manager 0x0002c9"
    ),
    FabricGroup(identity="ib:0xfe80bb", kind="infiniband", adapters=("mlx5_2",), detail="subnet manager 0x0002ca"),
    FabricGroup(identity="roce:10.9.0.0/24", kind="roce", adapters=("mlx5_3",)),
)
EXISTING = ("ib-a", "ib-b")
GIVEN = (FabricDecl(name="rail-0", adapters=("mlx5_1",)),)
# Longer than the 120-column pane, with a second line: drawn wrapped and in full.
LONG_DETAIL = (
    "ubuntu@10.0.0.21 refused every key offered (publickey): tried ~/.ssh/id_ed25519 and ~/.ssh/id_rsa, "
    "neither is in the node's authorized_keys; copy one there with ssh-copy-id ubuntu@10.0.0.21\n"
    "then run llmgw node add again"
)
AUTH_FAILED = AuthFailed(LONG_DETAIL)


async def released(out: Path) -> None:
    with trio.fail_after(30):
        while not (out / "release").exists():
            await trio.sleep(0.05)


async def questions_body(emit, questions, out: Path) -> dict:
    emit(Event(step="authority", status=STARTED))
    emit(Event(step="authority", status=OK, detail="ca in /etc/llmgw"))
    emit(Event(step="connect", status=STARTED))
    host_key = await questions.accept_host_key("ubuntu@10.0.0.21", FINGERPRINT)
    emit(Event(step="connect", status=OK, detail="host key added"))
    for step in ("identify", "address", "ship"):
        emit(Event(step=step, status=STARTED))
        emit(Event(step=step, status=OK))
    emit(Event(step="doctor", status=STARTED))
    doctor = await questions.go_past_doctor(FAILURES)
    emit(Event(step="doctor", status=WARN, detail="2 checks failed, gone past"))
    emit(Event(step="fabrics", status=STARTED))
    fabrics = await questions.name_fabrics(GROUPS, EXISTING, GIVEN)
    emit(Event(step="fabrics", status=OK))
    emit(Event(step="identity", status=STARTED))
    emit(Event(step="identity", status=FAILED, detail=LONG_DETAIL))
    await released(out)
    return {"host_key": host_key, "doctor": doctor, "fabrics": [attrs.asdict(d) for d in fabrics]}


async def failing_body(emit, questions, out: Path) -> dict:
    emit(Event(step="authority", status=STARTED))
    emit(Event(step="authority", status=OK))
    emit(Event(step="connect", status=STARTED))
    emit(Event(step="connect", status=FAILED, detail=LONG_DETAIL))
    await released(out)
    raise AUTH_FAILED


async def waiting_body(emit, questions, out: Path) -> dict:
    emit(Event(step="authority", status=STARTED))
    try:
        await trio.sleep_forever()
    finally:
        (out / "body-cancelled").write_text("yes")


BODIES = {"questions": questions_body, "failing": failing_body, "waiting": waiting_body}


async def main(scenario: str, out: Path) -> int:
    body = BODIES[scenario]
    before = termios.tcgetattr(sys.stdin.fileno())  # canonical mode, echo, Ctrl-C as SIGINT
    try:
        value = await run_with_screen(TITLE, lambda emit, questions: body(emit, questions, out), STEPS)
    except Exception as exc:  # noqa: BLE001 - what came out is the result under test
        result = {"raised": type(exc).__name__, "message": str(exc), "original": exc is AUTH_FAILED}
    else:
        result = {"returned": value}
    result["terminal_restored"] = termios.tcgetattr(sys.stdin.fileno()) == before
    (out / "result.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(trio.run(main, sys.argv[1], Path(sys.argv[2])))
