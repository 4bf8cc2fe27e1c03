"""Whether a node's NVIDIA GPUs can run a GPU engine at all, by that engine's own rule.

vLLM and SGLang ship prebuilt CUDA kernels, so each has a floor: the oldest GPU architecture
(compute capability) its kernels are built for, and the oldest driver that runs the CUDA it is
built with. The floors are those of the versions llmgw pins (`llmgw.config`'s defaults); an
operator who pins another version and finds another floor says so in the issue tracker, not
in server.toml: a floor in config would outlive the version it was true for.

The agent judges with these rules for `llmgw doctor` and its hello; the control plane judges
again from the GPUs the inventory lists, so the rule of the control plane's release (which
names the versions) decides what a node is asked to install. Pure: no I/O.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence

import attrs

from llmgw.wire import agent_link as w


@attrs.frozen(kw_only=True)
class GpuRule:
    engine: str
    title: str
    min_compute: tuple[int, int]
    min_driver: str  # as nvidia-smi prints it
    cuda: str  # the CUDA its wheels are built with, for the driver message


# vLLM: compute capability 7.5 (Turing) or newer since its CUDA 12.9 wheels (7.0, Volta, was
# dropped); CUDA 12's minor-version compatibility runs them on driver 525.60.13 or newer.
VLLM = GpuRule(engine="vllm", title="vLLM", min_compute=(7, 5), min_driver="525.60.13", cuda="CUDA 12")
# SGLang: 7.5 or newer (its model runner refuses Volta), and its wheels need CUDA 13 (0.5.19
# was its last release with a CUDA 12 lane), whose oldest driver is 580.65.06 (CUDA 13.0's).
SGLANG = GpuRule(engine="sglang", title="SGLang", min_compute=(7, 5), min_driver="580.65.06", cuda="CUDA 13")
RULES = {r.engine: r for r in (VLLM, SGLANG)}


_NUMBER = re.compile(r"\d+")


# A cluster has a handful of driver versions and compute capabilities, and the control plane judges
# every node's GPUs each time it shows the node (the admin API, the cluster page's feed): parsed once.
@functools.lru_cache(maxsize=256)
def version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in _NUMBER.findall(text))


def _dotted(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


def judge(rule: GpuRule, gpu_status: str, gpus: Sequence[w.Gpu], gpu_detail: str = "") -> w.EngineEligibility:
    """The verdict for `rule`'s engine on a node whose nvidia-smi said `gpu_status` and `gpus`."""

    def say(status: str, reason: str) -> w.EngineEligibility:
        return w.EngineEligibility(engine=rule.engine, status=status, reason=reason)

    if not gpus:
        if gpu_status in (w.GPUS_NOT_FOUND, w.GPUS_FAILED):
            return say(w.UNKNOWN, f"the GPUs cannot be read ({gpu_status}: {gpu_detail or 'see nvidia-smi'})")
        return say(w.NOT_APPLICABLE, f"no NVIDIA GPU; {rule.title} runs on NVIDIA GPUs, llama.cpp serves this node")
    driver = gpus[0].driver_version
    if version_tuple(driver) < version_tuple(rule.min_driver):
        return say(
            w.INELIGIBLE,
            f"NVIDIA driver {driver} is older than {rule.min_driver}, the oldest {rule.title}'s "
            f"{rule.cuda} runs on; upgrade the driver",
        )
    need = _dotted(rule.min_compute)
    fits = [version_tuple(g.compute_capability)[:2] >= rule.min_compute for g in gpus]
    usable = [g for g, ok in zip(gpus, fits, strict=True) if ok]
    too_old = sorted({f"{g.name} ({g.compute_capability or '?'})" for g, ok in zip(gpus, fits, strict=True) if not ok})
    if not usable:
        return say(
            w.INELIGIBLE, f"{rule.title} needs compute capability {need} or newer; {', '.join(too_old)} is older"
        )
    reason = f"{len(usable)} GPU(s) with compute capability {need} or newer, driver {driver}"
    if too_old:
        reason += f"; not usable by {rule.title}: {', '.join(too_old)}"
    return say(w.ELIGIBLE, reason)


def judge_inventory(engine: str, inv: w.Inventory | None) -> w.EngineEligibility:
    """The control plane's verdict for `engine` on a node, from the GPUs its inventory lists."""
    rule = RULES[engine]
    if inv is None:
        return w.EngineEligibility(engine=engine, status=w.UNKNOWN, reason="the node has not reported its hardware")
    return judge(rule, inv.gpu_status, inv.gpus, inv.gpu_detail)
