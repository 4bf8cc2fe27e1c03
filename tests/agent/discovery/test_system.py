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


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


MEMINFO = "MemTotal:       16384000 kB\nMemFree:         1000000 kB\nMemAvailable:   12000000 kB\n"
GIB = 1 << 30


def test_a_cgroup_v2_limit_bounds_total_and_available(tmp_path: Path) -> None:
    unit = "system.slice/llmgw-agent.service"
    proc = _tree(tmp_path / "proc", {"meminfo": MEMINFO, "self/cgroup": f"0::/{unit}\n"})
    sys = _tree(
        tmp_path / "cgroup",
        {
            f"{unit}/memory.max": f"{4 * GIB}\n",
            f"{unit}/memory.current": f"{GIB}\n",
            "system.slice/memory.max": "max\n",
        },
    )
    m = system.read_memory(proc, sys)
    assert m == system.MemInfo(total_bytes=4 * GIB, available_bytes=3 * GIB, cgroup=f"/{unit}")
    # The machine's available memory is the bound when it is the less.
    (proc / "meminfo").write_text(MEMINFO.replace("12000000", "1048576"))
    assert system.read_memory(proc, sys).available_bytes == GIB
    # "max": no limit; /proc/meminfo's figures stand.
    (sys / unit / "memory.max").write_text("max\n")
    assert system.read_memory(proc, sys) == system.read_meminfo(proc)
    # A limit above the machine's memory changes nothing either.
    (sys / unit / "memory.max").write_text(f"{64 * GIB}\n")
    assert system.read_memory(proc, sys).cgroup == ""


def test_a_slice_above_the_agent_bounds_it_and_the_least_room_counts(tmp_path: Path) -> None:
    proc = _tree(tmp_path / "proc", {"meminfo": MEMINFO, "self/cgroup": "0::/llmgw.slice/agent.service\n"})
    sys = _tree(
        tmp_path / "cgroup",
        {
            "llmgw.slice/memory.max": f"{2 * GIB}\n",
            "llmgw.slice/memory.current": f"{GIB + GIB // 2}\n",  # its other units use most of it
            "llmgw.slice/agent.service/memory.max": f"{3 * GIB}\n",
            "llmgw.slice/agent.service/memory.current": f"{GIB // 4}\n",
        },
    )
    m = system.read_memory(proc, sys)
    assert (m.total_bytes, m.available_bytes, m.cgroup) == (2 * GIB, GIB // 2, "/llmgw.slice")


def test_cgroup_v1s_memory_controller_is_read_on_a_hybrid_host(tmp_path: Path) -> None:
    # systemd's hybrid layout: the unified hierarchy without the memory controller, v1's memory.
    proc = _tree(
        tmp_path / "proc",
        {"meminfo": MEMINFO, "self/cgroup": "9:name=systemd:/\n4:memory:/node-2\n1:cpu,cpuacct:/\n0::/\n"},
    )
    sys = _tree(
        tmp_path / "cgroup",
        {
            "unified/cgroup.procs": "",
            "memory/memory.limit_in_bytes": "9223372036854771712\n",  # v1's "no limit"
            "memory/memory.usage_in_bytes": f"{5 * GIB}\n",
            "memory/node-2/memory.limit_in_bytes": f"{GIB}\n",
            "memory/node-2/memory.usage_in_bytes": f"{GIB // 4}\n",
        },
    )
    m = system.read_memory(proc, sys)
    assert (m.total_bytes, m.available_bytes, m.cgroup) == (GIB, 3 * GIB // 4, "/node-2")


def test_a_container_whose_cgroup_is_mounted_as_the_root_reads_the_root(tmp_path: Path) -> None:
    # No cgroup namespace: /proc/self/cgroup names the host's path, which is not under the mount.
    proc = _tree(tmp_path / "proc", {"meminfo": MEMINFO, "self/cgroup": "0::/docker/0123abcd\n"})
    sys = _tree(tmp_path / "cgroup", {"memory.max": f"{GIB}\n", "memory.current": "0\n"})
    assert system.read_memory(proc, sys) == system.MemInfo(total_bytes=GIB, available_bytes=GIB, cgroup="/")


def test_without_a_readable_cgroup_the_machines_figures_stand(tmp_path: Path) -> None:
    proc = _tree(tmp_path / "proc", {"meminfo": MEMINFO})
    assert system.read_memory(proc, tmp_path / "none") == system.read_meminfo(proc)
    (proc / "self").mkdir()
    (proc / "self" / "cgroup").write_text("0::/a\n")
    _tree(tmp_path / "cgroup", {"a/memory.max": "garbage\n"})
    assert system.read_memory(proc, tmp_path / "cgroup") == system.read_meminfo(proc)
    assert system.read_memory(tmp_path / "no-proc", tmp_path / "cgroup") is None
