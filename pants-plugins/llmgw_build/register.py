"""`llmgw_build_info`: llmgw/_build_info.py for the executable `./pants package` builds.

The release build writes `llmgw/_build_info.py` (commit, build date, target) into its artifacts
(release/llmgw_release/build.py); this target does the same for dist/llmgw.pex, so that every
llmgw build says in `llmgw version` what it was built from and when:

- commit: HEAD's, 12 hex digits, with "-dirty" when src/python or 3rdparty/python differ from
  it (as the release marks it);
- build date: the commit's time for a clean tree, so that a build is reproducible and Pants'
  cache holds; for a dirty one the time of the build, which is then the only honest answer;
- target: "pex".

Pants' own `vcs_version` gives setuptools_scm's version string only, which holds no time.
Like it, this asks git about the worktree (`MaybeGitWorktree` is uncacheable, so the rule runs
again in every Pants run); the file is generated, never written into the source tree.
"""

from __future__ import annotations

import time

from pants.backend.python.target_types import PythonSourceField
from pants.engine.fs import CreateDigest, FileContent
from pants.engine.internals.native_engine import Snapshot
from pants.engine.rules import Get, collect_rules, rule
from pants.engine.target import (
    COMMON_TARGET_FIELDS,
    GeneratedSources,
    GenerateSourcesRequest,
    OptionalSingleSourceField,
    StringField,
    Target,
)
from pants.engine.unions import UnionRule
from pants.vcs.git import GitWorktreeRequest, MaybeGitWorktree

# What the executable is built from: a change here, uncommitted, makes the commit "-dirty".
BUILT_FROM = ("src/python", "3rdparty/python")


class BuildInfoSourceField(OptionalSingleSourceField):
    """A stand-in source field: it lets the target take part in code generation."""

    alias = "_build_info_source"
    help = "Generated from git: commit and build date."


class BuildInfoGenerateToField(StringField):
    alias = "generate_to"
    required = True
    help = "The path of the generated module, e.g. src/python/llmgw/_build_info.py."


class LlmgwBuildInfo(Target):
    alias = "llmgw_build_info"
    core_fields = (*COMMON_TARGET_FIELDS, BuildInfoSourceField, BuildInfoGenerateToField)
    help = "llmgw/_build_info.py (commit, build date, target) from git, for `./pants package`."


class GenerateBuildInfoRequest(GenerateSourcesRequest):
    input = BuildInfoSourceField
    output = PythonSourceField


def build_info(commit: str, epoch: int, dirty: bool, now: float) -> str:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now if dirty else epoch))
    return (
        '"""Written by `./pants package` (pants-plugins/llmgw_build); not in the source tree."""\n\n'
        f"commit = {commit + ('-dirty' if dirty else '')!r}\n"
        f"build_date = {stamp!r}\n"
        "target = 'pex'\n"
    )


@rule
async def generate_build_info(request: GenerateBuildInfoRequest) -> GeneratedSources:
    maybe = await Get(MaybeGitWorktree, GitWorktreeRequest())
    worktree = maybe.git_worktree
    if worktree is None:
        raise ValueError(f"{request.protocol_target.address}: not in a git worktree, so no commit to name")
    # GitWorktree runs git for its own queries the same way; there is no public call for these.
    git = worktree._git_binary._invoke_unsandboxed
    where = ["-C", str(worktree.worktree)]
    commit = git([*where, "rev-parse", "--short=12", "HEAD"]).strip()
    epoch = int(git([*where, "log", "-1", "--format=%ct", "HEAD"]).strip())
    dirty = bool(git([*where, "status", "--porcelain", "--", *BUILT_FROM]).strip())
    path = request.protocol_target[BuildInfoGenerateToField].value
    text = build_info(commit, epoch, dirty, time.time())
    snapshot = await Get(Snapshot, CreateDigest([FileContent(path, text.encode())]))
    return GeneratedSources(snapshot)


def target_types():
    return [LlmgwBuildInfo]


def rules():
    return [*collect_rules(), UnionRule(GenerateSourcesRequest, GenerateBuildInfoRequest)]
