"""Start a process the way systemd's socket activation does: listening sockets that this
process owns (and keeps across the child's restarts) passed as file descriptors 3, 4, ...
with LISTEN_FDS and LISTEN_PID set (sd_listen_fds(3)).

A child must see LISTEN_PID equal to its own pid, which only exists after the fork; so the
child is a small Python trampoline that moves the sockets to 3, 4, ..., sets LISTEN_PID to its
pid and execs the real command (exec keeps the pid).
"""

from __future__ import annotations

import socket
import subprocess
import sys

TRAMPOLINE = """
import fcntl, os, sys
fds = [int(f) for f in sys.argv[1].split(",")]
high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 100) for fd in fds]
for i, fd in enumerate(high):
    os.dup2(fd, 3 + i)
    os.close(fd)
os.environ["LISTEN_FDS"] = str(len(fds))
os.environ["LISTEN_PID"] = str(os.getpid())
os.execvp(sys.argv[2], sys.argv[2:])
"""


def listening_socket(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(4096)
    return sock


def argv(command: list[str], sockets: list[socket.socket]) -> list[str]:
    """The command line that runs `command` with `sockets` passed as fds 3, 4, ..."""
    return [sys.executable, "-c", TRAMPOLINE, ",".join(str(s.fileno()) for s in sockets), *command]


def popen(command: list[str], sockets: list[socket.socket], **kw) -> subprocess.Popen:
    return subprocess.Popen(argv(command, sockets), pass_fds=[s.fileno() for s in sockets], **kw)
