"""A real OpenSSH server on loopback for tests: its own host key, one authorized client key.

It logs in as the user running the tests (root in CI; `PermitRootLogin prohibit-password`), logs
at VERBOSE to a file so a test can see whether a session started, and listens on 127.0.0.1 only.
`restart(new_host_key=True)` brings it back on the same port with another host key.
"""

from __future__ import annotations

import os
import pwd
import subprocess
import time
from pathlib import Path

from testlib.needs import missing_message
from testlib.ports import free_port

SSHD = Path("/usr/sbin/sshd")
START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 5.0


def keygen(path: Path, comment: str) -> Path:
    """An unencrypted ed25519 key pair at `path` and `path`.pub."""
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
        check=True,
        timeout=30,
        capture_output=True,
    )
    return path


def fingerprint_of(pub: Path) -> str:
    """`SHA256:...` of a public key, from ssh-keygen itself."""
    out = subprocess.run(["ssh-keygen", "-lf", str(pub)], check=True, timeout=30, capture_output=True, text=True)
    return out.stdout.split()[1]


SFTP_SERVER = Path("/usr/lib/openssh/sftp-server")


def sshd_config(
    *, listen: str, host_key: Path, pid_file: Path | str, authorized_keys: Path | str, sftp_log: str = ""
) -> str:
    """Key logins only (root too), no PAM, VERBOSE logging (a session shows as "Starting session:"), SFTP.
    `sftp_log`: a file where SFTP logs each file it opens (`open "PATH" flags WRITE,...`): what was copied."""
    sftp = f"{SFTP_SERVER} -e -l INFO 2>>{sftp_log}" if sftp_log else "internal-sftp"
    return "\n".join(
        [
            f"ListenAddress {listen}",
            f"HostKey {host_key}",
            f"PidFile {pid_file}",
            f"AuthorizedKeysFile {authorized_keys}",
            "PermitRootLogin prohibit-password",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "StrictModes no",
            "UsePAM no",
            "PrintMotd no",
            "LogLevel VERBOSE",
            f"Subsystem sftp {sftp}",  # a command is run by the login's shell: the redirection works
            "",
        ]
    )


class Sshd:
    def __init__(self, root: Path) -> None:
        if not SSHD.exists():
            raise RuntimeError(missing_message(str(SSHD), "openssh-server"))
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.user = pwd.getpwuid(os.getuid()).pw_name
        self.port = free_port()
        self.log = root / "sshd.log"
        self.client_key = keygen(root / "client_key", "llmgw-test-client")
        (root / "authorized_keys").write_text((root / "client_key.pub").read_text())
        self._generation = 0
        self.host_key = self._new_host_key()
        self._proc: subprocess.Popen | None = None

    @property
    def target(self) -> str:
        return f"{self.user}@127.0.0.1"

    @property
    def host_key_fingerprint(self) -> str:
        return fingerprint_of(self.host_key.with_suffix(".pub"))

    def _new_host_key(self) -> Path:
        self._generation += 1
        return keygen(self.root / f"host_key_{self._generation}", "llmgw-test-host")

    def _config(self) -> Path:
        config = self.root / "sshd_config"
        config.write_text(
            sshd_config(
                listen=f"127.0.0.1:{self.port}",
                host_key=self.host_key,
                pid_file=self.root / "sshd.pid",
                authorized_keys=self.root / "authorized_keys",
            )
        )
        return config

    def start(self) -> None:
        if os.geteuid() == 0:
            Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # its privilege-separation directory
        offset = self.log.stat().st_size if self.log.exists() else 0
        with self.log.open("ab") as log:
            self._proc = subprocess.Popen(
                [str(SSHD), "-D", "-e", "-f", str(self._config())],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while f"Server listening on 127.0.0.1 port {self.port}" not in self.log_text(offset):
            if self._proc.poll() is not None:
                raise RuntimeError(f"sshd exited with {self._proc.returncode}:\n{self.log_text(offset)}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"sshd did not listen within {START_TIMEOUT_S} s:\n{self.log_text(offset)}")
            time.sleep(0.02)

    def stop(self) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=STOP_TIMEOUT_S)
        self._proc = None

    def restart(self, *, new_host_key: bool = False) -> None:
        self.stop()
        if new_host_key:
            self.host_key = self._new_host_key()
        self.start()

    def log_text(self, offset: int = 0) -> str:
        with self.log.open("rb") as f:
            f.seek(offset)
            return f.read().decode("utf-8", "replace")

    def sessions_started(self) -> int:
        """How many commands or subsystems sshd started ("Starting session: ..." at VERBOSE)."""
        return self.log_text().count("Starting session:")
