"""The checkout's `./llmgw` script, run for real in a copy of a checkout whose `./pants` is a
stand-in (a test cannot run Pants inside Pants): it builds dist/llmgw.pex only when there is none
or the sources' content changed, once for two callers, never leaves Pants output on standard
output, and then becomes the pex (same pid: signals and the exit status are llmgw's), telling it
how it was invoked."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from testlib.proc import build_root

# Stands in for `./pants package src/python/llmgw:llmgw`: logs each call, takes BUILD_S, and
# writes a "pex" that reports how it was run and exits 7 (or 0 on SIGINT, as llmgw does).
FAKE_PANTS = """#!/usr/bin/env bash
set -eu
echo "$*" >>pants.calls
echo "pants says this on standard output"
# Like pantsd, a daemon may outlive the build, with whatever descriptors it was given.
[[ -z "${LEAVE_DAEMON:-}" ]] || { sleep 60 </dev/null >/dev/null 2>&1 & echo $! >daemon.pid; }
sleep "${BUILD_S:-0}"
[[ -z "${BUILD_FAILS:-}" ]] || exit 3
distdir=dist
[[ "$1" != --pants-distdir=* ]] || distdir="${1#--pants-distdir=}"
mkdir -p "$distdir"
cat >"$distdir/llmgw.pex" <<'PEX'
#!/usr/bin/env bash
echo "pid=$$ args=$* invoked_as=$LLMGW_INVOKED_AS"
[[ "${1:-}" != wait ]] || { trap 'exit 0' INT; echo ready; while :; do sleep 0.1; done; }
exit 7
PEX
chmod +x "$distdir/llmgw.pex"
"""


BUILD_CALL = "--pants-distdir=dist/.llmgw-build package src/python/llmgw:llmgw"


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    root = tmp_path / "checkout"
    for d in ("src/python/llmgw", "3rdparty/python"):
        (root / d).mkdir(parents=True)
    (root / "src/python/llmgw/cli.py").write_text("print('hello')\n")
    (root / "3rdparty/python/requirements.txt").write_text("trio\n")
    (root / "BUILD").write_text("")
    (root / "pants.toml").write_text("")
    (root / "pants").write_text(FAKE_PANTS)
    (root / "pants").chmod(0o755)
    shutil.copy(build_root() / "llmgw", root / "llmgw")
    (root / "llmgw").chmod(0o755)
    return root


def run(checkout: Path, *args: str, cwd: Path | None = None, script: str = "./llmgw", **env: str):
    return subprocess.run(
        [script, *args],
        cwd=cwd or checkout,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env},
        check=False,
    )


def builds(checkout: Path) -> list[str]:
    calls = checkout / "pants.calls"
    return calls.read_text().splitlines() if calls.exists() else []


def test_it_builds_the_pex_once_then_runs_it_with_the_arguments_and_its_exit_status(checkout: Path) -> None:
    first = run(checkout, "ctl", "nodes", "--state-dir", "/x y")
    assert builds(checkout) == [BUILD_CALL]
    assert not (checkout / "dist/.llmgw-build/llmgw.pex").exists()  # built aside, renamed into place
    assert first.stderr.startswith(
        "llmgw: building dist/llmgw.pex (there is none yet): ./pants package src/python/llmgw:llmgw\n"
    )
    assert "pants says this on standard output" in first.stderr  # standard output is llmgw's alone
    assert first.stdout.endswith("args=ctl nodes --state-dir /x y invoked_as=./llmgw\n") and first.returncode == 7
    again = run(checkout, "version")
    assert builds(checkout) == [BUILD_CALL] and again.stderr == ""
    assert again.stdout.endswith("args=version invoked_as=./llmgw\n") and again.returncode == 7


def test_only_a_change_of_content_rebuilds_it(checkout: Path) -> None:
    run(checkout, "version")
    source = checkout / "src/python/llmgw/cli.py"
    os.utime(source, (time.time() + 60, time.time() + 60))  # touched, same content
    (checkout / "docs.md").write_text("not an input\n")
    run(checkout, "version")
    assert len(builds(checkout)) == 1
    for changed in (source, checkout / "3rdparty/python/requirements.txt", checkout / "pants.toml"):
        changed.write_text(changed.read_text() + "# changed\n")
        done = run(checkout, "version")
        assert "(the sources changed since it was built)" in done.stderr
    (checkout / "src/python/llmgw/new.py").write_text("")
    run(checkout, "version")
    assert len(builds(checkout)) == 5


def test_a_failed_build_runs_nothing_and_is_tried_again(checkout: Path) -> None:
    failed = run(checkout, "version", BUILD_FAILS="1")
    assert failed.returncode == 3 and "args=" not in failed.stdout
    done = run(checkout, "version")
    assert done.returncode == 7 and len(builds(checkout)) == 2


def test_two_at_once_build_it_once(checkout: Path) -> None:
    env = {**os.environ, "BUILD_S": "1"}
    both = [
        subprocess.Popen(["./llmgw", "version"], cwd=checkout, env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    assert [p.wait(60) for p in both] == [7, 7]
    assert builds(checkout) == [BUILD_CALL]


def interruptible() -> None:
    """In the child: SIGINT at its default, as a terminal's Ctrl-C finds it. A suite started in
    the background of a non-interactive shell (`cmd &` in a script) inherits SIGINT ignored, and
    bash, the stand-in pex, can neither trap nor reset a signal ignored when it started: its
    `trap ... INT` would do nothing and the test wait out its timeout (seen in a fresh run)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_it_becomes_llmgw_so_ctrl_c_reaches_llmgw_and_its_status_is_the_commands(checkout: Path) -> None:
    run(checkout, "version")  # built
    proc = subprocess.Popen(
        ["./llmgw", "wait"], cwd=checkout, stdout=subprocess.PIPE, text=True, preexec_fn=interruptible
    )
    try:
        assert proc.stdout is not None
        said = proc.stdout.readline()
        assert said.startswith(f"pid={proc.pid} "), said  # exec'd: the pid Ctrl-C is sent to
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(10) == 0
    finally:
        proc.kill()


def test_the_printed_commands_start_the_way_it_was_run(checkout: Path) -> None:
    elsewhere = checkout.parent / "elsewhere"
    elsewhere.mkdir()
    done = run(checkout, "version", cwd=elsewhere, script="../checkout/llmgw")
    assert done.stdout.endswith("invoked_as=../checkout/llmgw\n")
    spaced = checkout.parent / "my checkout"
    checkout.rename(spaced)
    done = run(spaced, "version", script="./llmgw", cwd=spaced)
    assert done.stdout.endswith("invoked_as=./llmgw\n")
    done = run(spaced, "version", script=str(spaced / "llmgw"), cwd=elsewhere)
    assert done.stdout.endswith(f"invoked_as={str(spaced).replace(' ', chr(92) + ' ')}/llmgw\n")


def test_a_daemon_the_build_leaves_behind_does_not_hold_the_next_build(checkout: Path) -> None:
    run(checkout, "version", LEAVE_DAEMON="1")
    daemon = int((checkout / "daemon.pid").read_text())
    try:
        (checkout / "src/python/llmgw/cli.py").write_text("print('changed')\n")
        started = time.monotonic()
        done = run(checkout, "version", LLMGW_BUILD_WAIT_S="5")
        assert done.returncode == 7, done.stderr  # rebuilt and ran: the lock was free
        assert time.monotonic() - started < 5 and len(builds(checkout)) == 2
    finally:
        os.kill(daemon, signal.SIGKILL)
