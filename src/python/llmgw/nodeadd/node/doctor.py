"""The `doctor` and `fabrics` steps of `llmgw node add`: what the node has.

Doctor runs from the stage (the release `ship` delivered there, before anything outside the stage
changes); its report decides whether the run goes on, and the operator may go on past a failed
check (questions.py, or `--ignore-doctor`). `fabrics` names the adapter groups doctor found,
asking the operator for names not given.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from llmgw import config as cfg
from llmgw import driverpaths
from llmgw.errors import MachineError, PeerError
from llmgw.nodeadd import ssh
from llmgw.nodeadd.context import DOCTOR_S, SHORT_S, said, staged_llmgw
from llmgw.nodeadd.node import layout
from llmgw.nodeadd.node.install import Facts, Options
from llmgw.nodeadd.questions import DoctorFailure, Questions
from llmgw.nodeadd.steps import OK, WARN
from llmgw.wire.agent_link import FabricGroup

# -- doctor --------------------------------------------------------------------------------


async def doctor(
    opts: Options, s: ssh.SshSession, facts: Facts, questions: Questions
) -> tuple[str, str, dict[str, Any]]:
    await check_driver_paths(opts, s)
    host = f"[{facts.address}]" if ":" in facts.address else facts.address
    args = ["doctor", "--json", "--server", f"{host}:{facts.port}"]
    if facts.existing is not None:
        args += ["--config", layout.CONFIG]  # its paths (nvidia_smi, ib_root, ...) as the agent will use them
    for key, path in opts.driver_paths.items():  # the flags given win over that file, as in the agent.toml written
        args += [driverpaths.by_key(key).flag, path]
    for decl in facts.given_fabrics(opts):
        args += ["--fabric", f"{decl.name}:{','.join(decl.adapters)}" if decl.adapters else decl.name]
    if opts.ignore_doctor:
        args += ["--ignore", ",".join(sorted(opts.ignore_doctor))]
    res = await s.run(staged_llmgw(facts, *args), sudo=True, timeout_s=DOCTOR_S)
    try:
        report = json.loads(res.stdout)
        checks = report["checks"]
    except (ValueError, KeyError, TypeError):
        raise PeerError(
            f"{s.target}: llmgw doctor did not run there ({said(res)}); nothing was changed on the node"
        ) from None
    failures = [
        DoctorFailure(check=c["name"], detail=c["detail"], fix=c.get("fix", ""))
        for c in checks
        if c["status"] == "fail" and not c.get("ignored")
    ]
    warnings = [c for c in checks if c["status"] in ("warn", "unknown") and not c.get("ignored")]
    ignored = [c["name"] for c in checks if c.get("ignored")]
    inventory = report.get("inventory") or {}
    # The GPUs doctor found, said where the operator reads: a wrong --nvidia-smi looks like none.
    gpus = f"; GPUs: {inventory.get('gpu_detail')}" if inventory.get("gpu_status") == "present" else ""
    tail = gpus + (f"; ignored: {', '.join(ignored)}" if ignored else "")
    if failures:
        listed = "; ".join(f"{f.check}: {f.detail}" + (f" (fix: {f.fix})" if f.fix else "") for f in failures)
        if not await questions.go_past_doctor(failures):
            names = ",".join(f.check for f in failures)
            raise MachineError(
                f"doctor failed on {facts.node_id}: {listed}. Nothing was changed on the node. Fix this and run "
                f"again, or go on past it with --ignore-doctor {names}"
            )
        return WARN, f"went on past failed checks: {listed}{tail}", inventory
    if warnings:
        listed = "; ".join(f"{c['name']}: {c['detail']}" for c in warnings)
        return WARN, f"{len(checks) - len(warnings)} checks ok; warnings: {listed}{tail}", inventory
    return OK, f"{len(checks)} checks ok{tail}", inventory


async def check_driver_paths(opts: Options, s: ssh.SshSession) -> None:
    """Each --nvidia-smi, --ib-root, --sminfo given is there on the node (as root sees it), or a
    UsageError naming the flag: doctor would otherwise report a node without GPUs or adapters."""
    for key, path in opts.driver_paths.items():
        res = await s.run(driverpaths.test_argv(key, path), sudo=True, timeout_s=SHORT_S)
        if res.exit_status == 1:
            raise driverpaths.missing(key, path, str(s.target))
        if res.exit_status != 0:
            raise PeerError(f"{s.target}: checking {path} failed ({said(res)})")


# -- fabrics -------------------------------------------------------------------------------


async def fabrics(
    opts: Options, facts: Facts, inventory: dict[str, Any], nodes: list[dict[str, Any]], questions: Questions
) -> tuple[str, str]:
    groups = [
        FabricGroup(identity=g["identity"], kind=g["kind"], adapters=tuple(g["adapters"]), detail=g.get("detail", ""))
        for g in inventory.get("fabric_groups") or ()
    ]
    existing = sorted({f["name"] for n in nodes for f in n.get("fabrics") or ()})
    given = facts.given_fabrics(opts)
    if not groups and not given:
        return OK, "no active InfiniBand or RoCE adapter: the node is its own island"
    answered = tuple(await questions.name_fabrics(groups, existing, given)) if groups else ()
    # A declaration no group accounts for (doctor has checked it) is kept: the answer covers groups only.
    grouped = {a for g in groups for a in g.adapters}
    kept = tuple(d for d in given if d.name not in {a.name for a in answered} and not set(d.adapters) & grouped)
    facts.fabrics = answered + kept
    named = {a for d in facts.fabrics for a in d.adapters}
    text = "; ".join(f"{d.name}: {','.join(d.adapters) or 'the next two adapters'}" for d in facts.fabrics)
    unnamed = [g for g in groups if not set(g.adapters) & named and not _default_covers(facts.fabrics)]
    if unnamed:
        flags = " ".join(f"--fabric NAME:{','.join(g.adapters)}" for g in unnamed)
        left = "; ".join(f"{','.join(g.adapters)} on {g.identity}" for g in unnamed)
        return WARN, f"{text + '; ' if text else ''}not named, so unused for multi-node replicas: {left} ({flags})"
    return OK, text


def _default_covers(decls: Sequence[cfg.FabricDecl]) -> bool:
    return any(not d.adapters for d in decls)
