// The nodes view: filters by state and by name, the counts per state, and a virtualised list.
//
// Thousands of nodes are never all in the document: the list scrolls in a box of its own, and
// only the rows in its viewport (and OVERSCAN rows either side) exist, between two spacer rows
// that stand for the rest. Every row has the same height (the style sheet's --row-h, measured
// once a row is drawn), so where a row goes is arithmetic. A row is made again only when its
// node's view changed (the feed replaces a node's object only then); the rows that stay are
// left where they are, so the keyboard's focus in them stays too.

import { h, nodeRow, NODE_COLUMNS } from "./render.js";

const OVERSCAN = 8;
const LIVENESS = ["joined", "joining", "lost", "unknown"];
const INTENT = ["cordoned", "draining"];

function matchesState(n, wanted) {
  if (!wanted) return true;
  if (wanted === "cordoned") return n.cordoned;
  if (wanted === "draining") return n.draining;
  return n.state === wanted;
}

const fmt = (k) => k.toLocaleString("en-US");

export class NodeList {
  constructor(root, ctx) {
    this.ctx = ctx;
    this.nodes = [];
    this.shown = [];
    this.rows = new Map(); // node id -> {node, tr}: the rows in the document
    this.rowH = 0; // measured; 0 until a row is drawn
    this.actions = null; // whether the rows were made with the action buttons
    this.nameInput = h("input", { id: "node-filter", type: "search", autocomplete: "off", spellcheck: "false", placeholder: "part of a name" });
    this.stateSelect = h("select", { id: "state-filter" });
    this.options = new Map();
    const all = h("option", { value: "" }, "all");
    this.options.set("", all);
    this.stateSelect.append(all);
    for (const [label, states] of [["liveness", LIVENESS], ["operator's intent", INTENT]]) {
      const group = h("optgroup", { label });
      for (const s of states) {
        const o = h("option", { value: s }, s);
        this.options.set(s, o);
        group.append(o);
      }
      this.stateSelect.append(group);
    }
    this.counts = h("p", { id: "node-counts", class: "counts", role: "status" });
    this.empty = h("p", { id: "nodes-empty", hidden: true });
    this.head = h("tr", {});
    this.top = h("tr", { class: "spacer", "aria-hidden": "true" });
    this.bottom = h("tr", { class: "spacer", "aria-hidden": "true" });
    this.tbody = h("tbody", {}, this.top, this.bottom);
    this.table = h(
      "table",
      { class: "cards nodes" },
      h("caption", { class: "sr-only" }, "Nodes: state, heartbeat, hardware, engines, fabrics, certificate (only the rows in view are in the page; filter by name or state to find one)"),
      h("thead", {}, this.head),
      this.tbody,
    );
    this.scroller = h("div", { id: "node-list", class: "vlist", tabindex: "0", role: "region", "aria-label": "Nodes, a scrolling list" }, this.table);
    root.replaceChildren(
      h(
        "div",
        { class: "filters" },
        h("label", { for: "node-filter" }, "Name"),
        this.nameInput,
        h("label", { for: "state-filter" }, "State"),
        this.stateSelect,
      ),
      this.counts,
      this.empty,
      this.scroller,
    );
    const again = () => {
      this.scroller.scrollTop = 0; // other nodes: from the first of them
      this.filter();
    };
    this.nameInput.addEventListener("input", again);
    this.stateSelect.addEventListener("change", again);
    let scrolling = 0;
    const draw = () => {
      if (!scrolling) scrolling = requestAnimationFrame(() => ((scrolling = 0), this.draw()));
    };
    this.scroller.addEventListener("scroll", draw, { passive: true });
    window.addEventListener("resize", () => {
      this.rowH = 0; // a narrow screen's rows are cards, of another height
      draw();
    });
  }

  // The cluster's nodes, in the page's order (by id), as the feed has them now.
  update(nodes) {
    this.nodes = nodes;
    const counts = new Map([...this.options.keys()].map((k) => [k, 0]));
    counts.set("", nodes.length);
    for (const n of nodes) {
      counts.set(n.state, (counts.get(n.state) || 0) + 1);
      if (n.cordoned) counts.set("cordoned", counts.get("cordoned") + 1);
      if (n.draining) counts.set("draining", counts.get("draining") + 1);
    }
    this.countsByState = counts;
    for (const [k, o] of this.options) {
      const label = `${k || "all"} (${fmt(counts.get(k) || 0)})`;
      if (o.textContent !== label) o.textContent = label;
    }
    this.filter();
  }

  filter() {
    const wanted = this.stateSelect.value;
    const name = this.nameInput.value.trim().toLowerCase();
    this.shown = this.nodes.filter((n) => matchesState(n, wanted) && (!name || n.id.toLowerCase().includes(name)));
    const counts = this.countsByState || new Map();
    const parts = [...LIVENESS, ...INTENT].filter((k) => counts.get(k)).map((k) => `${fmt(counts.get(k))} ${k}`);
    const filtered = wanted || name ? `; showing ${fmt(this.shown.length)}` : "";
    const text = `${fmt(this.nodes.length)} node${this.nodes.length === 1 ? "" : "s"}${parts.length ? `: ${parts.join(", ")}` : ""}${filtered}`;
    if (this.counts.textContent !== text) this.counts.textContent = text;
    this.empty.hidden = this.shown.length > 0;
    this.empty.textContent = this.nodes.length ? "No node matches the filters." : "No node has joined yet.";
    this.scroller.hidden = this.shown.length === 0;
    this.draw();
  }

  // Clears the filters if they hide `id`, scrolls its row into the list's view; whether it exists.
  reveal(id) {
    if (!this.nodes.some((n) => n.id === id)) return false;
    if (!this.shown.some((n) => n.id === id)) {
      this.nameInput.value = "";
      this.stateSelect.value = "";
      this.filter();
    }
    const index = this.shown.findIndex((n) => n.id === id);
    const rowH = this.rowHeight();
    this.scroller.scrollTop = Math.max(0, this.headHeight() + index * rowH - this.scroller.clientHeight / 3);
    this.draw();
    this.scroller.scrollIntoView({ block: "nearest" });
    return true;
  }

  rowHeight() {
    if (this.rowH) return this.rowH;
    return parseFloat(getComputedStyle(this.scroller).getPropertyValue("--row-h")) || 58;
  }

  headHeight() {
    // Where the rows begin in the table: the head's height, or nothing where the head is hidden (cards).
    return this.tbody.getBoundingClientRect().top - this.table.getBoundingClientRect().top;
  }

  draw() {
    const actions = this.ctx.actions;
    if (actions !== this.actions) {
      // Made again with or without the Actions column.
      this.actions = actions;
      const columns = actions ? [...NODE_COLUMNS, "Actions"] : NODE_COLUMNS;
      this.head.replaceChildren(...columns.map((c) => h("th", { scope: "col" }, c)));
      this.columns = columns.length;
      this.scroller.classList.toggle("with-actions", Boolean(actions)); // taller cards
      this.rowH = 0;
      for (const { tr } of this.rows.values()) tr.remove();
      this.rows.clear();
    }
    const total = this.shown.length;
    this.table.setAttribute("aria-rowcount", String(total + 1));
    const rowH = this.rowHeight();
    // The box grows with its rows up to its max-height: until it has them, that is its height.
    const height = Math.max(this.scroller.clientHeight, parseFloat(getComputedStyle(this.scroller).maxHeight) || window.innerHeight);
    // Fewer rows than before (a filter, nodes gone): the browser pulls the scroll back, later.
    const viewTop = Math.max(0, Math.min(this.scroller.scrollTop - this.headHeight(), total * rowH - height));
    const first = Math.max(0, Math.floor(viewTop / rowH) - OVERSCAN);
    const last = Math.min(total, Math.ceil((viewTop + height) / rowH) + OVERSCAN);
    const wanted = [];
    const keep = new Map();
    for (let i = first; i < last; i += 1) {
      const n = this.shown[i];
      const had = this.rows.get(n.id);
      const tr = had && had.node === n ? had.tr : nodeRow(n, this.ctx, i + 2);
      tr.setAttribute("aria-rowindex", String(i + 2));
      keep.set(n.id, { node: n, tr });
      wanted.push(tr);
    }
    // The focus is put back where it was if its row is made again.
    const focused = document.activeElement && this.tbody.contains(document.activeElement) ? document.activeElement.id : "";
    for (const [id, { tr }] of this.rows) {
      if (keep.get(id)?.tr !== tr) tr.remove();
    }
    let at = this.top.nextSibling;
    for (const tr of wanted) {
      if (at === tr) at = at.nextSibling;
      else this.tbody.insertBefore(tr, at);
    }
    this.rows = keep;
    this.spacer(this.top, first * rowH);
    this.spacer(this.bottom, (total - last) * rowH);
    if (focused && document.activeElement?.id !== focused) document.getElementById(focused)?.focus({ preventScroll: true });
    if (!this.rowH && wanted.length) {
      // The style sheet's height, as the browser laid the row out (borders, rounding): measured once.
      const measured = wanted[0].getBoundingClientRect().height;
      if (measured > 0 && Math.abs(measured - rowH) > 0.5) {
        this.rowH = measured;
        this.draw();
      } else if (measured > 0) {
        this.rowH = rowH;
      }
    }
  }

  spacer(tr, px) {
    // Heights through the style object: the page's Content-Security-Policy refuses style attributes.
    const height = `${px}px`;
    if (tr.style.height === height && tr.firstChild?.colSpan === this.columns) return;
    tr.style.height = height;
    const td = h("td", { colspan: this.columns });
    td.style.height = height;
    tr.replaceChildren(td);
    tr.hidden = !px;
  }
}
