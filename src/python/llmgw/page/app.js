// The cluster page: asks the admin API who it is (the session cookie, set by the one-time login
// URL, is sent by the browser; the scripts never see it), then renders what the live feed
// (/admin/v1/events, server-sent events) sends. Actions are behind a confirm dialog and send the
// session's CSRF token, which lives in this module's memory only: nothing is kept in storage.

import {
  age,
  renderDrains,
  renderFabrics,
  renderGateway,
  renderKeys,
  renderModels,
  renderNodes,
  warnings,
  h,
} from "./render.js";

// The cluster as the feed sent it: nodes and placed replicas by id (a `changes` event replaces the
// ones it names), the rest whole. `now` is the control plane's clock when it was sent (the clock of
// the nodes' `heard_at`), `receivedAt` this page's then.
const state = {
  session: null,
  cluster: null,
  history: null,
  feed: null,
  version: 0,
  nodes: new Map(),
  replicas: new Map(),
  pending: [],
  whole: {},
  now: 0,
  receivedAt: 0,
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
  for (const id of ["warnings", "nodes", "fabrics", "models", "drains", "gateway", "keys"]) $(id).hidden = true;
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
  connect();
  setInterval(tickAges, 1000); // counts lost nodes' silence up between updates: no request
  setInterval(() => state.history && draw("gateway"), 10000); // the plots' time axis moves on
}

function connect() {
  const feed = new EventSource("/admin/v1/events");
  state.feed = feed;
  feed.addEventListener("open", () => status("Live"));
  feed.addEventListener("cluster", (e) => {
    const data = JSON.parse(e.data);
    state.nodes = new Map(data.nodes.map((n) => [n.id, n]));
    state.replicas = new Map(data.replicas.filter((r) => r.replica).map((r) => [r.replica, r]));
    state.pending = data.replicas.filter((r) => !r.replica);
    state.whole = { fabrics: data.fabrics, notes: data.notes, models: data.models, keys: data.keys };
    took(data);
  });
  feed.addEventListener("changes", (e) => {
    const data = JSON.parse(e.data);
    if (data.base !== state.version) {
      // A version missed (never on one stream): a new stream starts with the whole cluster.
      feed.close();
      connect();
      return;
    }
    for (const n of data.nodes) state.nodes.set(n.id, n);
    for (const id of data.gone_nodes) state.nodes.delete(id);
    for (const r of data.replicas) state.replicas.set(r.replica, r);
    for (const id of data.gone_replicas) state.replicas.delete(id);
    if (data.pending) state.pending = data.pending;
    for (const k of ["fabrics", "notes", "models", "keys"]) if (k in data) state.whole[k] = data[k];
    took(data);
  });
  feed.addEventListener("history", (e) => {
    state.history = JSON.parse(e.data);
    draw("gateway");
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

function took(data) {
  state.version = data.version;
  state.now = data.now;
  state.receivedAt = performance.now();
  const byId = (a, b) => (a < b ? -1 : a > b ? 1 : 0);
  state.cluster = {
    ...state.whole,
    nodes: [...state.nodes.keys()].sort(byId).map((id) => state.nodes.get(id)),
    replicas: [...[...state.replicas.keys()].sort(byId).map((id) => state.replicas.get(id)), ...state.pending],
  };
  status(`Live, updated ${new Date(data.at * 1000).toLocaleTimeString()}`);
  render();
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

const VIEWS = {
  nodes: () => renderNodes(state.cluster, ctx),
  fabrics: () => renderFabrics(state.cluster),
  models: () => renderModels(state.cluster, ctx),
  drains: () => renderDrains(state.cluster),
  gateway: () => renderGateway(state.history, state.cluster ? state.cluster.models : []),
  keys: () => renderKeys(state.cluster, ctx),
};

function draw(view) {
  if (!state.cluster && view !== "gateway") return;
  const body = $(`${view}-body`);
  // A redraw must not take the keyboard's place away: focus goes back to the same control.
  const focused = document.activeElement && body.contains(document.activeElement) ? document.activeElement.id : "";
  body.replaceChildren(...[VIEWS[view]()].flat());
  if (focused && $(focused)) $(focused).focus();
}

let scrolledToHash = false;

function render() {
  for (const view of Object.keys(VIEWS)) draw(view);
  const list = warnings(state.cluster, ctx);
  $("warnings").hidden = !list.length;
  $("warnings-list").replaceChildren(...list.map((w) => h("li", {}, w)));
  if (!scrolledToHash && location.hash.length > 1) {
    // A link to a node or replica (#node-ID, #replica-ID) exists only once the data is drawn.
    scrolledToHash = true;
    const target = document.getElementById(decodeURIComponent(location.hash.slice(1)));
    if (target) target.scrollIntoView();
  }
}

function tickAges() {
  for (const el of document.querySelectorAll(".age[data-heard]")) el.textContent = age(sinceHeard(Number(el.dataset.heard)));
}

const ACTIONS = {
  cordon: { title: "Cordon", text: (n) => `Cordon ${n}? No new replicas will be placed on it; running ones stay.`, call: (n) => ["POST", `/admin/v1/nodes/${encodeURIComponent(n)}/cordon`] },
  uncordon: { title: "Uncordon", text: (n) => `Uncordon ${n}? New replicas may be placed on it again.`, call: (n) => ["POST", `/admin/v1/nodes/${encodeURIComponent(n)}/uncordon`] },
  drain: { title: "Drain", text: (n) => `Drain ${n}? Its replicas move to other nodes one at a time, each replacement ready before its original stops; then it is cordoned.`, call: (n) => ["POST", `/admin/v1/nodes/${encodeURIComponent(n)}/drain`] },
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

start();
