"""Memory, disk where weights go, OS family, modules and processes, from proc-shaped fixtures."""

from __future__ import annotations

from pathlib import Path

from agent.discovery import system
from testlib.hardware import FIXTURES


def test_meminfo_is_in_kib() -> None:
    m = system.read_meminfo(FIXTURES / "proc" / "xeon-host-vm")
    assert m == system.MemInfo(total_bytes=32863100 * 1024, available_bytes=30421876 * 1024)
    assert system.parse_meminfo("MemFree: 1 kB\n") is None


def test_disk_free_is_measured_on_the_nearest_existing_directory(tmp_path: Path) -> None:
    weights = tmp_path / "not" / "yet" / "weights"
    d = system.disk_free(weights)
    assert d is not None
    assert d.path == str(weights) and d.measured_at == str(tmp_path)
    assert 0 < d.free_bytes <= d.total_bytes
    weights.mkdir(parents=True)
    assert system.disk_free(weights).measured_at == str(weights)


def test_os_family_picks_the_package_manager() -> None:
    assert system.os_family(FIXTURES / "os-release" / "debian-12") == "debian"
    assert system.os_family(FIXTURES / "os-release" / "rocky-9") == "rhel"
    assert system.os_family(FIXTURES / "no-such-file") == ""
    assert system.os_name(FIXTURES / "os-release" / "rocky-9") == "Rocky Linux 9.3 (Blue Onyx)"


def test_modules_and_commands() -> None:
    proc = FIXTURES / "proc" / "hgx-h100"
    assert {"nvidia_peermem", "mlx5_ib"} <= system.loaded_modules(proc)
    # /proc/PID/comm is cut at 15 characters, as the kernel does.
    assert system.running_commands(proc) == {"systemd", "nv-fabricmanage", "nvidia-persiste", "opensm"}
    assert system.loaded_modules(FIXTURES / "proc" / "aarch64") is None
    assert system.running_commands(FIXTURES / "no-such-dir") is None


def test_the_clock_reading_says_when_it_cannot_tell() -> None:
    clock = system.read_clock()
    assert clock.now > 0 and clock.synchronized in (True, False, None)
