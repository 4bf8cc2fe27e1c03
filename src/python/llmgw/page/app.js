// The cluster page: asks the admin API who it is (the session cookie, set by the one-time login
// URL, is sent by the browser; the scripts never see it), then renders what the live feed
// (/admin/v1/events, server-sent events) sends: the whole cluster once, then what changed, by id.
// Each event is merged as it arrives; the views it touched are drawn again at the next animation
// frame, once however many events came (and not at all while the tab is hidden). Actions are
// behind a confirm dialog and send the session's CSRF token, which lives in this module's memory
// only: nothing is kept in storage.

import {
  age,
  nodeDetails,
  renderAudit,
  renderUsage,
  renderDrains,
  renderFabrics,
  renderGateway,
  renderKeys,
  renderModels,
  warnings,
  h,
  table,
} from "./render.js";
import { NodeList } from "./nodelist.js";

const state = {
  session: null,
  cluster: null,
  history: null,
  feed: null,
  version: 0,
  nodes: new Map(),
  replicas: new Map(),
  pending: [],
  nodeOrder: [], // ids, sorted: sorted again only when one comes or goes
  replicaOrder: [],
  whole: {},
  now: 0,
  receivedAt: 0,
  dirty: new Set(), // views to draw at the next frame
  frame: 0,
  detailsOf: "", // the node whose details are open
  firstDrawn: false,
};
const $ = (id) => document.getElementById(id);

function say(text, isError = false) {
  const m = $("message");
  m.textContent = text;
  m.hidden = !text;
  m.classList.toggle("error", isError);
}

function status(text) {
  $("status").textContent = text;
}

async function errorOf(response) {
  try {
    const body = await response.json();
    return body.error ? body.error.message : `HTTP ${response.status}`;
  } catch {
    return `HTTP ${response.status}`;
  }
}

function signedOut(why) {
  $("signin").hidden = false;
  $("signin-why").textContent = why;
  status("Not signed in");
  for (const id of ["warnings", "nodes", "fabrics", "models", "drains", "gateway", "keys", "usage", "audit"]) $(id).hidden = true;
  if (state.feed) state.feed.close();
}

async function start() {
  let response;
  try {
    response = await fetch("/admin/v1/page/session", { credentials: "same-origin", cache: "no-store" });
  } catch (e) {
    status(`The control plane does not answer (${e.message}); reload to try again.`);
    return;
  }
  if (!response.ok) {
    signedOut(await errorOf(response));
    return;
  }
  state.session = await response.json();
  const s = state.session;
  $("session").textContent = `Session ${s.id}, ${s.actions ? "may act" : "read-only"}`;
  if (!s.actions) {
    $("session").title = "Run `llmgw ctl page --actions` for a session that may cordon, drain and revoke.";
  }
  if (s.actions) setUpAddModel();
  connect();
  setInterval(tickAges, 1000); // counts lost nodes' silence up between updates: no request
  setInterval(() => state.history && draw("gateway"), 10000); // the plots' time axis moves on
  $("node-details").addEventListener("close", detailsClosed);
  // A node's link opens its details (the address bar says which, for a link to share).
  $("nodes-body").addEventListener("click", (e) => {
    const link = e.target.closest("a.node-link");
    if (!link) return;
    e.preventDefault();
    history.replaceState(null, "", link.getAttribute("href"));
    showDetails(link.id.slice("details-".length), true);
  });
  window.addEventListener("hashchange", () => state.firstDrawn && followHash());
}

function connect() {
  const feed = new EventSource("/admin/v1/events");
  state.feed = feed;
  feed.addEventListener("open", () => status("Live"));
  feed.addEventListener("cluster", (e) => {
    const data = JSON.parse(e.data);
    state.nodes = new Map(data.nodes.map((n) => [n.id, n]));
    state.nodeOrder = data.nodes.map((n) => n.id); // sorted by the control plane
    state.replicas = new Map();
    state.replicaOrder = [];
    state.pending = [];
    for (const r of data.replicas) {
      if (r.replica) {
        state.replicas.set(r.replica, r);
        state.replicaOrder.push(r.replica);
      } else {
        state.pending.push(r);
      }
    }
    state.whole = { fabrics: data.fabrics, notes: data.notes, models: data.models, keys: data.keys, audit: data.audit || [], usage: data.usage || null };
    took(data, Object.keys(VIEWS));
  });
  feed.addEventListener("changes", (e) => {
    const data = JSON.parse(e.data);
    if (data.base !== state.version) {
      // A version missed (never on one stream): a new stream starts with the whole cluster.
      feed.close();
      connect();
      return;
    }
    const touched = [];
    if (data.nodes.length || data.gone_nodes.length) {
      state.nodeOrder = merged(state.nodes, data.nodes.map((n) => [n.id, n]), data.gone_nodes) || state.nodeOrder;
      touched.push("nodes", "fabrics", "drains", "warnings");
    }
    if (data.replicas.length || data.gone_replicas.length || data.pending) {
      state.replicaOrder = merged(state.replicas, data.replicas.map((r) => [r.replica, r]), data.gone_replicas) || state.replicaOrder;
      if (data.pending) state.pending = data.pending;
      touched.push("models");
    }
    if (data.fabrics || data.notes) touched.push("fabrics", "warnings");
    if (data.models) touched.push("models", "gateway", "warnings");
    if (data.keys) touched.push("keys");
    if (data.audit) touched.push("audit");
    if ("usage" in data) touched.push("usage");
    for (const k of ["fabrics", "notes", "models", "keys", "audit", "usage"]) if (k in data) state.whole[k] = data[k];
    took(data, touched);
  });
  feed.addEventListener("history", (e) => {
    state.history = JSON.parse(e.data);
    state.dirty.add("gateway");
    if (!state.frame) state.frame = requestAnimationFrame(flush);
  });
  feed.addEventListener("expired", (e) => {
    feed.close();
    signedOut(JSON.parse(e.data).detail);
  });
  feed.addEventListener("error", async () => {
    if (feed.readyState === EventSource.CLOSED) {
      // The stream was refused (its session ended?): ask, and say why.
      const r = await fetch("/admin/v1/page/session", { credentials: "same-origin", cache: "no-store" }).catch(() => null);
      if (r && !r.ok) signedOut(await errorOf(r));
      else status("Disconnected; reload the page.");
    } else {
      status("Reconnecting…"); // EventSource retries by itself
    }
  });
}

// Puts `items` ([id, view]) in `map` and takes `gone` out; the ids sorted again if one came or
// went, else null (the order stands).
function merged(map, items, gone) {
  let moved = gone.length > 0;
  for (const [id, v] of items) {
    if (!map.has(id)) moved = true;
    map.set(id, v);
  }
  for (const id of gone) map.delete(id);
  return moved ? [...map.keys()].sort((a, b) => (a < b ? -1 : a > b ? 1 : 0)) : null;
}

function took(data, views) {
  state.version = data.version;
  state.now = data.now;
  state.receivedAt = performance.now();
  status(`Live, updated ${new Date(data.at * 1000).toLocaleTimeString()}`);
  for (const v of views) state.dirty.add(v);
  if (!state.frame) state.frame = requestAnimationFrame(flush);
}

// Seconds since a node's last heartbeat (its `heard_at`), on the control plane's clock.
function sinceHeard(heardAt) {
  return state.now - heardAt + (performance.now() - state.receivedAt) / 1000;
}

const ctx = {
  get actions() {
    return Boolean(state.session && state.session.actions);
  },
  act: (verb, target) => confirmAndCall(verb, target),
  logs: (replica) => showLogs(replica),
  unavailable: (why) => say(why),
  sinceHeard: (heardAt) => sinceHeard(heardAt),
};

let nodeList = null;

const VIEWS = {
  nodes: () => nodeList.update(state.cluster.nodes),
  fabrics: () => renderFabrics(state.cluster),
  models: () => renderModels(state.cluster, ctx),
  drains: () => renderDrains(state.cluster),
  gateway: () => renderGateway(state.history, state.cluster ? state.cluster.models : []),
  keys: () => renderKeys(state.cluster, ctx),
  audit: () => renderAudit(state.cluster),
  usage: () => renderUsage(state.cluster),
  warnings: () => {
    const list = warnings(state.cluster, ctx);
    $("warnings").hidden = !list.length;
    $("warnings-list").replaceChildren(...list.map((w) => h("li", {}, w)));
  },
};
const OWN_DRAWING = new Set(["nodes", "warnings"]); // not a body replaced whole

function draw(view) {
  if (!state.cluster && view !== "gateway") return;
  if (OWN_DRAWING.has(view)) {
    VIEWS[view]();
    return;
  }
  const body = $(`${view}-body`);
  // A redraw must not take the keyboard's place away: focus goes back to the same control.
  const focused = document.activeElement && body.contains(document.activeElement) ? document.activeElement.id : "";
  body.replaceChildren(...[VIEWS[view]()].flat());
  if (focused && $(focused)) $(focused).focus();
}

// The views the events since the last frame touched, drawn once.
function flush() {
  state.frame = 0;
  const dirty = state.dirty;
  state.dirty = new Set();
  if (state.version) {
    state.cluster = {
      ...state.whole,
      nodes: state.nodeOrder.map((id) => state.nodes.get(id)),
      replicas: [...state.replicaOrder.map((id) => state.replicas.get(id)), ...state.pending],
    };
    if (!nodeList) nodeList = new NodeList($("nodes-body"), ctx);
  }
  for (const view of Object.keys(VIEWS)) if (dirty.has(view)) draw(view);
  if (!state.cluster) return;
  if (dirty.has("nodes") && state.detailsOf) showDetails(state.detailsOf, false);
  if (!state.firstDrawn) {
    state.firstDrawn = true;
    performance.mark("llmgw-first-render"); // what the browser test reports as the time to first render
    followHash(); // a link to a node or replica (#node-ID, #replica-ID) is drawn only now
  }
}

// #node-ID: that node's row in view and its details open; #replica-ID: that replica's row.
function followHash() {
  const target = decodeURIComponent(location.hash.slice(1));
  if (target.startsWith("node-") && state.nodes.has(target.slice(5))) {
    showDetails(target.slice(5), true);
  } else if (target && $(target)) {
    $(target).scrollIntoView();
  }
}

function showDetails(id, open) {
  const dialog = $("node-details");
  const n = state.nodes.get(id);
  if (!n) {
    if (dialog.open) $("node-details-body").replaceChildren(h("p", { class: "bad" }, `Node ${id} is no longer known to the control plane.`));
    return;
  }
  if (open) nodeList.reveal(id);
  state.detailsOf = id;
  $("node-details-h").textContent = `Node ${id}`;
  const body = $("node-details-body");
  const focused = document.activeElement && body.contains(document.activeElement) ? document.activeElement.id : "";
  body.replaceChildren(...nodeDetails(n, ctx));
  if (focused && $(focused)) $(focused).focus();
  if (open && !dialog.open) dialog.showModal();
}

function detailsClosed() {
  const id = state.detailsOf;
  state.detailsOf = "";
  // Back to the node's link if its row is still drawn, else to the list.
  const link = $(`details-${id}`);
  if (link) link.focus();
  else if ($("node-list")) $("node-list").focus();
}

function tickAges() {
  for (const el of document.querySelectorAll(".age[data-heard]")) el.textContent = age(sinceHeard(Number(el.dataset.heard)));
}

const ACTIONS = {
  cordon: { title: "Cordon", text: (n) => `Cordon ${n}? No new replicas will be placed on it; running ones stay.`, call: (n) => ["POST", `/admin/v1/nodes/${encodeURIComponent(n)}/cordon`] },
  uncordon: { title: "Uncordon", text: (n) => `Uncordon ${n}? New replicas may be placed on it again.`, call: (n) => ["POST", `/admin/v1/nodes/${encodeURIComponent(n)}/uncordon`] },
  drain: { title: "Drain", text: (n) => `Drain ${n}? Its replicas move to other nodes one at a time, each replacement ready before its original stops; then it is cordoned.`, call: (n) => ["POST", `/admin/v1/nodes/${encodeURIComponent(n)}/drain`] },
  remove: { title: "Remove", text: (m) => `Remove the model ${m}? Its replicas stop, and the nodes delete its files.`, call: (m) => ["DELETE", `/admin/v1/models/${encodeURIComponent(m)}`] },
  revoke: { title: "Revoke", text: (k) => `Revoke the API key ${k}? Its next request is refused. This cannot be undone.`, call: (k) => ["DELETE", `/admin/v1/keys/${encodeURIComponent(k)}`] },
};

function confirmAndCall(verb, target) {
  const action = ACTIONS[verb];
  const dialog = $("confirm");
  // By id: a redraw while the dialog is open replaces the button that opened it.
  const opener = document.activeElement ? document.activeElement.id : "";
  $("confirm-h").textContent = `${action.title} ${target}`;
  $("confirm-text").textContent = action.text(target);
  $("confirm-ok").textContent = `${action.title} ${target}`;
  dialog.returnValue = "";
  dialog.addEventListener(
    "close",
    async () => {
      if (opener && $(opener)) $(opener).focus();
      if (dialog.returnValue !== "ok") return;
      const [method, path] = action.call(target);
      say(`${action.title} ${target}…`);
      const response = await fetch(path, {
        method,
        credentials: "same-origin",
        headers: { "x-llmgw-csrf": state.session.csrf },
      });
      say(response.ok ? `${action.title} ${target}: done.` : `${action.title} ${target} failed: ${await errorOf(response)}`, !response.ok);
    },
    { once: true },
  );
  dialog.showModal(); // focus starts on Cancel: the safe choice is the default one
}

async function showLogs(replica) {
  const dialog = $("logs");
  $("logs-h").textContent = `Engine log of ${replica}`;
  $("logs-body").replaceChildren(h("p", {}, "Loading…"));
  dialog.showModal();
  const response = await fetch(`/admin/v1/replicas/${encodeURIComponent(replica)}/logs?lines=50`, { credentials: "same-origin" });
  if (!response.ok) {
    $("logs-body").replaceChildren(h("p", { class: "bad" }, await errorOf(response)));
    return;
  }
  const body = await response.json();
  $("logs-body").replaceChildren(
    ...body.members.map((m) =>
      h("section", {}, h("h3", {}, `${m.node}, rank ${m.rank}`), m.error ? h("p", { class: "bad" }, m.error) : h("pre", { tabindex: "0" }, m.text || "(empty)")),
    ),
  );
}

// A model from the Hub (a session that may act): search, then add by name, repository and quantisation.
function setUpAddModel() {
  $("add-model").hidden = false;
  $("add-model-nav").hidden = false;
  $("hub-search-form").addEventListener("submit", async (e) => {
    e.preventDefault();
    const text = $("hub-search-text").value.trim();
    const out = $("hub-search-results");
    out.replaceChildren(h("p", {}, `Searching the Hub for ${text}…`));
    const response = await fetch(`/admin/v1/models/search?q=${encodeURIComponent(text)}&limit=10`, { credentials: "same-origin" });
    if (!response.ok) {
      out.replaceChildren(h("p", { class: "bad" }, await errorOf(response)));
      return;
    }
    out.replaceChildren(searchResults((await response.json()).results));
  });
  $("add-model-form").addEventListener("submit", async (e) => {
    e.preventDefault();
    const body = {
      name: $("add-name").value.trim(),
      hf: $("add-repo").value.trim(),
      quant: $("add-quant").value.trim(),
      replicas: Number($("add-replicas").value || 1),
    };
    if ($("add-token").value) body.token = $("add-token").value;
    say(`Adding ${body.name} from ${body.hf}: resolving it on the Hub…`);
    const response = await fetch("/admin/v1/models", {
      method: "POST",
      credentials: "same-origin",
      headers: { "x-llmgw-csrf": state.session.csrf, "content-type": "application/json" },
      body: JSON.stringify(body),
    });
    if (!response.ok) {
      say(`Adding ${body.name} failed: ${await errorOf(response)}`, true);
      return;
    }
    const m = (await response.json()).model;
    $("add-token").value = "";
    say(`Added ${m.model}: ${m.hf} at ${m.commit.slice(0, 12)}, ${m.files.length} file(s); its replicas start as the nodes download it.`);
  });
}

function searchResults(results) {
  if (!results.length) return h("p", {}, "No repository matches.");
  const rows = [];
  for (const r of results) {
    if (r.error) rows.push([{}, [r.repo, "", "", "", r.error]]);
    for (const [i, c] of (r.choices || []).entries()) {
      const use = h("button", { type: "button", id: `use-${r.repo}-${i}`, "aria-label": `Use ${r.repo} ${c.quant || c.file}` }, "Use");
      use.addEventListener("click", () => {
        $("add-repo").value = r.repo;
        $("add-quant").value = c.engine === "llamacpp" ? c.quant : "";
        if (!$("add-name").value) $("add-name").value = r.repo.split("/")[1].toLowerCase().replace(/[^a-z0-9._-]/g, "-").slice(0, 63);
        $("add-name").focus();
      });
      const fits = c.fits_on === undefined ? "" : c.fits_on.length ? c.fits_on.slice(0, 4).join(", ") : "no node";
      rows.push([{ "data-repo": r.repo }, [r.repo, c.file + (c.parts > 1 ? ` (+${c.parts - 1})` : ""), c.quant || "", gib(c.bytes), fits, use]]);
    }
  }
  return table("Repositories found on the Hub", ["Repository", "File", "Quantisation", "Size", "Fits on", "Use"], rows);
}

function gib(n) {
  return n >= 2 ** 28 ? `${(n / 2 ** 30).toFixed(2)} GiB` : `${(n / 2 ** 20).toFixed(1)} MiB`;
}

start();
