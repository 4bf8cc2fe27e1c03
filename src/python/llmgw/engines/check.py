"""Does an engine still take the flags llmgw gives it? Checked against the engine's own help.

Engines rename and remove flags between versions, and the failure then arrives minutes into a
model load on a node nobody watches. So the check builds the widest command llmgw would ever
produce (a multi-node one, every optional field set: a flag used only there is the one nobody
notices has gone) and looks up each flag in the help. The operator's `args` from the catalog
are checked the same way, and for overriding a flag llmgw sets.

Pure: the help text comes in as a string; running the engine to get it is the caller's job
(`EngineSpec.help_command` says what to run).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from llmgw.config import Secret
from llmgw.engines.helptext import HelpFlags, documented_flags
from llmgw.engines.launch import ReplicaLaunch, flags_in
from llmgw.engines.registry import spec_for
from llmgw.engines.spec import EngineSpec

OK, WARNINGS, MISSING = 0, 1, 2  # exit statuses of `llmgw ctl engine-check`


@attrs.frozen(kw_only=True)
class EngineCheck:
    engine: str
    flags_for: str  # the engine version llmgw's flags were written against
    checked: tuple[str, ...]  # every flag of the widest command
    missing: tuple[str, ...]  # of those, the ones the help does not document
    missing_env: tuple[str, ...]  # variables llmgw relies on that the help no longer mentions
    arg_problems: tuple[str, ...]  # the operator's args: unknown, or overriding llmgw's
    warnings: tuple[str, ...]
    documented: int  # how many flags the help documents

    @property
    def status(self) -> int:
        if self.missing or self.missing_env or self.arg_problems:
            return MISSING
        return WARNINGS if self.warnings else OK

    def to_dict(self) -> dict[str, object]:
        return {**attrs.asdict(self), "status": self.status}


def widest_launches(spec: EngineSpec) -> tuple[ReplicaLaunch, ...]:
    """Every process of the widest replica llmgw would start with `spec`: two nodes where the
    engine spans nodes (rank 0 and a worker differ), every optional field set."""
    nnodes = 1 if spec.max_nodes == 1 else 2
    base = ReplicaLaunch(
        engine=spec.name,
        model_path="/var/lib/llmgw-agent/weights/widest",
        served_name="widest",
        host="0.0.0.0",
        port=8001,
        api_key=Secret("engine-check"),
        gpus=(0, 1),
        context=8192,
        nnodes=nnodes,
        rank0_addr="192.0.2.1" if nnodes > 1 else "",  # TEST-NET-1: an example, never dialled
        dist_init_port=29500 if nnodes > 1 else 0,
        ib_adapters=("mlx5_0", "mlx5_1") if nnodes > 1 else (),
        socket_ifname="ib0" if nnodes > 1 else "",
        private_dir="/var/lib/llmgw-agent/keys/widest-r0",
        events_port=5557 if spec.cache_events else 0,
        parkable=spec.park is not None,
    )
    # Ranks >= 1 of an RPC engine run its rpc-server, not the engine: rank 0 alone has its flags.
    ranks = 1 if spec.rpc_helpers else nnodes
    rpc = ("127.0.0.1:50052",) if spec.rpc_helpers and nnodes > 1 else ()
    return tuple(
        attrs.evolve(base, node_rank=rank, rpc_servers=rpc if rank == 0 else (), model_layers=32 if rpc else 0)
        for rank in range(ranks)
    )


def widest_flags(spec: EngineSpec) -> tuple[str, ...]:
    flags: set[str] = set(spec.flags_in_files)
    for launch in widest_launches(spec):
        flags.update(flags_in(a for a in spec.args(launch) if isinstance(a, str)))
    return tuple(sorted(flags))


def check_args(engine: str, args: Sequence[str], help_text: str) -> list[str]:
    """Problems with an operator's `args` for `engine`: flags its help does not document, and
    flags (or their aliases) that llmgw sets itself. One line each, with the fix."""
    spec = spec_for(engine)
    return _arg_problems(spec, args, documented_flags(help_text, spec.help_style))


def _arg_problems(spec: EngineSpec, args: Sequence[str], help: HelpFlags) -> list[str]:
    problems = []
    for flag in dict.fromkeys(flags_in(args)):
        if flag not in help.flags:
            problems.append(f"{flag} is not in {spec.title}'s help; check its spelling against that version")
        elif help.aliases(flag) & spec.managed:
            problems.append(
                f"{flag} sets what llmgw sets itself for every replica "
                f"({', '.join(sorted(help.aliases(flag) & spec.managed))}); remove it from the model's args"
            )
    return problems


def check_engine(engine: str, help_text: str, *, extra_args: Sequence[str] = ()) -> EngineCheck:
    """Check the widest command for `engine`, and the operator's `extra_args`, against its help."""
    spec = spec_for(engine)
    help = documented_flags(help_text, spec.help_style)
    checked = widest_flags(spec)
    warnings = []
    if spec.partial_help_marker and spec.partial_help_marker in help_text:
        warnings.append(spec.partial_help_fix)
    if not help.flags:
        warnings.append(f"found no options in this text; is it the output of {_help_run(spec)}?")
    elif "--help" not in help.flags:
        warnings.append(
            "the help text does not document --help itself, which is the cheapest sign it was cut "
            f"short; give the whole output of {_help_run(spec)}"
        )
    return EngineCheck(
        engine=spec.name,
        flags_for=spec.flags_for,
        checked=checked,
        missing=tuple(f for f in checked if f not in help.flags),
        missing_env=tuple(v for v in spec.documented_env if v not in help_text),
        arg_problems=tuple(_arg_problems(spec, extra_args, help)),
        warnings=tuple(warnings),
        documented=len(help.flags),
    )


def _help_run(spec: EngineSpec) -> str:
    return "`" + " ".join(spec.help_command().argv) + "`"
