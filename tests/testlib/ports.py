"""Ports for test servers on loopback."""

from __future__ import annotations

import random
import socket

# Where free_port looks: below Linux's ephemeral range (32768-60999), which the kernel hands out
# to every outgoing connection and every bind to port 0 — a port taken from there by a test
# may be taken again by the next bind(0) of a test running beside it before its server listens.
# Here only another free_port picks, at random among 12,000.
FREE_PORTS = range(20000, 32000)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now. Another process may take it before we do; on loopback in
    a test run that is rare enough, and a server that cannot listen says so in its log."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for _ in range(200):
        port = random.choice(FREE_PORTS)
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port on {host} in {FREE_PORTS.start}-{FREE_PORTS.stop - 1} after 200 tries")
