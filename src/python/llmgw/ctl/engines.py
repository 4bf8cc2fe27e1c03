"""How a node's engines read to people, from the admin API's node view: what `llmgw ctl nodes`
prints under its table and what `llmgw node add`'s join step says while the node installs.
Pure: a node view (a dict, as the admin API sends it) in, text out."""

from __future__ import annotations

from typing import Any

TITLES = {"llamacpp": "llama.cpp", "vllm": "vLLM", "sglang": "SGLang"}


def title(name: str) -> str:
    return TITLES.get(name, name)


def installing_text(e: dict[str, Any]) -> str:
    """`installing llama.cpp 40% (build)`: what an engine's install is doing now."""
    percent = f" {e['percent']}%" if e.get("percent") is not None else ""
    phase = f" ({e['phase']})" if e.get("phase") else ""
    return f"installing {title(e['name'])}{percent}{phase}"


def mark(e: dict[str, Any]) -> str:
    """The engine's state in a table cell: "", "[haswell]" (llama.cpp's CPU backend), "(failed)",
    "(unavailable)", "(installing 40%)"."""
    if e.get("state") == "installing":
        return f"(installing {e['percent']}%)" if e.get("percent") is not None else "(installing)"
    if e.get("state") == "unavailable":
        return "(unavailable)"
    if not e["ok"]:
        return "(failed)"
    return f"[{e['cpu_backend']}]" if e.get("cpu_backend") else ""


def speed_text(s: dict[str, Any]) -> str:
    """`llama.cpp cpu: 850 prompt tok/s, 42 gen tok/s`, with the measurement under way, waiting or
    failed and why; the last figures stay until new ones come."""
    figures = f"{s['prompt_tps']:.0f} prompt tok/s, {s['gen_tps']:.0f} gen tok/s" if s.get("gen_tps") else ""
    now = {
        "measuring": "measuring now",
        "waiting": f"waiting: {s.get('detail', '')}",
        "failed": f"measurement failed: {s.get('detail', '')}",
    }.get(s.get("state", ""), "")
    device = f" ({s['device']})" if s.get("device") else ""
    return f"{title(s['engine'])} {s['backend']}{device}: " + (
        "; ".join(x for x in (figures, now) if x) or "not measured"
    )


NOT_MEASURED = (
    "llama.cpp: speed not measured (measure_speed = false in server.toml's [engines.llamacpp]; "
    "`llmgw ctl nodes bench` measures it)"
)


def speed_lines(n: dict[str, Any]) -> list[str]:
    """Each engine backend's measured speed on the node (agent.bench), one line each; where the
    cluster does not measure by itself (`measure_speed` false) and llama.cpp runs here but was
    never measured, a line saying so and how to measure."""
    speeds = n.get("speeds") or []
    lines = [speed_text(s) for s in speeds]
    runs = any(e["name"] == "llamacpp" and e["ok"] for e in n.get("engines") or [])
    if n.get("measure_speed") is False and runs and not any(s["engine"] == "llamacpp" for s in speeds):
        lines.append(NOT_MEASURED)
    return lines


def notes(n: dict[str, Any]) -> list[str]:
    """Installs under way, engines that failed or are unavailable and why, a CPU backend that costs
    speed (with the cause and the fix), each backend's measured speed, and the GPU engines this node was not asked to install,
    with why ("vllm: not applicable (no NVIDIA GPU; ...)")."""
    lines = []
    reported = set()
    for e in n.get("engines") or []:
        reported.add(e["name"])
        if e.get("state") == "installing":
            kept = f"; {title(e['name'])} {e['version']} stays in use until it is checked" if e["ok"] else ""
            lines.append(installing_text(e) + kept)
        elif e.get("state") == "unavailable":
            lines.append(f"{e['name']}: unavailable: {e['detail']}")
        elif not e["ok"]:
            lines.append(f"{e['name']} failed: {e['detail']}")
        if e.get("cpu_note"):
            lines.append(f"{e['name']}: {e['cpu_note']}")
    lines += speed_lines(n)
    for v in n.get("eligibility") or []:
        if v["status"] != "eligible" and v["engine"] not in reported:
            lines.append(f"{v['engine']}: {v['status'].replace('_', ' ')} ({v['reason']})")
    return lines
