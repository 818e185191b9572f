// The live KV page: polls /dashboard/api/state once a second and draws the block pool, the
// requests' block tables and small plots of the engine's figures. No library, no build step.
"use strict";
const POLL_MS = 1000, WINDOW_S = 300;
const PLOTS = [
  ["running", "running", ""], ["waiting", "waiting", ""], ["swapped", "swapped", ""],
  ["step_ms", "step time", "ms"], ["batch_size", "batch size", ""], ["budget_use", "token budget use", "%"],
  ["hit_rate", "prefix hit rate", "%"], ["preemptions", "preemptions", "/s"], ["kv_usage", "KV blocks used", "%"],
  ["image_tokens", "image tokens", "/s"], ["encoder_use", "vision encoder busy", "%"],
];
const $ = (id) => document.getElementById(id);
const page = new URLSearchParams(location.search);
const cells = page.get("cells") || "2048";
let samples = [], lastT = 0, map = null, timer = null, inFlight = false, again = false;
// the request whose table is shown (hovered, or pinned by a click): each poll asks for its table
// with the map, so that both come from one moment of the pool
let wanted = null, pinned = null;

// The key: ?key=K once (then dropped from the address bar), or typed into the form on a 401.
if (page.has("key")) {
  sessionStorage.setItem("folio-key", page.get("key"));
  page.delete("key");
  history.replaceState(null, "", location.pathname + (page.toString() ? "?" + page : ""));
}
function headers() {
  const key = sessionStorage.getItem("folio-key");
  return key ? { Authorization: "Bearer " + key } : {};
}
$("key-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  sessionStorage.setItem("folio-key", $("key-input").value);
  $("key-form").hidden = true;
  poll();
});

async function getJSON(path) {
  const r = await fetch(path, { headers: headers(), cache: "no-store" });
  if (r.status === 401) throw Object.assign(new Error("the API key was refused"), { auth: true });
  if (!r.ok) throw new Error(path + ": " + r.status);
  return r.json();
}

async function poll() {
  clearTimeout(timer);
  if (inFlight) { again = true; return; }  // one request at a time; the next one right after
  inFlight = true;
  let waitForKey = false;
  try {
    const table = wanted ? "&req_id=" + encodeURIComponent(wanted) : "";
    const s = await getJSON(`/dashboard/api/state?since=${lastT}&cells=${cells}${table}`);
    $("model").textContent = s.model;
    for (const p of s.samples) samples.push(p);
    if (samples.length) lastT = samples[samples.length - 1].t;
    samples = samples.filter((p) => p.t > s.time - WINDOW_S);
    if (s.map && s.map.registered) {
      map = s.map;
      drawPool(s.map);
      drawRequests(s.map);
      drawTable(s.map.table);
    }
    drawTiers(s.now && s.now.tiers);
    drawPlots(s.time);
    const down = s.down.length ? " · down: " + s.down.join(", ") : "";
    setStatus("updated " + new Date(s.time * 1000).toLocaleTimeString() + down, !!s.down.length);
    document.body.dataset.updates = String(Number(document.body.dataset.updates || 0) + 1);
  } catch (err) {
    setStatus(err.message, true);
    waitForKey = !!err.auth;
    $("key-form").hidden = !waitForKey;
  } finally {
    inFlight = false;
  }
  if (!waitForKey) timer = setTimeout(poll, again ? 0 : POLL_MS);
  again = false;
}

function setStatus(text, bad) {
  $("status").textContent = text;
  $("status").classList.toggle("error", bad);
}

// One element per cell; a cell stands for blocks_per_cell consecutive blocks. It takes the colour
// of the state most of its held or cached blocks are in (ties: shared, owned, cached), paler the
// more of its blocks are free, so that a few busy blocks in a large range still show.
function cellsOf(grid, tier) {
  if (grid.children.length !== tier.num_cells) {
    grid.replaceChildren(...Array.from({ length: tier.num_cells }, (_, i) => {
      const el = document.createElement("div");
      el.className = "cell";
      el.dataset.i = i;
      return el;
    }));
    const px = tier.num_cells <= 512 ? 14 : tier.num_cells <= 2048 ? 10 : 6;
    grid.style.setProperty("--cell", px + "px");
  }
  return grid.children;
}

function cellRange(tier, i) {
  const first = i * tier.blocks_per_cell;
  return [first, Math.min(tier.num_blocks, first + tier.blocks_per_cell) - 1];
}

function drawPool(m) {
  const d = m.device, els = cellsOf($("device-grid"), d), big = d.num_cells <= 512;
  for (let i = 0; i < d.num_cells; i++) {
    const [a, b] = cellRange(d, i), size = b - a + 1;
    const n = { shared: d.shared[i], owned: d.owned[i], cached: d.cached[i] };
    n.free = size - n.shared - n.owned - n.cached;
    let state = "shared";
    for (const k of ["owned", "cached"]) if (n[k] > n[state]) state = k;
    if (n[state] === 0) state = "free";
    const el = els[i];
    el.style.opacity = state === "free" || size === 1 ? "" : (0.35 + 0.65 * (size - n.free) / size).toFixed(2);
    el.className = "cell s-" + state + (el.classList.contains("hl") ? " hl" : "");
    el.dataset.state = state;
    el.dataset.refs = d.max_refs[i];
    el.textContent = state === "shared" && big ? String(d.max_refs[i]) : "";
    el.title = (size > 1 ? `blocks ${a}–${b}: ` : `block ${a}: `) +
      `${n.owned} owned, ${n.shared} shared (max refs ${d.max_refs[i]}), ${n.cached} cached, ${n.free} free`;
  }
  $("cell-note").textContent = d.blocks_per_cell > 1 ? `one cell = ${d.blocks_per_cell} blocks` : "one cell = one block";
  const sum = (xs) => xs.reduce((a, b) => a + b, 0), used = sum(d.owned) + sum(d.shared), cached = sum(d.cached);
  $("device-summary").textContent = `${d.num_blocks} blocks of ${m.block_size} tokens · ` +
    `${used} used, ${cached} cached, ${d.num_blocks - used - cached} free`;
  const h = m.host, hel = cellsOf($("host-grid"), h);
  for (let i = 0; i < h.num_cells; i++) {
    const [a, b] = cellRange(h, i), used = h.used[i];
    hel[i].className = "cell " + (used * 2 >= b - a + 1 && used ? "s-host" : "s-free");
    hel[i].dataset.state = used ? "host" : "free";
    hel[i].title = `host blocks ${a}–${b}: ${used} hold swapped-out tables`;
  }
  $("host-summary").textContent = h.num_blocks ? `${h.num_blocks} blocks` : "none (no swap space)";
}

// The tiers: device, host and, with --kv-disk-dir, disk (the kvmanager's ``stats``).
function drawTiers(tiers) {
  const el = $("tiers");
  el.replaceChildren();
  if (!tiers) return;
  const mb = (n) => n == null ? "–" : (n / 1e6).toFixed(1) + " MB";
  for (const [name, t] of Object.entries(tiers)) {
    const tr = document.createElement("tr");
    const cached = t.blocks_cached == null ? "–" : t.blocks_cached;
    const cells = [name, `${t.blocks == null ? cached : t.blocks} blocks`, `${cached} cached`, mb(t.bytes),
      `${t.hit_blocks} hit blocks`];
    for (const c of cells) {
      const td = document.createElement("td");
      td.textContent = c;
      tr.appendChild(td);
    }
    el.appendChild(tr);
  }
}

// Rows are kept per request and updated in place, so that the row under the mouse stays hovered.
const rows = new Map();
function drawRequests(m) {
  $("seq-summary").textContent = m.num_seqs > m.seqs.length ? `${m.seqs.length} of ${m.num_seqs}` : String(m.num_seqs);
  const live = new Set(m.seqs.map((s) => s.req_id));
  for (const [reqId, tr] of rows) if (!live.has(reqId)) { tr.remove(); rows.delete(reqId); }
  const body = $("requests").tBodies[0];
  for (const s of m.seqs) {
    let tr = rows.get(s.req_id);
    if (!tr) {
      tr = document.createElement("tr");
      tr.dataset.req = s.req_id;
      tr.innerHTML = "<td></td><td></td><td></td><td></td>";
      tr.firstChild.title = s.req_id;
      tr.addEventListener("mouseenter", () => want(s.req_id));
      tr.addEventListener("mouseleave", () => want(pinned));
      tr.addEventListener("click", () => { pinned = pinned === s.req_id ? null : s.req_id; markPinned(); want(s.req_id); });
      rows.set(s.req_id, tr);
      body.append(tr);
    }
    const name = s.req_id.length > 24 ? s.req_id.slice(0, 9) + "…" + s.req_id.slice(-12) : s.req_id;
    const values = [name, s.num_blocks + (s.swapped_out ? " (host)" : ""), s.num_shared_blocks, s.num_tokens];
    values.forEach((v, i) => { if (tr.children[i].textContent !== String(v)) tr.children[i].textContent = v; });
  }
  if (pinned && !live.has(pinned)) pinned = null;
  if (wanted && !live.has(wanted)) wanted = pinned;  // it finished: its table is gone
  markPinned();
}

function markPinned() {
  for (const [reqId, tr] of rows) tr.className = reqId === pinned ? "selected" : "";
}

function want(reqId) {
  if (reqId === wanted) return;
  wanted = reqId;
  if (!wanted) drawTable(null);
  poll();  // now, not at the next tick
}

function drawTable(t) {
  if (!t || t.req_id !== wanted || !t.known) {
    $("table-view").hidden = true;
    highlight(null);
    return;
  }
  $("table-view").hidden = false;
  $("table-req").textContent = t.req_id;
  const ids = t.swapped_out ? t.host_block_ids : t.block_ids;
  $("table-blocks").replaceChildren(...ids.map((b, i) => {
    const el = document.createElement("span"), refs = t.swapped_out ? 1 : t.block_ref_counts[i];
    el.className = "chip" + (refs > 1 ? " shared" : "");
    el.textContent = b;
    el.title = `logical block ${i} → ${t.swapped_out ? "host " : ""}block ${b}, ref count ${refs}`;
    return el;
  }));
  highlight(t);
}

function highlight(t) {
  for (const el of document.querySelectorAll(".cell.hl")) el.classList.remove("hl");
  if (!t || !map) return;
  const tier = t.swapped_out ? map.host : map.device, grid = t.swapped_out ? $("host-grid") : $("device-grid");
  for (const b of (t.swapped_out ? t.host_block_ids : t.block_ids)) {
    const el = grid.children[Math.floor(b / tier.blocks_per_cell)];
    if (el) el.classList.add("hl");
  }
}

function drawPlots(nowT) {
  // the window grows with the history, from one minute to WINDOW_S
  const span = Math.min(WINDOW_S, Math.max(60, samples.length ? nowT - samples[0].t : 0));
  const box = $("plots");
  if (!box.children.length) {
    for (const [key, label] of PLOTS) {
      const div = document.createElement("div");
      div.className = "plot";
      div.id = "plot-" + key;
      div.innerHTML = `<span class="value"></span>${label}<svg viewBox="0 0 300 48" preserveAspectRatio="none"><polyline/></svg>`;
      box.append(div);
    }
  }
  for (const [key, , unit] of PLOTS) {
    const div = $("plot-" + key), scale = unit === "%" ? 100 : 1;
    const pts = samples.filter((p) => p[key] !== null && p[key] !== undefined)
      .map((p) => [p.t, unit === "/s" ? p[key] / (p.dt || 1) : p[key] * scale]);
    const top = Math.max(unit === "%" ? 100 : 1, ...pts.map((p) => p[1]));
    div.querySelector("polyline").setAttribute("points", pts.map(([t, v]) =>
      `${(300 - 300 * (nowT - t) / span).toFixed(1)},${(46 - 44 * v / top).toFixed(1)}`).join(" "));
    const last = pts.length ? pts[pts.length - 1][1] : null;
    div.querySelector(".value").textContent = last === null ? "–" :
      (Number.isInteger(last) ? last : last.toFixed(unit === "%" ? 0 : 2)) + (unit === "%" ? "%" : unit ? " " + unit : "");
    div.dataset.value = last === null ? "" : String(last);
  }
}

poll();
