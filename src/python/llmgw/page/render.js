// What each view shows, built as DOM from the admin API's views (the same JSON `llmgw ctl`
// reads). Text goes in as text nodes only: nothing the cluster reports is parsed as HTML.

import { plot } from "./plots.js";

export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") el.className = v;
    else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

const CERT_WARN_DAYS = 30;

export function nodeState(n) {
  if (n.draining) return "draining";
  if (n.cordoned) return n.state === "joined" ? "cordoned" : `${n.state}, cordoned`;
  return n.state;
}

function badge(state) {
  const cls = state.split(/[ ,]/)[0];
  return h("span", { class: `badge s-${cls}` }, state);
}

// A table that becomes one card per row on a narrow screen (each cell labelled by its column).
export function table(caption, columns, rows) {
  return h(
    "div",
    { class: "scroll" },
    h(
      "table",
      { class: "cards" },
      h("caption", { class: "sr-only" }, caption),
      h("thead", {}, h("tr", {}, columns.map((c) => h("th", { scope: "col" }, c)))),
      h(
        "tbody",
        {},
        rows.map(([attrs, cells]) =>
          h("tr", attrs, cells.map((cell, i) => h("td", { "data-label": columns[i] }, cell))),
        ),
      ),
    ),
  );
}

export function age(seconds) {
  if (seconds === null || seconds === undefined) return "never";
  if (seconds < 60) return `${seconds.toFixed(1)} s ago`;
  if (seconds < 3600) return `${Math.floor(seconds / 60)} min ago`;
  return `${(seconds / 3600).toFixed(1)} h ago`;
}

// A joined node's heartbeats come on time (its age would change at every one: the feed does not
// send it); a node not joined says since when it is silent, counted up in the page.
export function heartbeat(n, ctx) {
  if (n.state === "joined") return h("span", { title: "a heartbeat within the node's time to be lost" }, "on time");
  if (n.heard_at === null || n.heard_at === undefined) return n.state === "joining" ? "none yet" : "never";
  return h("span", { class: "age", "data-heard": n.heard_at }, age(ctx.sinceHeard(n.heard_at)));
}

function bytes(n) {
  if (!n) return "";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) {
    n /= 1024;
    i += 1;
  }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function gpus(n) {
  return [...nvidiaGpus(n), ...vulkan(n)];
}

function nvidiaGpus(n) {
  if (!n.gpus.length) {
    return [["not_found", "failed"].includes(n.gpu_status) ? h("span", { class: "bad" }, n.gpu_detail || n.gpu_status) : "none"];
  }
  const byModel = new Map();
  for (const g of n.gpus) {
    const key = `${g.name}, ${(g.memory_total_mib / 1024).toFixed(0)} GiB`;
    byModel.set(key, (byModel.get(key) || 0) + 1);
  }
  return [...byModel].map(([k, count]) => h("div", {}, `${count} × ${k}`));
}

// The node's Vulkan devices, as its vulkaninfo lists them: a software one (lavapipe) muted, since it
// is no GPU; a vulkaninfo that fails, in red (agent.discovery.vulkan says why and the fix).
function vulkan(n) {
  const devices = (n.vulkan || []).map((d) =>
    h("div", { class: d.software ? "muted" : "", "data-vulkan": String(d.index), "data-software": String(d.software) }, `Vulkan: ${d.text}`),
  );
  if (n.vulkan_status === "failed") devices.push(h("div", { class: "bad", "data-vulkan": "failed" }, `Vulkan: ${n.vulkan_detail}`));
  return devices;
}

function engines(n) {
  const unusable = new Map(n.eligibility.filter((e) => e.status === "ineligible").map((e) => [e.engine, e]));
  const rows = n.engines.map((e) => {
    if (e.state === "installing") {
      const percent = e.percent === null || e.percent === undefined ? "" : ` ${e.percent}%`;
      const phase = e.phase ? ` (${e.phase})` : "";
      const using = e.ok ? `${e.name} ${e.version || ""}`.trim() + "; " : "";
      return h("div", { class: "muted" }, `${using}installing ${e.name}${percent}${phase}`);
    }
    const why = e.state === "unavailable" ? "unavailable here" : "unusable";
    return h(
      "div",
      { class: e.ok ? "" : "bad", "data-engine": e.name },
      `${e.name} ${e.version || ""}`.trim(),
      // llama.cpp's CPU backend: the instruction set it runs with on this node.
      e.cpu_backend ? h("span", { class: "muted", "data-cpu-backend": e.cpu_backend }, ` (CPU backend: ${e.cpu_backend})`) : "",
      e.ok ? "" : ` — ${why}: ${e.detail || "did not run"}`,
      e.cpu_note ? h("div", { class: "warn" }, `⚠ ${e.cpu_note}`) : "",
      ...speeds(n, e.name),
    );
  });
  for (const [engine, e] of unusable) {
    if (!n.engines.some((x) => x.name === engine)) {
      rows.push(h("div", { class: "bad" }, `${engine}: cannot run here${e.reason ? ` (${e.reason})` : ""}`));
    }
  }
  return rows.length ? rows : "none yet";
}

// Each backend's measured speed (the agent's bench, placement's weight): "cpu: 850 prompt tok/s,
// 42 gen tok/s", or why there is no figure. With measure_speed = false a node measures only when
// asked: until then, say so and how to ask.
function speeds(n, engine) {
  const mine = (n.speeds || []).filter((x) => x.engine === engine);
  const runs = (n.engines || []).some((e) => e.name === engine && e.ok);
  if (!mine.length && engine === "llamacpp" && n.measure_speed === false && runs) {
    return [h("div", { class: "muted", "data-speed": "none" }, "speed not measured (measure_speed = false; `llmgw ctl nodes bench` measures it)")];
  }
  return mine.map((x) => {
    const figures = x.gen_tps > 0 ? `${Math.round(x.prompt_tps)} prompt tok/s, ${Math.round(x.gen_tps)} gen tok/s` : "";
    const now = { measuring: "measuring now", waiting: `waiting: ${x.detail}`, failed: `measurement failed: ${x.detail}` }[x.state] || "";
    const text = [figures, now].filter(Boolean).join("; ") || "not measured";
    return h("div", { class: x.state === "failed" ? "bad" : "muted", "data-speed": x.backend }, `${x.backend}: ${text}`);
  });
}

function cert(n) {
  if (!n.cert_not_after) return "";
  const days = n.cert_expires_in_days;
  const soon = days !== null && days < CERT_WARN_DAYS;
  return h(
    "span",
    { class: soon ? "bad" : "" },
    `${n.cert_not_after.slice(0, 10)} (${days.toFixed(0)} days)`,
    soon ? " — renew soon" : "",
  );
}

function cpu(n) {
  if (!n.cpu) return "";
  // The warning before the architecture: in a row, only the first two lines show.
  return [
    h("div", {}, `${n.cpu.model}, ${n.cpu.cores} cores`),
    n.cpu_warning ? h("div", { class: "warn" }, `⚠ ${n.cpu_warning}`) : "",
    n.arch ? h("div", { class: "muted" }, `${n.arch}${n.memory_total_bytes ? `, ${bytes(n.memory_total_bytes)}` : ""}`) : "",
  ];
}

function fabricsOf(n) {
  const parts = n.fabrics.map((f) => h("div", {}, `${f.name}: ${f.adapters.join(", ")}`));
  for (const p of n.fabric_problems) parts.push(h("div", { class: "bad" }, `refused: ${p}`));
  return parts.length ? parts : h("span", { class: "muted" }, "none (an island)");
}

// Not `disabled` when unavailable: a disabled button drops the keyboard's focus, and a redraw
// while it is focused (a drain starting) would leave the operator nowhere. It says why instead.
function actionButton(id, label, described, onclick, unavailable = "") {
  return h(
    "button",
    { type: "button", id, "aria-label": described, "aria-disabled": unavailable ? "true" : null, title: unavailable || null, onclick: unavailable ? () => onclick.unavailable(unavailable) : onclick },
    label,
  );
}

export const NODE_COLUMNS = ["Node", "State", "Heartbeat", "Agent", "CPU", "GPUs", "Engines", "Fabrics", "Certificate"];

// The node's link: its details (llmgw/page/app.js opens them for #node-ID), and the row's name.
function nodeLink(n) {
  return h("a", { href: `#node-${n.id}`, id: `details-${n.id}`, class: "node-link", "aria-label": `Node ${n.id}: details` }, n.id);
}

function nodeCells(n, ctx) {
  const state = nodeState(n);
  const drain = n.drain && n.draining ? ` ${n.drain.moved}/${n.drain.total} moved` : "";
  return [
    [badge(state), drain],
    heartbeat(n, ctx),
    n.agent_version || "",
    cpu(n),
    gpus(n),
    engines(n),
    fabricsOf(n),
    cert(n),
  ];
}

// `prefix`: the details dialog's buttons are other elements than the row's, with ids of their own.
function nodeActions(n, ctx, prefix = "") {
  const act = (verb) => Object.assign(() => ctx.act(verb, n.id), { unavailable: ctx.unavailable });
  return h(
    "div",
    { class: "actions" },
    n.cordoned
      ? actionButton(`${prefix}uncordon-${n.id}`, "Uncordon", `Uncordon node ${n.id}`, act("uncordon"))
      : actionButton(`${prefix}cordon-${n.id}`, "Cordon", `Cordon node ${n.id}`, act("cordon")),
    actionButton(`${prefix}drain-${n.id}`, "Drain", `Drain node ${n.id}`, act("drain"), n.draining ? `${n.id} is draining now` : ""),
  );
}

// One row of the nodes' list (llmgw/page/nodelist.js): every row of one height, each cell cut
// to what fits (its whole text in its title; all of it in the node's details).
export function nodeRow(n, ctx, rowIndex) {
  const cells = [[nodeLink(n), h("div", { class: "muted" }, n.address || "")], ...nodeCells(n, ctx)];
  if (ctx.actions) cells.push(nodeActions(n, ctx));
  const columns = ctx.actions ? [...NODE_COLUMNS, "Actions"] : NODE_COLUMNS;
  return h(
    "tr",
    { id: `node-${n.id}`, class: "node", "data-node": n.id, "data-state": nodeState(n), "aria-rowindex": rowIndex },
    cells.map((cell, i) => {
      const inner = h("div", { class: "cell" }, cell);
      const td = h("td", { "data-label": columns[i] }, inner);
      if (columns[i] !== "Actions") td.title = inner.textContent;
      return td;
    }),
  );
}

// Everything the page knows of one node, for its details dialog.
export function nodeDetails(n, ctx) {
  const rows = [["Address", n.address || ""], ...NODE_COLUMNS.slice(1).map((c, i) => [c, nodeCells(n, ctx)[i]])];
  if (n.drain) {
    const d = n.drain;
    rows.push(["Last drain", `${d.moved} of ${d.total} replicas moved, ${d.error ? `stopped: ${d.error}` : d.done ? "done" : "running"}`]);
  }
  if (n.replicas.length) rows.push(["Replicas", n.replicas.map((r) => h("div", {}, `${r.replica} (rank ${r.rank}): ${r.state}`))]);
  const wc = n.weights;
  if (wc && (wc.files || wc.downloading)) {
    const limit = wc.limit_bytes ? ` of a ${(wc.limit_bytes / 2 ** 30).toFixed(0)} GiB limit` : "";
    const more = wc.downloading ? `, ${wc.downloading} downloading` : "";
    rows.push(["Weights cache", `${wc.files} file(s), ${(wc.bytes / 2 ** 30).toFixed(1)} GiB${limit}${more}; ${(wc.free_bytes / 2 ** 30).toFixed(1)} GiB free`]);
  }
  const parts = [h("dl", { class: "details" }, rows.flatMap(([k, v]) => [h("dt", {}, k), h("dd", {}, v)]))];
  if (ctx.actions) parts.push(nodeActions(n, ctx, "dlg-"));
  return parts;
}

// A long list of names, cut: the first `max`, then how many more and where to find them.
function some(names, max, where) {
  if (names.length <= max) return names.join(", ");
  return `${names.slice(0, max).join(", ")} and ${(names.length - max).toLocaleString("en-US")} more (${where})`;
}

const FABRIC_MEMBERS = 12;

export function renderFabrics(cluster) {
  const adapters = new Map(); // fabric key -> node -> adapters
  const islands = [];
  for (const n of cluster.nodes) {
    if (!n.fabrics.length) islands.push(n.id);
    for (const f of n.fabrics) {
      const key = `${f.name}@${f.identity}`;
      if (!adapters.has(key)) adapters.set(key, new Map());
      adapters.get(key).set(n.id, f.adapters);
    }
  }
  const parts = [];
  for (const note of cluster.notes) parts.push(h("p", { class: "warn", "data-note": "" }, `⚠ ${note}`));
  if (cluster.fabrics.length) {
    parts.push(
      table(
        "Fabrics as placement sees them",
        ["Fabric", "Identity", "Nodes and adapters"],
        cluster.fabrics.map((f) => {
          const members = adapters.get(`${f.name}@${f.identity}`) || new Map();
          const listed = f.nodes.slice(0, FABRIC_MEMBERS).map((id) => h("div", {}, `${id}: ${(members.get(id) || []).join(", ")}`));
          if (f.nodes.length > FABRIC_MEMBERS) {
            listed.push(h("div", { class: "muted" }, `and ${(f.nodes.length - FABRIC_MEMBERS).toLocaleString("en-US")} more: ${f.nodes.length.toLocaleString("en-US")} nodes in all (each node's row lists its fabrics)`));
          }
          return [{ "data-fabric": f.name, "data-identity": f.identity }, [h("strong", {}, f.name), h("code", {}, f.identity), listed]];
        }),
      ),
    );
  } else {
    parts.push(h("p", {}, "No node reports a fabric."));
  }
  if (islands.length) {
    parts.push(
      h(
        "p",
        { "data-islands": "" },
        h("strong", {}, "Islands"),
        ` (no fabric: single-node replicas only): ${some(islands, 20, "each node's row says it")}`,
      ),
    );
  }
  return parts;
}

const REPLICA_ROWS = 50; // per model; `llmgw ctl replicas` lists every one

export function renderModels(cluster, ctx) {
  const byModel = new Map(cluster.models.map((m) => [m.model, { placed: [], pending: new Map() }]));
  for (const r of cluster.replicas) {
    const of = byModel.get(r.model);
    if (!of) continue;
    if (r.replica) of.placed.push(r);
    else of.pending.set(r.detail, (of.pending.get(r.detail) || 0) + 1);
  }
  const parts = [];
  for (const m of cluster.models) {
    const { placed, pending } = byModel.get(m.model);
    const ok = m.ready >= m.replicas;
    parts.push(
      h(
        "h3",
        { id: `model-${m.model}` },
        m.model,
        " ",
        h("span", { class: `badge ${ok ? "s-joined" : "s-draining"}` }, `${m.ready} of ${m.replicas} ready`),
        h("span", { class: "muted" }, ` ${m.engine}, ${m.nodes_per_replica} node(s) per replica`),
      ),
    );
    if (m.from === "hub") {
      const mib = (n) => `${(n / 2 ** 20).toFixed(0)} MiB`;
      const e = m.estimate || {};
      parts.push(
        h(
          "p",
          { class: "source", "data-source": m.model },
          `From ${m.hf} at ${m.commit.slice(0, 12)} (${m.revision}): ${m.files.length} file(s), ${mib(m.bytes)}`,
          e.total_bytes ? `; a replica needs about ${mib(e.total_bytes)} (KV cache for ${e.context} tokens)` : "",
          ctx.actions ? " " : "",
          ctx.actions ? actionButton(`remove-${m.model}`, "Remove", `Remove the model ${m.model}`, () => ctx.act("remove", m.model)) : "",
        ),
      );
    }
    if (m.scale) {
      // Replicas that follow the load: the bounds, the count wanted and the last decision with its reason.
      const s = m.scale;
      const last = s.last ? `; ${s.last.reason}, ${new Date(s.last.at * 1000).toLocaleTimeString()}` : "";
      parts.push(
        h("p", { class: "muted", "data-scale": m.model }, `Replicas ${s.min}-${s.max} by load (idle after ${s.idle_s} s), wants ${s.wanted}${s.parked ? `, ${s.parked} parked` : ""}${s.lowering ? ", retiring one" : ""}${last}`),
      );
    }
    if (m.rollout) {
      // A changed model's replicas replaced one at a time: how far, or why it stopped.
      const r = m.rollout;
      const text =
        r.state === "stopped"
          ? `${r.reason}; ${r.replicas - r.updated} of ${r.replicas} replicas serve on with the version before`
          : `Updating: ${r.updated} of ${r.replicas} replicas on the new version${r.replacing ? ` (replacing ${r.replacing})` : ""}${r.waiting ? `; waiting for room for a replacement: ${r.waiting}` : ""}`;
      parts.push(h("p", { class: r.state === "stopped" ? "bad" : "muted", "data-rollout": m.model, "data-state": r.state }, text));
    }
    for (const line of m.progress || []) parts.push(h("p", { class: "muted", "data-progress": m.model }, line));
    // With many, those not ready first: they are the ones to look at.
    const notReady = placed.filter((r) => r.state !== "ready");
    const shown = placed.length > REPLICA_ROWS ? [...notReady, ...placed.filter((r) => r.state === "ready")].slice(0, REPLICA_ROWS) : placed;
    const rows = shown.map((r) => [
      { id: `replica-${r.replica}`, "data-replica": r.replica, "data-state": r.state },
      [
        h("code", {}, r.replica),
        r.nodes.join(", "),
        badge(r.state),
        String(r.restarts),
        r.port ? String(r.port) : "",
        r.detail || "",
        actionButton(`logs-${r.replica}`, "Log", `Show the engine log of replica ${r.replica}`, () => ctx.logs(r.replica)),
      ],
    ]);
    for (const [detail, count] of pending) {
      rows.push([{ class: "pending", "data-pending": m.model }, [h("em", {}, count > 1 ? `${count} pending` : "pending"), "", badge("pending"), "", "", detail, ""]]);
    }
    if (rows.length) {
      parts.push(table(`Replicas of ${m.model}`, ["Replica", "Nodes", "State", "Restarts", "Port", "Detail", "Log"], rows));
    }
    if (shown.length < placed.length) {
      const hidden = placed.length - shown.length;
      parts.push(h("p", { class: "muted" }, `${hidden.toLocaleString("en-US")} more replicas of ${m.model}, all ready, not listed here: \`llmgw ctl replicas\` lists every one.`));
    }
  }
  return parts.length ? parts : h("p", {}, "The catalog holds no model.");
}

export function renderDrains(cluster) {
  const drains = cluster.nodes.filter((n) => n.drain).map((n) => ({ ...n.drain, draining: n.draining }));
  if (!drains.length) return h("p", {}, "No drain has run since the control plane started.");
  return drains.map((d) => {
    const state = d.error ? `stopped: ${d.error}` : d.done ? "done" : d.current ? `moving ${d.current}` : "starting";
    return h(
      "div",
      { class: "drain", "data-drain": d.node },
      h("label", { for: `drain-progress-${d.node}` }, `${d.node}: ${d.moved} of ${d.total} replicas moved, ${state}`),
      h("progress", { id: `drain-progress-${d.node}`, max: Math.max(d.total, 1), value: d.done ? Math.max(d.total, 1) : d.moved }),
    );
  });
}

export function renderGateway(history, models) {
  if (!history) return h("p", {}, "Waiting for the first sample…");
  const now = Date.now() / 1000;
  const window = [now - history.window_s, now];
  const names = [...new Set([...models.map((m) => m.model), ...Object.keys(history.models)])];
  const ms = (v) => `${(v * 1000).toFixed(0)} ms`;
  return names.map((name) => {
    const points = history.models[name] || [];
    const times = points.map((p) => p.at);
    const col = (k) => points.map((p) => p[k]);
    const total = points.reduce((a, p) => a + p.requests, 0);
    return h(
      "div",
      { class: "model-plots", "data-model": name },
      h("h3", {}, name, h("span", { class: "muted" }, ` ${total} requests in the window`)),
      h(
        "div",
        { class: "plots" },
        figure("Requests per second", plot({ title: `${name} requests per second`, unit: "/s", series: [{ label: "rps", values: col("rps"), cls: "l1" }], times, window, format: (v) => v.toFixed(2) })),
        figure("Error rate (5xx)", plot({ title: `${name} error rate`, unit: "", series: [{ label: "errors", values: col("error_rate").map((v) => (v === null ? null : v * 100)), cls: "l3" }], times, window, format: (v) => `${v.toFixed(1)}%` })),
        figure("Latency p50 / p99", plot({ title: `${name} latency`, unit: "", series: [{ label: "p50", values: col("p50_s"), cls: "l1" }, { label: "p99", values: col("p99_s"), cls: "l2" }], times, window, format: ms })),
        figure("Time to first byte p50 / p99", plot({ title: `${name} time to first byte`, unit: "", series: [{ label: "p50", values: col("ttfb_p50_s"), cls: "l1" }, { label: "p99", values: col("ttfb_p99_s"), cls: "l2" }], times, window, format: ms })),
      ),
    );
  });
}

function figure(caption, svg) {
  return h("figure", {}, svg, h("figcaption", {}, caption, h("span", { class: "last" }, ` — now ${svg.dataset.last}`)));
}

export function renderKeys(cluster, ctx) {
  if (!cluster.keys.length) return h("p", {}, "No API key.");
  const columns = ["Key", "Models", "Limits", "Created", "State"];
  if (ctx.actions) columns.push("Actions");
  const rows = cluster.keys.map((k) => {
    const cells = [
      h("strong", {}, k.name),
      k.models.length ? k.models.join(", ") : "all",
      `${k.rate_per_minute || "∞"}/min, ${k.max_concurrency || "∞"} at once`,
      new Date(k.created_at * 1000).toISOString().slice(0, 16).replace("T", " "),
      k.revoked_at ? h("span", { class: "bad" }, "revoked") : "active",
    ];
    if (ctx.actions) {
      cells.push(
        k.revoked_at ? "" : actionButton(`revoke-${k.name}`, "Revoke", `Revoke API key ${k.name}`, () => ctx.act("revoke", k.name)),
      );
    }
    return [{ "data-key": k.name }, cells];
  });
  return table("API keys of the gateway (never their tokens)", columns, rows);
}

// Who used what: the usage ledger's totals of the last hours (the feed sends the largest rows;
// `llmgw ctl usage` has them all, and any time range).
export function renderUsage(cluster) {
  const u = cluster.usage;
  if (!u) return h("p", {}, "The usage ledger is not kept here.");
  if (!u.usage.length) return h("p", {}, `No usage in the last ${u.hours} hours.`);
  const columns = ["Key", "Team", "Model", "Requests", "Prompt tokens", "Cached", "Completion tokens", "Total"];
  const n = (x) => x.toLocaleString("en-US");
  const rows = u.usage.map((r) => [
    { "data-usage-key": r.key, "data-usage-model": r.model },
    [r.key, r.team || "-", r.model, n(r.requests), n(r.prompt_tokens), n(r.cached_tokens), n(r.completion_tokens), n(r.total_tokens)],
  ]);
  const t = u.total;
  rows.push([{ "data-usage-total": "" }, ["All", "", "", n(t.requests), n(t.prompt_tokens), n(t.cached_tokens), n(t.completion_tokens), n(t.total_tokens)]]);
  return [
    table(`Tokens per key, team and model since ${u.since.replace("T", " ").replace("Z", " UTC")}`, columns, rows),
    h("p", { class: "muted" }, u.rows > u.usage.length ? `The largest ${u.usage.length} of ${u.rows}; ` : "", h("code", {}, "llmgw ctl usage"), " reads any range, by key, team or model."),
  ];
}

// The audit log's newest entries (the feed sends AUDIT_SHOWN of them; `llmgw ctl audit` has the
// rest): who, when, from where, what, and what changed. Never a secret: the control plane keeps none there.
export function renderAudit(cluster) {
  const entries = cluster.audit || [];
  if (!entries.length) return h("p", {}, "No admin action recorded yet.");
  const columns = ["When (UTC)", "Who", "From", "Action", "On", "What changed"];
  const rows = entries.map((e) => [
    { "data-audit": e.id, "data-action": e.action },
    [
      new Date(e.at * 1000).toISOString().slice(0, 19).replace("T", " "),
      e.actor,
      e.source || "-",
      h("code", {}, e.action),
      e.target || "-",
      detailText(e.detail),
    ],
  ]);
  return [
    table("The newest admin actions", columns, rows),
    h("p", { class: "muted" }, "The newest ", String(entries.length), " entries; ", h("code", {}, "llmgw ctl audit"), " lists and filters them all."),
  ];
}

function detailText(detail) {
  const parts = Object.entries(detail || {}).map(([k, v]) => `${k}=${Array.isArray(v) ? v.join(",") : typeof v === "object" ? JSON.stringify(v) : v}`);
  const text = parts.join(" ") || "-";
  return text.length > 120 ? `${text.slice(0, 119)}…` : text;
}

const WARNINGS = 50;

// Each warning once: what many nodes share is one line naming a few of them.
export function warnings(cluster, ctx) {
  const out = [...cluster.notes];
  const byText = new Map(); // text -> nodes
  const add = (text, node) => {
    if (!byText.has(text)) byText.set(text, []);
    byText.get(text).push(node);
  };
  const lost = [];
  for (const n of cluster.nodes) {
    if (n.state === "lost") lost.push(n);
    if (n.cpu_warning) add(n.cpu_warning, n.id);
    for (const e of n.engines) if (e.cpu_note) add(e.cpu_note, n.id);
    if (n.cert_expires_in_days !== null && n.cert_expires_in_days < CERT_WARN_DAYS) {
      add(`its certificate expires in ${n.cert_expires_in_days.toFixed(0)} days; reissue it with \`llmgw node add\``, n.id);
    }
    for (const p of n.fabric_problems) add(`fabric refused: ${p}`, n.id);
  }
  if (lost.length === 1) {
    const n = lost[0];
    out.push(`node ${n.id} is lost: ${n.heard_at === null ? "never heard from" : `its last heartbeat ${age(ctx.sinceHeard(n.heard_at))}`}`);
  } else if (lost.length) {
    out.push(`${lost.length.toLocaleString("en-US")} nodes are lost: ${some(lost.map((n) => n.id), 5, "the nodes' State filter lists them")}`);
  }
  for (const [text, nodes] of byText) {
    out.push(nodes.length === 1 ? `node ${nodes[0]}: ${text}` : `${nodes.length.toLocaleString("en-US")} nodes: ${text} (${some(nodes, 5, "filter the nodes by name")})`);
  }
  for (const m of cluster.models) {
    for (const why of new Set(m.pending)) {
      const count = m.pending.filter((p) => p === why).length;
      out.push(`model ${m.model}: ${count > 1 ? `${count} replicas cannot` : "a replica cannot"} be placed: ${why}`);
    }
  }
  if (out.length > WARNINGS) {
    const more = out.length - WARNINGS;
    return [...out.slice(0, WARNINGS), `and ${more.toLocaleString("en-US")} more warnings`];
  }
  return out;
}
