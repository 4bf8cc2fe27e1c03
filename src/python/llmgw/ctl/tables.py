"""How the admin API's answers read in a terminal: `llmgw ctl`'s tables and the node's state
in words. Pure: the views as the admin API sends them (dicts) in, text out."""

from __future__ import annotations

import time
from typing import Any

from llmgw.ctl import engines as engine_texts


def table(rows: list[tuple]) -> str:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def scale_text(model: dict[str, Any]) -> str:
    """A scaled model's bounds, the count it wants and its last decision, as `ctl models` and `ctl
    replicas` say them: "replicas 0-2 (idle after 300 s), wants 1; scaled up: 14 queued, 0 in flight
    for 5 s, 12:03:04"; "" for a model with a fixed count."""
    scale = model.get("scale")
    if not scale:
        return ""
    text = f"replicas {scale['min']}-{scale['max']} (idle after {scale['idle_s']:g} s), wants {scale['wanted']}"
    if scale.get("parked"):
        text += f", {scale['parked']} parked"
    if scale.get("lowering"):
        text += ", retiring one"
    last = scale.get("last")
    if last:
        text += f"; {last['reason']}, {time.strftime('%H:%M:%S', time.localtime(last['at']))}"
    return text


def rollout_text(model: dict[str, Any]) -> str:
    """A model's rollout as `ctl models` and `ctl replicas` say it: "updating: 2 of 4 replicas on
    the new version (replacing coder-1)", or stopped with its reason and what to do; "" for none."""
    r = model.get("rollout")
    if not r:
        return ""
    if r["state"] == "stopped":
        old = r["replicas"] - r["updated"]
        return (
            f"{r['reason']}; {old} of {r['replicas']} replicas serve on with the version before. Fix the model "
            f"(server.toml and `llmgw ctl reload`, or `llmgw ctl models update {model['model']}`), or try it "
            f"again: `llmgw ctl models update {model['model']} --retry`"
        )
    text = f"updating: {r['updated']} of {r['replicas']} replicas on the new version"
    if r.get("replacing"):
        text += f" (replacing {r['replacing']})"
    if r.get("waiting"):
        text += f"; waiting for room for a replacement: {r['waiting']}"
    return text


def model_notes(model: dict[str, Any]) -> list[str]:
    """The lines `ctl models` and `ctl replicas` print under their table for a model: how its
    replicas follow the load, and its rollout."""
    return [text for text in (scale_text(model), rollout_text(model)) if text]


def state_text(node: dict[str, Any]) -> str:
    marks = [m for m in ("cordoned", "draining") if node.get(m)]
    drain = node.get("drain")
    if drain and node.get("draining"):
        marks[-1] = f"draining {drain['moved']}/{drain['total']}"
    return node["state"] + (f" ({', '.join(marks)})" if marks else "")


def _gpus(n: dict[str, Any]) -> str:
    gpus = n.get("gpus") or []
    if gpus:
        return f"{len(gpus)} x {gpus[0]['name']}"
    # A node whose nvidia-smi is missing or failing must not look like a CPU node.
    return {"not_found": "nvidia-smi missing!", "failed": "nvidia-smi failed!"}.get(n.get("gpu_status") or "", "none")


def vulkan_text(n: dict[str, Any]) -> str:
    """The line `ctl nodes` prints under its table for a node's Vulkan GPUs ("vulkan: AMD Radeon RX
    7900 XTX (RADV NAVI31) (discrete, radv, Vulkan 1.3, 24.0 GiB)"), or why vulkaninfo failed; ""
    for a node with none (a software device alone is no GPU, and would be a line on every node)."""
    found = [d["text"] for d in n.get("vulkan") or [] if not d.get("software")]
    if found:
        return "vulkan: " + "; ".join(found)
    if n.get("vulkan_status") == "failed":
        return f"vulkan: {n.get('vulkan_detail')}"
    return ""


def _vllm(n: dict[str, Any]) -> str:
    e = next((e for e in n.get("eligibility") or [] if e["engine"] == "vllm"), None)
    if e is None:
        return "-"
    return {"not_applicable": "not applicable", "eligible": "eligible"}.get(e["status"], e["status"].replace("_", " "))


def _fabrics(n: dict[str, Any]) -> str:
    shown = [f"{f['name']}@{f['identity']}" for f in n.get("fabrics") or []]
    if n.get("fabric_problems"):
        shown.append("refused")
    return ",".join(shown) or "-"


SHOWN_REPLICAS = 3  # named in the REPLICAS cell; more are counted


def _replicas(n: dict[str, Any]) -> str:
    """The replicas the node holds (members it reports, whatever their state): "0", or the count
    and their ids, "2: chat-1,chat-2" (a drain is done when it reads 0)."""
    ids = sorted({r["replica"] for r in n.get("replicas") or []})
    if not ids:
        return "0"
    more = f",+{len(ids) - SHOWN_REPLICAS}" if len(ids) > SHOWN_REPLICAS else ""
    return f"{len(ids)}: {','.join(ids[:SHOWN_REPLICAS])}{more}"


def format_nodes(nodes: list[dict[str, Any]]) -> str:
    if not nodes:
        return "no nodes yet: add one with `sudo llmgw node add USER@HOST` (docs/node-onboarding.md)"
    header = (
        "NODE",
        "STATE",
        "REPLICAS",
        "ADDRESS",
        "AGENT",
        "HEARTBEAT",
        "CPU",
        "GPUS",
        "ENGINES",
        "VLLM",
        "FABRICS",
        "CERT EXPIRES",
        "WEIGHTS",
    )
    rows = [header]
    for n in nodes:
        age = n.get("last_heartbeat_age_s")
        cpu = n.get("cpu") or {}
        rows.append(
            (
                n["id"],
                state_text(n),
                _replicas(n),
                n.get("address") or "-",
                n.get("agent_version") or "-",
                f"{age:.0f}s ago" if age is not None else "never",
                f"{cpu.get('cores', '?')} x {cpu.get('model', '?')}" if cpu else "-",
                _gpus(n),
                ",".join(e["name"] + engine_texts.mark(e) for e in n.get("engines") or []) or "-",
                _vllm(n),
                _fabrics(n),
                f"{n['cert_not_after']} ({n['cert_expires_in_days']:.0f}d)" if n.get("cert_not_after") else "-",
                _weights(n.get("weights")),
            )
        )
    return table(rows)


def _weights(held: dict[str, Any] | None) -> str:
    """A node's weights cache: "3 files, 4.1 GiB (limit 50 GiB), 1 downloading"."""
    if not held or not (held["files"] or held["downloading"]):
        return "-"
    text = f"{held['files']} files, {held['bytes'] / 2**30:.1f} GiB"
    if held["limit_bytes"]:
        text += f" (limit {held['limit_bytes'] / 2**30:g} GiB)"
    if held["downloading"]:
        text += f", {held['downloading']} downloading"
    return text
