"""A real Debian 12 machine for tests: systemd as its init, its own network, a real sshd.

`Machine` boots a copy of the cached Debian 12 root (tools/testenv/debian_root.py, made once by
debootstrap) with `systemd-nspawn --boot` inside a network namespace the test makes (NetNS: a
veth pair, this machine's side `host_addr`, the machine's `eth0` = `node_addr`). The copy is an
overlay whose writes land in the test's directory (`upper`), so the cached root stays as built and
every machine starts new. What node add meets there is what it meets on a real node: PID 1 is
systemd, units are enabled and started by systemctl, logs are in the journal, and a reboot
(`reboot()`: `systemctl reboot` inside, the container exits with 133 and is booted again, as a
VM's hypervisor would) starts only what is enabled.

`address=False` leaves eth0 unconfigured, for a machine whose network cloud-init sets up
(`cloud_init=True` with a NoCloud seed written under /var/lib/cloud/seed/nocloud before `start`);
otherwise cloud-init is disabled (/etc/cloud/cloud-init.disabled), as on a machine installed by
hand.

`machine_fixture(hostname)` is the one pytest fixture of a booted machine the tests make theirs
(`machine = machine_fixture("gw1")` in a test module), with a hook that changes its files first.

Needs root, iproute2, debootstrap and systemd-container; runs without systemd or dbus on this
machine (`--register=no --keep-unit`). A boot takes under a second here (about 7 s when
cloud-init runs a first boot). A machine whose test process dies without stopping it (a Pants
timeout) is powered off (PR_SET_PDEATHSIG); its overlay mount and namespace are left.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from testlib.needs import find, missing_message
from testlib.netns import NetNS
from testlib.sshd import keygen

BOOT_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
REBOOT_STATUS = 133  # systemd-nspawn's exit status when the container asked for a reboot
# What building llama.cpp from source needs (agent/install/build.py), which a stock image lacks.
BUILD_TOOLS = ("cc", "c++", "cmake", "make")
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"  # systemd's: its services'
TOOLS = (("systemd-nspawn", "systemd-container"), ("debootstrap", "debootstrap"), ("ip", "iproute2"))


PR_SET_PDEATHSIG = 1


def _stop_with_the_test() -> None:
    """In the child, before nspawn runs: SIGTERM (nspawn's clean power-off) when the test process
    dies without stopping the machine (a Pants timeout kills it), so no machine outlives its test."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def preflight() -> str:
    """Why this machine cannot boot a Machine, or "" when it can (a test fails with it: never a skip)."""
    if os.geteuid() != 0:
        return "systemd-nspawn, debootstrap and network namespaces need root: run the suite as root (CI does)"
    for tool, package in TOOLS:
        if find(tool) is None:
            return missing_message(tool, package)
    return ""


def debian_root() -> Path:
    """The cached Debian 12 root, built now (about a minute, once) if `./pants test` has not."""
    from testenv import debian_root as builder

    return builder.build()


class Machine:
    def __init__(
        self,
        root: Path,
        *,
        hostname: str = "node1",
        index: int | None = None,
        address: bool = True,
        cloud_init: bool = False,
        mac: str | None = None,
        devices: tuple[str, ...] = (),
    ) -> None:
        """`mac` sets eth0's MAC address (what a cloud-init network-config matches); `devices`
        are this machine's device nodes (e.g. a loop device: a VM's second disk) bound into it."""
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.net = NetNS(index, address=address, mac=mac)
        self.devices = devices
        self.name = self.net.name  # the container's machine name too
        self.host_addr = self.net.host_addr
        self.node_addr = self.net.node_addr
        self.hostname = hostname
        self.cloud_init = cloud_init
        self.upper = root / "upper"
        self.merged = root / "merged"
        self.console_log = root / "console.log"
        self.client_key = keygen(root / "client_key", "llmgw-test-client")
        self.boots = 0
        self._nspawn: subprocess.Popen | None = None
        self._mounted = False
        self._prepare()

    @property
    def target(self) -> str:
        return f"root@{self.node_addr}"

    def path(self, node_path: str) -> Path:
        """Where a node path is seen from this machine (the overlay: read it, or write it before `start`)."""
        return self.merged / node_path.lstrip("/")

    def _prepare(self) -> None:
        lower = debian_root()
        work = self.root / "work"
        for d in (self.upper, work, self.merged):
            d.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [
                "mount",
                "-t",
                "overlay",
                "overlay",
                "-o",
                f"lowerdir={lower},upperdir={self.upper},workdir={work}",
                str(self.merged),
            ],
            check=True,
            capture_output=True,
            timeout=30,
        )
        self._mounted = True
        if self.cloud_init:
            return  # its hostname, logins and keys are cloud-init's to set
        self.path("/etc/hostname").write_text(self.hostname + "\n")
        ssh = self.path("/root/.ssh")
        ssh.mkdir(mode=0o700, exist_ok=True)
        keys = ssh / "authorized_keys"
        keys.write_text((self.root / "client_key.pub").read_text())
        keys.chmod(0o600)
        self.path("/etc/cloud/cloud-init.disabled").write_text("a test machine set up by hand\n")

    def start(self) -> None:
        """Make the network and boot; returns once systemd says the boot is finished and sshd listens."""
        self.net.start()
        try:
            self._boot()
        except BaseException:
            self.stop()
            raise

    def _boot(self) -> None:
        self.boots += 1
        with self.console_log.open("ab") as log:
            log.write(f"--- boot {self.boots} ---\n".encode())
            log.flush()
            self._nspawn = subprocess.Popen(
                [
                    # nspawn runs inside the namespace (nsenter execs it), not given it with
                    # --network-namespace-path: only then is the machine's /sys its own namespace's,
                    # so /sys/class/net lists its eth0 (cloud-init matches the MAC there), not
                    # this machine's interfaces. (`ip netns exec` would also remount /sys, without
                    # the cgroup hierarchy nspawn needs.)
                    "nsenter",
                    f"--net=/run/netns/{self.net.name}",
                    "systemd-nspawn",
                    "--quiet",
                    "--boot",
                    "--register=no",
                    "--keep-unit",
                    # The namespace is the machine's own: it may configure it (ifupdown, cloud-init).
                    "--capability=CAP_NET_ADMIN",
                    f"--machine={self.name}",
                    "--console=passive",
                    *(f"--bind={device}" for device in self.devices),
                    f"--directory={self.merged}",
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
                preexec_fn=_stop_with_the_test,
            )
        deadline = time.monotonic() + BOOT_TIMEOUT_S
        while True:
            if self._nspawn.poll() is not None:
                raise RuntimeError(f"systemd-nspawn exited with {self._nspawn.returncode}:\n{self.console()}")
            if self.leader() is not None:
                # While systemd starts, systemctl may wait on it for longer than a poll: that
                # is "not yet" (the boot's own deadline below decides), not a failed boot.
                try:
                    state = self.run("systemctl", "is-system-running", check=False, timeout=5).stdout.strip()
                except subprocess.TimeoutExpired:
                    state = "starting"
                if state in ("running", "degraded"):
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the machine did not finish booting within {BOOT_TIMEOUT_S} s:\n{self.console()}")
            time.sleep(0.1)
        if state == "degraded":  # say which unit failed: a test's failure is then readable
            failed = self.run("systemctl", "--failed", "--no-pager", "--plain", check=False).stdout
            with self.console_log.open("a") as log:
                log.write(f"booted degraded:\n{failed}\n")

    def leader(self) -> int | None:
        """The container's PID 1 as this machine numbers it (None while nspawn is still starting it)."""
        if self._nspawn is None:
            return None
        try:
            children = Path(f"/proc/{self._nspawn.pid}/task/{self._nspawn.pid}/children").read_text().split()
        except OSError:
            return None
        for pid in children:
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            for line in status.splitlines():
                if line.startswith("NSpid:") and line.split()[-1] == "1" and len(line.split()) > 2:
                    return int(pid)
        return None

    def run(
        self, *argv: str, check: bool = True, timeout: float = 60, input: str | None = None
    ) -> subprocess.CompletedProcess:
        """A command inside the machine (all its namespaces), as root; its output as text."""
        leader = self.leader()
        if leader is None:
            raise RuntimeError("the machine is not running")
        out = subprocess.run(
            ["nsenter", "-t", str(leader), "-a", *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            input=input,
        )
        if check and out.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} on the machine: exit {out.returncode}\n{out.stdout}{out.stderr}")
        return out

    def on_path(self, *tools: str) -> list[str]:
        """Where each of `tools` the machine has is, as its services (the agent) find them on
        systemd's PATH; those it lacks are left out."""
        found = []
        for tool in tools:
            done = self.run("env", f"PATH={SYSTEM_PATH}", "sh", "-c", 'command -v "$0"', tool, check=False)
            if done.returncode == 0:
                found.append(done.stdout.strip())
        return found

    def systemctl(self, *argv: str) -> str:
        return self.run("systemctl", "--no-pager", *argv, check=False).stdout.strip()

    def journal(self, unit: str, lines: int = 50) -> str:
        return self.run("journalctl", "--no-pager", "-u", unit, "-n", str(lines), check=False).stdout

    def reboot(self) -> None:
        """`systemctl reboot` inside; the container stops, and is booted again as a hypervisor would."""
        assert self._nspawn is not None
        self.run("systemctl", "reboot", check=False)
        status = self._nspawn.wait(timeout=STOP_TIMEOUT_S)
        if status != REBOOT_STATUS:
            raise RuntimeError(f"systemd-nspawn exited with {status} on a reboot, not {REBOOT_STATUS}")
        self._boot()

    def console(self) -> str:
        return self.console_log.read_text(errors="replace") if self.console_log.exists() else ""

    def stop(self) -> None:
        """Power off (SIGTERM to nspawn: a clean shutdown), then whatever is left is killed; unmount."""
        proc, self._nspawn = self._nspawn, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=STOP_TIMEOUT_S)
        self.net.stop()
        if self._mounted:
            subprocess.run(["umount", "--lazy", str(self.merged)], capture_output=True, timeout=30)
            self._mounted = False

    def __enter__(self) -> Machine:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def machine_fixture(hostname: str, *, before_boot: Callable[[Machine], None] | None = None):
    """A pytest fixture (name it `machine` in the module): a Machine called `hostname` under the
    test's directory, booted for the test and stopped after it however it ends; `before_boot`
    changes its files first (Machine.path). Where this machine cannot boot one, the test fails
    saying why: never a skip."""

    @pytest.fixture()
    def machine(tmp_path: Path) -> Iterator[Machine]:
        why = preflight()
        if why:
            pytest.fail(why)
        m = Machine(tmp_path / "machine", hostname=hostname)
        try:
            if before_boot is not None:
                before_boot(m)
            m.start()
            yield m
        finally:
            m.stop()

    return machine


def copy_in(machine: Machine, source: Path, node_path: str, mode: int = 0o644) -> None:
    """A file from this machine placed on the (running or not) machine."""
    dest = machine.path(node_path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, dest)
    dest.chmod(mode)


def copy_dir_in(machine: Machine, source: Path, node_path: str) -> None:
    """A directory from this machine (its files, modes and symbolic links) placed on the machine:
    llama.cpp's, whose llama-server loads its libraries from beside it."""
    shutil.copytree(source, machine.path(node_path), symlinks=True, dirs_exist_ok=True)
