"""The packaged executable (`./pants package src/python/llmgw:llmgw`) runs the same CLI as `python -m llmgw`."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from testlib.proc import build_root, run_llmgw


def pex() -> Path:
    path = build_root() / "llmgw.pex"
    assert (
        path.is_file()
    ), f"{path} missing: the test target must list src/python/llmgw:llmgw in runtime_package_dependencies"
    return path


def run_pex(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(pex()), *args], capture_output=True, text=True, timeout=120, check=False)


def test_same_help_same_usage_error() -> None:
    for args in (["--help"], ["config", "check", "--help"], ["config"]):
        packaged, module = run_pex(*args), run_llmgw(*args)
        assert (packaged.returncode, packaged.stdout, packaged.stderr) == (
            module.returncode,
            module.stdout,
            module.stderr,
        )


def test_packaged_version_knows_its_commit() -> None:
    done = run_pex("version", "--json")
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    # The pex carries the commit it was built from and when (pants-plugins/llmgw_build), unlike a
    # bare source tree: a commit time for a clean tree, the build's for a dirty one.
    assert re.fullmatch(r"[0-9a-f]{12}(-dirty)?", info["commit"]), info
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", info["build_date"]) and info["build_target"] == "pex", info
    assert info["version"] == json.loads(run_llmgw("version", "--json").stdout)["version"]
