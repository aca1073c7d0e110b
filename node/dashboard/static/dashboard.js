// The dashboard page: polls /api/state (docs/dashboard.md) and redraws. Text from the
// swarm (peer ids, devices, events) is set with textContent only, never as HTML.
"use strict";

const POLL_MS = 2000;
const SVG = "http://www.w3.org/2000/svg";
const W = 600, H = 180, PAD_L = 44, PAD_B = 18, PAD_T = 8;

function $(id) { return document.getElementById(id); }

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}

function fmt(x, digits = 1) {
  if (x === null || x === undefined) return "–";
  if (typeof x !== "number") return String(x);
  return Number.isInteger(x) ? x.toLocaleString("en") : x.toFixed(digits);
}

function duration(s) {
  if (s === null || s === undefined) return "–";
  s = Math.floor(s);
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), sec = s % 60;
  return h ? `${h}h${String(m).padStart(2, "0")}m` : `${m}m${String(sec).padStart(2, "0")}s`;
}

function fillRows(tbody, rows) {
  tbody.replaceChildren(...rows.map(({ cells, cls, data }) => {
    const tr = el("tr", null, cls);
    if (data) for (const [k, v] of Object.entries(data)) tr.dataset[k] = v;
    for (const c of cells) tr.append(el("td", c));
    return tr;
  }));
}

function drawRun(s) {
  const run = s.run;
  $("run-id").textContent = run.id;
  document.title = `swarmtrain ${run.id}`;
  if (!run.known) { $("run-line").textContent = "joining: the run's spec is not known yet"; return; }
  const m = run.model;
  const model = m.preset ? `${m.preset} model` : "custom model";
  $("run-line").textContent =
    `${model} (${m.n_layer} layers, width ${m.n_embd}, context ${m.block_size}) · ` +
    `${run.n_stages} stages · ${run.private ? "private" : "public"} · owner ${run.owner_fingerprint} · ` +
    `${run.averaging} averaging, batch ${run.target_batch_size} of ${run.micro_batch_size}-sample micro-batches`;
}

function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return i ? `${n.toFixed(1)} ${units[i]}` : `${n} B`;
}

// "activations 1.2 MiB, averaging 300 KiB" for a direction's bytes by purpose.
function byPurpose(counts) {
  if (!counts) return "–";
  const parts = Object.entries(counts).filter(([, v]) => v > 0).map(([k, v]) => `${k} ${bytes(v)}`);
  return parts.length ? parts.join(", ") : "none yet";
}

function networkFacts(net) {
  if (!net) return [];
  const limit = d => (net.limit_mbps && net.limit_mbps[d] !== null) ? `${fmt(net.limit_mbps[d])} Mbit/s` : "none";
  const adv = net.advertised_mbps;
  return [
    ["bytes sent", byPurpose(net.bytes_sent)], ["bytes received", byPurpose(net.bytes_received)],
    ["limits up / down", net.limit_mbps ? `${limit("sent")} / ${limit("received")}` : "–"],
    ["advertised up / down", adv ? `${fmt(adv.up)} / ${fmt(adv.down)} Mbit/s` : "unknown"],
  ];
}

function drawNode(s) {
  const n = s.node;
  const stages = n.stage === null ? "none yet" :
    (n.second_stage === null ? String(n.stage) : `${n.stage} + ${n.second_stage}`);
  const rounds = Object.entries(n.averaging_rounds.by_outcome).map(([k, v]) => `${k} ${v}`).join(", ");
  $("node-id").textContent = n.peer_id;
  const facts = [
    ["state", n.state], ["stage", stages], ["device", n.device],
    ["uptime", duration(n.uptime_s)], ["samples trained", fmt(n.samples_trained)],
    ["mean loss", fmt(n.mean_loss, 3)], ["samples served", fmt(n.samples_served)],
    ["calls failed", fmt(n.calls_failed)], ["rerouted", fmt(n.calls_rerouted)],
    ["requests refused", fmt(n.requests_refused)], ["bans", fmt(n.bans)],
    ["averaging rounds", rounds || "none yet"],
    ["mean round", n.averaging_rounds.mean_s === null ? "–" : `${fmt(n.averaging_rounds.mean_s, 2)} s`],
    ["checkpoints", fmt(n.checkpoints)], ["moves", fmt(n.moves)],
    ...networkFacts(n.network),
  ];
  $("node-facts").replaceChildren(...facts.flatMap(([k, v]) => [el("dt", k), el("dd", v)]));
  fillRows($("held-table").tBodies[0], n.stages.map(st => ({
    cells: [st.stage, st.role, fmt(st.forward), fmt(st.backward), fmt(st.refused), fmt(st.steps),
      st.averaging.epoch, st.load, st.averaging.rounds, st.averaging.alone, st.averaging.fallbacks,
      st.averaging.catch_ups, fmt(st.averaging.mean_round_s, 2)],
  })));
}

function drawSwarm(s) {
  const sw = s.swarm;
  $("swarm-read").textContent = sw.read_at === null ? "(not read yet)" :
    `(${sw.peers.length} peers, read ${Math.max(0, Math.round(s.time - sw.read_at))} s ago)`;
  fillRows($("stage-table").tBodies[0], sw.stages.map(st => ({
    cells: [st.stage, st.serving, st.also_served_by, fmt(st.throughput),
      st.stage === sw.bottleneck_stage ? "bottleneck" : ""],
    cls: st.stage === sw.bottleneck_stage ? "bottleneck" : "",
    data: { stage: st.stage },
  })));
  fillRows($("peer-table").tBodies[0], sw.peers.map(p => {
    let stage = p.stage === null ? "–" : String(p.stage);
    if (p.second_stage !== null) stage += `+${p.second_stage}${p.second_serving ? "" : "?"}`;
    const bw = p.bandwidth_source === "unknown" ? "?" :
      `${fmt(p.bandwidth_up_mbps, 0)}/${fmt(p.bandwidth_down_mbps, 0)}`;
    return {
      cells: [p.short_id + (p.me ? " (this node)" : ""), stage, p.state, p.device,
        fmt(p.throughput), p.load, fmt(p.samples_served), bw, duration(p.uptime_s), p.version, fmt(p.age_s)],
      cls: p.me ? "me" : "",
      data: { peer: p.peer_id },
    };
  }));
}

function drawEvents(s) {
  $("event-list").replaceChildren(...s.events.slice().reverse().map(e => {
    const { t, event, ...rest } = e;
    delete rest.digest;
    const when = new Date(t * 1000).toLocaleTimeString();
    const fields = Object.entries(rest).map(([k, v]) => `${k}=${typeof v === "object" ? JSON.stringify(v) : v}`);
    return el("li", `${when} ${event} ${fields.join(" ")}`);
  }));
}

// One chart: polylines of each series over time (a null breaks a line), the y range
// from the data, its bounds written on the left axis.
function chart(svg, t, series, yFrom0) {
  const ys = series.flatMap(s => s.values.filter(v => v !== null));
  const parts = [];
  const rect = document.createElementNS(SVG, "rect");
  for (const [k, v] of [["x", PAD_L], ["y", PAD_T], ["width", W - PAD_L - 4], ["height", H - PAD_T - PAD_B], ["fill", "none"], ["stroke", "#ddd"]]) rect.setAttribute(k, v);
  parts.push(rect);
  if (t.length < 2 || ys.length === 0) {
    parts.push(label(PAD_L + 8, H / 2, "no points yet"));
    svg.replaceChildren(...parts);
    svg.dataset.points = "0";
    return;
  }
  let lo = yFrom0 ? 0 : Math.min(...ys), hi = Math.max(...ys);
  if (hi - lo < 1e-9) { hi += 1; lo = yFrom0 ? 0 : lo - 1; }
  const t0 = t[0], t1 = t[t.length - 1];
  const x = v => PAD_L + (W - PAD_L - 4) * (v - t0) / (t1 - t0 || 1);
  const y = v => PAD_T + (H - PAD_T - PAD_B) * (1 - (v - lo) / (hi - lo));
  for (const s of series) {
    let run = [];
    const flush = () => {
      if (run.length > 1) {
        const line = document.createElementNS(SVG, "polyline");
        line.setAttribute("points", run.join(" "));
        line.setAttribute("fill", "none");
        line.setAttribute("stroke", s.color);
        line.setAttribute("stroke-width", "1.5");
        line.setAttribute("vector-effect", "non-scaling-stroke");
        parts.push(line);
      } else if (run.length === 1) {  // a point between gaps: a dot
        const [cx, cy] = run[0].split(",");
        const dot = document.createElementNS(SVG, "circle");
        for (const [k, v] of [["cx", cx], ["cy", cy], ["r", "2.5"], ["fill", s.color]]) dot.setAttribute(k, v);
        parts.push(dot);
      }
      run = [];
    };
    s.values.forEach((v, i) => { if (v === null) flush(); else run.push(`${x(t[i]).toFixed(1)},${y(v).toFixed(1)}`); });
    flush();
  }
  parts.push(label(2, PAD_T + 10, fmt(hi, 2)), label(2, H - PAD_B, fmt(lo, 2)));
  parts.push(label(PAD_L, H - 4, `${duration(t1 - t0)} ago`), label(W - 30, H - 4, "now"));
  svg.replaceChildren(...parts);
  svg.dataset.points = String(ys.length);
}

function label(x, y, text) {
  const e = document.createElementNS(SVG, "text");
  e.setAttribute("x", x);
  e.setAttribute("y", y);
  e.textContent = text;
  return e;
}

function drawCharts(s) {
  const h = s.history;
  chart($("loss-chart"), h.t, [{ values: h.loss, color: "#d62728" }], false);
  chart($("rate-chart"), h.t, [
    { values: h.swarm_samples_per_s, color: "#555" },
    { values: h.train_samples_per_s, color: "#1f77b4" },
    { values: h.served_samples_per_s, color: "#ff7f0e" },
  ], true);
}

async function poll() {
  try {
    const response = await fetch("/api/state", { cache: "no-store" });
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    const s = await response.json();
    drawRun(s); drawNode(s); drawSwarm(s); drawCharts(s); drawEvents(s);
    $("status").textContent = `updated ${new Date(s.time * 1000).toLocaleTimeString()}`;
    $("status").className = "status muted";
  } catch (e) {
    $("status").textContent = `the node does not answer (${e.message}); retrying`;
    $("status").className = "status down";
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

poll();
