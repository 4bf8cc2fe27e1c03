"""Installing infiniband-diags: apt-get and dnf stood in for by scripts that 'install' sminfo."""

from __future__ import annotations

from pathlib import Path

from agent import ibdiags


def fake_package_manager(tmp_path: Path, name: str, *, lists_missing: bool = False) -> tuple[str, Path, Path]:
    """A package manager that installs tmp/sbin/sminfo; with lists_missing, only after `update`."""
    sminfo = tmp_path / "sbin" / "sminfo"
    calls = tmp_path / f"{name}.calls"
    lists = tmp_path / "lists"
    if not lists_missing:
        lists.mkdir()
    script = tmp_path / name
    script.write_text(
        f"""#!/bin/sh
echo "$* DEBIAN_FRONTEND=$DEBIAN_FRONTEND" >> {calls}
case "$1" in
  update) mkdir -p {lists}; exit 0 ;;
  install)
    if [ ! -d {lists} ]; then echo "E: Unable to locate package infiniband-diags" >&2; exit 100; fi
    mkdir -p {sminfo.parent} && printf '#!/bin/sh\\n' > {sminfo} && chmod 755 {sminfo}
    ;;
esac
"""
    )
    script.chmod(0o755)
    return str(script), sminfo, calls


def test_present_or_not_needed_runs_nothing(tmp_path: Path) -> None:
    apt, sminfo, calls = fake_package_manager(tmp_path, "apt-get")
    assert ibdiags.ensure(str(sminfo), "debian", needed=False, apt_get=apt).status == ibdiags.NOT_NEEDED
    assert not calls.exists()
    sminfo.parent.mkdir()
    sminfo.write_text("#!/bin/sh\n")
    sminfo.chmod(0o755)
    assert ibdiags.ensure(str(sminfo), "debian", needed=True, apt_get=apt).status == ibdiags.PRESENT


def test_apt_installs_after_updating_stale_package_lists(tmp_path: Path) -> None:
    apt, sminfo, calls = fake_package_manager(tmp_path, "apt-get", lists_missing=True)
    outcome = ibdiags.ensure(str(sminfo), "debian", needed=True, apt_get=apt)
    assert outcome == ibdiags.Outcome(
        status=ibdiags.INSTALLED, detail=f"installed infiniband-diags with {apt}; sminfo at {sminfo}"
    )
    assert calls.read_text().splitlines() == [
        "install -y --no-install-recommends infiniband-diags DEBIAN_FRONTEND=noninteractive",
        "update DEBIAN_FRONTEND=noninteractive",
        "install -y --no-install-recommends infiniband-diags DEBIAN_FRONTEND=noninteractive",
    ]


def test_dnf(tmp_path: Path) -> None:
    dnf, sminfo, calls = fake_package_manager(tmp_path, "dnf")
    assert ibdiags.ensure(str(sminfo), "rhel", needed=True, dnf=dnf).status == ibdiags.INSTALLED
    [call] = calls.read_text().splitlines()
    assert call.startswith("install -y infiniband-diags ")


def test_failure_says_what_the_package_manager_said(tmp_path: Path) -> None:
    outcome = ibdiags.ensure(str(tmp_path / "sminfo"), "debian", needed=True, apt_get=str(tmp_path / "no-apt"))
    assert outcome.status == ibdiags.FAILED
    assert outcome.detail.startswith(
        f"`{tmp_path / 'no-apt'} install -y --no-install-recommends infiniband-diags` not found"
    )
    other = ibdiags.ensure(str(tmp_path / "sminfo"), "", needed=True)
    assert other.status == ibdiags.FAILED and "no apt-get or dnf here" in other.detail
