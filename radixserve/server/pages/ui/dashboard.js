// The cache dashboard: figures now, time series, tiers, the caller's pins and the radix tree, refreshed
// every 2 s from /v1/server/timeseries, /v1/cache/pins and /v1/cache/tree.
"use strict";

const REFRESH_MS = 2000;
const SVG = "http://www.w3.org/2000/svg";
const COLORS = ["#0550ae", "#cf222e", "#1a7f37", "#8250df"];
const collapsed = new Set(); // paths of tree nodes the user closed; kept across refreshes
const $ = (id) => document.getElementById(id);

const CHARTS = [
  { title: "Prefix hit rate", unit: "%", lines: { "hit rate": (s) => s.hit_rate === null ? null : 100 * s.hit_rate } },
  { title: "TTFT", unit: "ms", lines: { p50: (s) => ms(s.ttft_p50), p95: (s) => ms(s.ttft_p95) } },
  { title: "Inter-token latency", unit: "ms", lines: { p50: (s) => ms(s.itl_p50), p95: (s) => ms(s.itl_p95) } },
  { title: "Requests", unit: "", lines: { waiting: (s) => s.waiting, running: (s) => s.running } },
  { title: "KV pages", unit: "", lines: { free: (s) => s.pages_free, cached: (s) => s.pages_cached, "in use": (s) => s.pages_in_use } },
];

function ms(seconds) { return seconds === null ? null : 1000 * seconds; }

function fmt(value, unit) {
  if (value === null || value === undefined) return "–";
  const rounded = Math.abs(value) >= 100 || Number.isInteger(value) ? Math.round(value) : value.toFixed(1);
  return rounded + (unit ? " " + unit : "");
}

function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : n) + " " + units[i];
}

function svg(tag, attrs) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  return node;
}

// One small line chart: a polyline per series over the samples' times, gaps where a value is null.
function chart(spec, samples) {
  const box = el("div", { class: "chart" });
  const names = Object.keys(spec.lines);
  const values = names.map((name) => samples.map(spec.lines[name]));
  const all = values.flat().filter((v) => v !== null);
  const top = Math.max(1, ...all);
  const latest = names.map((name, i) => name + " " + fmt(values[i][values[i].length - 1], spec.unit));
  box.append(el("h3", {}, spec.title + " (max " + fmt(top, spec.unit) + ")"));
  const plot = svg("svg", { viewBox: "0 0 300 90", preserveAspectRatio: "none", role: "img", "aria-label": spec.title + ": " + latest.join(", ") });
  plot.append(svg("line", { x1: 0, y1: 89, x2: 300, y2: 89, stroke: "#d0d7de" }));
  const n = samples.length;
  values.forEach((series, i) => {
    let points = [];
    const flush = () => {
      if (points.length === 1) { // a lone sample: a short dash, since a one-point line draws nothing
        const [x, y] = points[0].split(",").map(Number);
        points = [(x - 3).toFixed(1) + "," + y, (x + 3).toFixed(1) + "," + y];
      }
      if (points.length) plot.append(svg("polyline", { points: points.join(" "), fill: "none", stroke: COLORS[i], "stroke-width": 2, "vector-effect": "non-scaling-stroke" }));
      points = [];
    };
    series.forEach((v, j) => {
      if (v === null) { flush(); return; }
      points.push(((n > 1 ? j / (n - 1) : 1) * 300).toFixed(1) + "," + (88 - (v / top) * 84).toFixed(1));
    });
    flush();
  });
  box.append(plot);
  const legend = el("div", { class: "legend" });
  names.forEach((name, i) => {
    const swatch = el("i");
    swatch.style.background = COLORS[i];
    legend.append(el("span", {}, swatch, latest[i]));
  });
  box.append(legend);
  return box;
}

function showSeries(data) {
  const now = data.now;
  $("updated").textContent = "Updated " + new Date().toLocaleTimeString();
  const set = (id, value) => { document.querySelector(`[data-testid="${id}"]`).textContent = value; };
  set("hit-rate", (100 * data.prefix_hit_rate).toFixed(1) + " %");
  document.querySelector('[data-testid="hit-rate"]').dataset.value = data.prefix_hit_rate;
  set("waiting", now.waiting);
  set("running", now.running);
  set("pages-total", data.num_pages);
  set("pages-free", now.pages_free);
  set("pages-cached", now.pages_cached);
  set("pages-in-use", now.pages_in_use);
  const samples = [...data.samples, now];
  $("charts").replaceChildren(...CHARTS.map((spec) => chart(spec, samples)));
  showTiers(now.tiers);
}

function showTiers(tiers) {
  const rows = [el("tr", {}, ...["tier", "occupancy", "hits", "loads", "pages in", "bytes in", "bytes out", "evicted"].map((h) => el("th", { scope: "col" }, h)))];
  for (const [name, f] of Object.entries(tiers)) {
    const used = f.used_bytes || 0, capacity = f.capacity_bytes || 0;
    const fill = el("div");
    fill.style.width = (capacity ? (100 * used) / capacity : 0).toFixed(1) + "%";
    const bar = el("div", { class: "bar", role: "img", "aria-label": `${bytes(used)} of ${bytes(capacity)}` }, fill);
    const cell = (v) => el("td", {}, v === undefined ? "–" : String(v));
    rows.push(el("tr", { "data-tier": name },
      el("th", { scope: "row" }, el("span", { class: "tier tier-" + name }, name)),
      el("td", {}, bar, el("span", { class: "muted" }, `${bytes(used)} / ${bytes(capacity)}`)),
      cell(f.hits), cell(f.loads), cell(f.pages_in),
      cell(f.bytes_in === undefined ? undefined : bytes(f.bytes_in)),
      cell(f.bytes_out === undefined ? undefined : bytes(f.bytes_out)),
      cell(f.evicted)));
  }
  $("tiers").replaceChildren(...rows);
}

// TTL left of each pin as of the last fetch; the cells count down between fetches (every second).
let pinsFetched = 0;
function ttlLeft(seconds) {
  return duration(Math.max(0, seconds - (performance.now() - pinsFetched) / 1000));
}

function duration(s) {
  if (s < 120) return Math.floor(s) + " s";
  if (s < 7200) return Math.floor(s / 60) + " min " + Math.floor(s % 60) + " s";
  return (s / 3600).toFixed(1) + " h";
}

function tickPins() {
  for (const cell of document.querySelectorAll("#pins td[data-ttl-left]")) {
    cell.textContent = ttlLeft(Number(cell.dataset.ttlLeft));
  }
}

function showPins(list) {
  pinsFetched = performance.now();
  const pins = list.data;
  if (!pins.length) {
    $("pins").replaceChildren(el("tr", {}, el("td", { class: "muted" }, "No pins.")));
    return;
  }
  const head = ["pin", "tokens", "tier", "hits", "TTL left", "TTL", "expires", ""];
  const rows = [el("tr", {}, ...head.map((h) => el("th", { scope: "col" }, h)))];
  for (const p of pins) {
    const unpin = el("button", { type: "button", "aria-label": "Unpin " + p.id }, "Unpin");
    unpin.addEventListener("click", async () => {
      unpin.disabled = true;
      try { await callJson("DELETE", "/v1/cache/pins/" + encodeURIComponent(p.id)); $("pins-error").textContent = ""; }
      catch (e) { $("pins-error").textContent = e.message; }
      refresh();
    });
    rows.push(el("tr", { "data-testid": "pin", "data-pin-id": p.id, "data-tokens": p.tokens, "data-tier": p.tier, "data-hits": p.hits },
      el("th", { scope: "row", class: "mono" }, p.id),
      el("td", {}, String(p.tokens)),
      el("td", {}, el("span", { class: "tier tier-" + p.tier }, p.tier)),
      el("td", {}, String(p.hits)),
      el("td", { "data-ttl-left": p.ttl_left_s }, ttlLeft(p.ttl_left_s)),
      el("td", {}, duration(p.ttl_s)),
      el("td", {}, new Date(p.expires_at * 1000).toLocaleTimeString()),
      el("td", {}, unpin)));
  }
  $("pins").replaceChildren(...rows);
}

function ago(seconds) {
  if (seconds < 60) return Math.round(seconds) + " s ago";
  if (seconds < 3600) return Math.round(seconds / 60) + " min ago";
  return Math.round(seconds / 3600) + " h ago";
}

function nodeItem(node, path) {
  const facts = `${node.tokens} tok · ${node.pages} pages · ${node.hits} hits · used ${ago(node.last_use_s)} · ${node.lock_ref} locks` +
    (node.subtree_nodes > 1 ? ` · subtree ${node.subtree_tokens} tok in ${node.subtree_nodes} nodes` : "");
  const label = [el("span", { class: "text" }, JSON.stringify(node.text)), el("span", { class: "facts" }, facts),
    ...node.tiers.map((t) => el("span", { class: "tier tier-" + t, title: "pages in " + t }, t))];
  const item = el("li", { "data-testid": "node", "data-hits": node.hits, "data-tokens": node.tokens, "data-tiers": node.tiers.join(",") });
  const kids = childList(node, path);
  if (!kids) { item.append(el("div", { class: "leaf" }, ...label)); return item; }
  const details = el("details", {}, el("summary", { "data-path": path }, ...label), kids);
  details.open = !collapsed.has(path);
  details.addEventListener("toggle", () => { if (details.open) collapsed.delete(path); else collapsed.add(path); });
  item.append(details);
  return item;
}

function childList(node, path) {
  if (!node.children.length && !node.hidden_children) return null;
  const list = el("ul", {}, ...node.children.map((c, i) => nodeItem(c, path + "/" + i)));
  if (node.hidden_children) list.append(el("li", { class: "muted" }, `… ${node.hidden_children} more subtrees, ${node.hidden_tokens} tokens`));
  return list;
}

let lastTree = "";
function showTree(tree) {
  const text = JSON.stringify(tree);
  if (text === lastTree) return; // unchanged: keep the DOM, and the keyboard focus in it
  lastTree = text;
  const focused = document.activeElement && document.activeElement.dataset ? document.activeElement.dataset.path : undefined;
  const blocks = tree.namespaces.map((ns, i) => {
    const space = ns.namespace === null ? "default namespace" : "namespace " + JSON.stringify(ns.namespace);
    const name = ns.replica === null ? space : `${ns.replica}: ${space}`; // several engines: each one's own
    return el("section", { "data-testid": "namespace" },
      el("h3", {}, `${name}: ${ns.tokens} tokens, ${ns.pages} pages, ${ns.nodes} nodes`),
      childList(ns, "ns" + i) || el("p", { class: "muted" }, "empty"));
  });
  if (!blocks.length) blocks.push(el("p", { class: "muted" }, "The cache is empty."));
  $("tree").replaceChildren(...blocks);
  if (focused) {
    const again = document.querySelector(`summary[data-path="${focused}"]`);
    if (again) again.focus();
  }
}

async function refreshPins() {
  try {
    showPins(await getJson("/v1/cache/pins"));
    $("pins-error").textContent = "";
  } catch (e) {
    $("pins-error").textContent = e.message;
  }
}

async function refresh() {
  refreshPins();
  try {
    showSeries(await getJson("/v1/server/timeseries"));
    const query = new URLSearchParams({ depth: $("depth").value, min_tokens: $("min-tokens").value });
    showTree(await getJson("/v1/cache/tree?" + query));
    $("tree-error").textContent = "";
  } catch (e) {
    $("tree-error").textContent = e.message;
  }
}

async function loop() {
  if ($("live").checked) await refresh();
  setTimeout(loop, REFRESH_MS);
}

setUpKeyField();
for (const id of ["api-key", "depth", "min-tokens"]) $(id).addEventListener("change", () => { lastTree = ""; refresh(); });
loop();
setInterval(tickPins, 1000);
