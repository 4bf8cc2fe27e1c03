"""Engine specs: how llmgw starts each inference engine and checks that it still takes the flags
llmgw gives it. Pure code, shared by the control plane and the agent (no I/O, no llmgw.server).

What the agent's replica supervisor calls:

    cmd = build_command(launch, executable)   # ReplicaLaunch -> Command(argv, env)
    trio.open_process(cmd.argv, env={**os.environ, **cmd.env})
    log.info("replica_starting", **cmd.for_log())  # secrets hidden

What `llmgw ctl engine-check` calls: `spec_for(engine).help_command(...)` to know what to run,
then `check_engine(engine, help_text)`.
"""

from llmgw.engines.check import EngineCheck, check_args, check_engine, widest_flags, widest_launches
from llmgw.engines.errors import EngineHelpError, LaunchError
from llmgw.engines.launch import Command, ReplicaLaunch
from llmgw.engines.registry import SPECS, build_command, spec_for
from llmgw.engines.spec import EngineSpec

__all__ = [
    "SPECS",
    "Command",
    "EngineCheck",
    "EngineHelpError",
    "EngineSpec",
    "LaunchError",
    "ReplicaLaunch",
    "build_command",
    "check_args",
    "check_engine",
    "spec_for",
    "widest_flags",
    "widest_launches",
]
