"""Where a node's driver tools are: `--nvidia-smi`, `--ib-root` and `--sminfo`, the same three
flags on `llmgw doctor`, `llmgw agent run` and `llmgw node add`, each the agent.toml key of the
same name (nvidia_smi, ib_root, sminfo).

Owns the flags (names, help, defaults from `llmgw.config`), what a given path must be (absolute
for `agent run` and `node add`, which name a path on a node that a service reads later; doctor
takes relative paths too, for fixtures in a checkout), and the message when a given path is not
there. A flag not given is never checked: the defaults are where a node *may* have the tool (a
CPU node has no nvidia-smi, and that is fine). Pure: the callers test the paths, here or over
SSH, with `test_argv`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from llmgw import config as cfg
from llmgw.errors import UsageError


@attrs.frozen(kw_only=True)
class DriverPath:
    flag: str
    key: str  # the agent.toml key and the argparse dest
    metavar: str
    default: str
    what: str  # the help's wording
    kind: str  # "program" (an executable file) or "dir"
    example: str  # a non-default place, for messages
    find: str  # how to find it on the node, for messages


PATHS = (
    DriverPath(
        flag="--nvidia-smi",
        key="nvidia_smi",
        metavar="PATH",
        default=cfg.DEFAULT_NVIDIA_SMI,
        what="nvidia-smi",
        kind="program",
        example="/opt/nvidia/bin/nvidia-smi",
        find="`command -v nvidia-smi`, or `find / -xdev -name nvidia-smi -type f` there",
    ),
    DriverPath(
        flag="--ib-root",
        key="ib_root",
        metavar="DIR",
        default=cfg.DEFAULT_IB_ROOT,
        what="InfiniBand/RoCE adapters in sysfs",
        kind="dir",
        example="/sys/class/infiniband",
        find="`ls /sys/class/infiniband` there lists the adapters when the driver is loaded",
    ),
    DriverPath(
        flag="--sminfo",
        key="sminfo",
        metavar="PATH",
        default=cfg.DEFAULT_SMINFO,
        what="sminfo from infiniband-diags",
        kind="program",
        example="/usr/sbin/sminfo",
        find="`command -v sminfo` there",
    ),
)
KEYS = tuple(p.key for p in PATHS)


def add_options(group: Any, *, absolute: bool, overrides: str) -> None:
    """The three flags on an argparse parser or group. `overrides` says what a flag wins over
    (e.g. "agent.toml"); `absolute` refuses a relative path as a usage error naming the flag."""
    for p in PATHS:
        group.add_argument(
            p.flag,
            dest=p.key,
            metavar=p.metavar,
            type=absolute_arg(p) if absolute else str,
            help=f"{p.what} (default {p.default}); overrides {overrides}",
        )


def absolute_arg(p: DriverPath) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if not text.startswith("/"):
            raise argparse.ArgumentTypeError(
                f"{p.flag} takes an absolute path on the node (where the agent finds {p.what} whatever its "
                f"working directory), not {text!r}; e.g. {p.flag} {p.example}"
            )
        return text

    return parse


def given(args: argparse.Namespace) -> dict[str, str]:
    """The flags given, by agent.toml key; those not given are left out."""
    return {k: getattr(args, k) for k in KEYS if getattr(args, k, None)}


def by_key(key: str) -> DriverPath:
    return next(p for p in PATHS if p.key == key)


def test_argv(key: str, path: str) -> list[str]:
    """A command that exits 0 when `path` is what `key` needs (test(1): an executable file, a directory)."""
    return ["test", "-d" if by_key(key).kind == "dir" else "-x", path]


def missing(key: str, path: str, where: str) -> UsageError:
    """The error for a flag whose path `where` (a host, "this machine") does not have."""
    p = by_key(key)
    kind = "directory" if p.kind == "dir" else "executable file"
    return UsageError(
        f"{p.flag} {path}: {where} has no {kind} at that path, so the agent would not find {p.what} there. "
        f"Find where it is ({p.find}) and pass that, or leave {p.flag} out for the default {p.default}"
    )


def describe(paths: Mapping[str, str]) -> str:
    """`nvidia-smi /opt/...` and the like, for a step's detail."""
    return ", ".join(f"{by_key(k).flag[2:]} {v}" for k, v in paths.items())
