// The asyncrl dashboard page: polls the server's JSON routes and draws what the run folders hold.
"use strict";

const POLL_MS = 2000;
const PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22"];

const state = {
  runs: [],                 // [{name, path}]
  selected: new Set(),      // run names shown
  metrics: {},              // run -> {offset, series: Map("source|name" -> Map(step -> value)), last: {source: record}}
  charts: {},               // metric name -> {chart, unit, meaning}
  panelOrder: [],
  plots: new Map(),         // chart title -> {div, plot, signature}
  tab: "charts",
  logName: null,
  samplesKey: "",           // what the rollout viewer shows now
};

async function getJSON(url) {
  const response = await fetch(url);
  if (!response.ok) throw new Error(`${url}: ${response.status}`);
  return response.json();
}

const runURL = (run, route) => `/api/runs/${run.split("/").map(encodeURIComponent).join("/")}/${route}`;
const runColour = (name) => PALETTE[state.runs.findIndex((r) => r.name === name) % PALETTE.length];

// ---- runs ----

async function refreshRuns() {
  const runs = await getJSON("/api/runs");
  const first = state.runs.length === 0;
  state.runs = runs;
  for (const run of runs) {
    if (!(run.name in state.metrics)) {
      state.metrics[run.name] = { offset: 0, series: new Map(), last: {} };
      if (first && state.selected.size < 4) state.selected.add(run.name);
    }
  }
  for (const select of [document.getElementById("log-run"), document.getElementById("sample-run")]) {
    const current = select.value;
    select.innerHTML = runs.map((r) => `<option>${escapeHTML(r.name)}</option>`).join("");
    if (current && runs.some((r) => r.name === current)) select.value = current;
  }
}

function renderRunTable() {
  const body = document.querySelector("#run-table tbody");
  body.innerHTML = "";
  for (const run of state.runs) {
    const m = state.metrics[run.name];
    const trainer = m.last.trainer || m.last.sft || {};
    const orchestrator = m.last.orchestrator || {};
    const newest = Math.max(...Object.values(m.last).map((r) => r.time || 0), 0);
    const row = document.createElement("tr");
    row.innerHTML = `<td><input type="checkbox" ${state.selected.has(run.name) ? "checked" : ""}></td>
      <td><span class="swatch" style="background:${runColour(run.name)}"></span>${escapeHTML(run.name)}</td>
      <td>${trainer.step ?? ""}</td><td>${orchestrator.step ?? ""}</td>
      <td>${format(orchestrator["reward/mean"])}</td><td>${format(trainer.loss)}</td>
      <td>${newest ? ago(newest) : ""}</td><td class="folder">${escapeHTML(run.path)}</td>`;
    row.querySelector("input").addEventListener("change", (event) => {
      event.target.checked ? state.selected.add(run.name) : state.selected.delete(run.name);
      renderCharts();
      if (state.tab === "configs") renderConfigs();
    });
    body.appendChild(row);
  }
}

// ---- metrics and charts ----

async function pollMetrics(run) {
  const m = state.metrics[run];
  const chunk = await getJSON(`${runURL(run, "metrics")}?offset=${m.offset}`);
  if (chunk.reset) { m.series = new Map(); m.last = {}; }
  m.offset = chunk.offset;
  Object.assign(state.charts, chunk.charts);
  for (const record of chunk.records) {
    m.last[record.source] = record;
    for (const [name, value] of Object.entries(record)) {
      if (name === "step" || name === "source" || name === "time" || typeof value !== "number") continue;
      const key = `${record.source}|${name}`;
      if (!m.series.has(key)) m.series.set(key, new Map());
      m.series.get(key).set(record.step, value);
    }
  }
}

function chartSeries() {
  // chart title -> [{run, source, name}], over the selected runs
  const byChart = new Map();
  const sourcesOf = new Map();
  for (const run of state.selected) {
    for (const key of state.metrics[run]?.series.keys() || []) {
      const [source, name] = key.split("|");
      const meta = state.charts[name];
      if (!meta) continue;
      if (!byChart.has(meta.chart)) byChart.set(meta.chart, []);
      byChart.get(meta.chart).push({ run, source, name });
      sourcesOf.set(name, new Set([...(sourcesOf.get(name) || []), source]));
    }
  }
  for (const list of byChart.values()) {
    list.sort((a, b) => (a.run + a.name + a.source).localeCompare(b.run + b.name + b.source));
    for (const s of list) s.label = (state.selected.size > 1 ? `${s.run}: ` : "") + s.name + (sourcesOf.get(s.name).size > 1 ? ` (${s.source})` : "");
  }
  return byChart;
}

function chartOrder(titles) {
  const rank = (t) => { const i = state.panelOrder.indexOf(t); return i < 0 ? state.panelOrder.length : i; };
  return [...titles].sort((a, b) => rank(a) - rank(b) || a.localeCompare(b));
}

function renderCharts() {
  const container = document.getElementById("charts");
  const byChart = chartSeries();
  for (const [title, entry] of state.plots) {
    if (!byChart.has(title)) { entry.plot.destroy(); entry.div.remove(); state.plots.delete(title); }
  }
  const width = Math.max(420, Math.floor(container.clientWidth / Math.max(1, Math.floor(container.clientWidth / 500))) - 30);
  for (const title of chartOrder(byChart.keys())) {
    const series = byChart.get(title);
    const tables = series.map((s) => {
      const points = [...state.metrics[s.run].series.get(`${s.source}|${s.name}`).entries()].sort((a, b) => a[0] - b[0]);
      return [points.map((p) => p[0]), points.map((p) => p[1])];
    });
    const data = tables.length === 1 ? tables[0] : uPlot.join(tables);
    const signature = series.map((s) => s.label).join("\n") + `|${width}`;
    let entry = state.plots.get(title);
    if (entry && entry.signature !== signature) { entry.plot.destroy(); entry.div.remove(); state.plots.delete(title); entry = null; }
    if (!entry) {
      const div = document.createElement("div");
      div.className = "chart";
      div.dataset.chart = title;
      const unit = state.charts[series[0].name]?.unit || "";
      div.innerHTML = `<h3>${escapeHTML(title)} <span class="unit">${escapeHTML(unit)}</span></h3>`;
      div.title = state.charts[series[0].name]?.meaning || "";
      container.appendChild(div);
      const options = {
        width, height: 220,
        scales: { x: { time: false } },
        axes: [{ label: "step", incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000] }, { size: 60, values: (u, ticks) => ticks.map(axisLabel) }],
        series: [{ label: "step" }, ...series.map((s, i) => ({
          label: s.label, stroke: state.selected.size > 1 ? runColour(s.run) : PALETTE[i % PALETTE.length],
          dash: state.selected.size > 1 ? [[], [6, 3], [2, 3], [8, 3, 2, 3]][series.filter((t) => t.run === s.run).indexOf(s) % 4] : [],
          width: 1.5, spanGaps: true, points: { show: data[0].length < 40 },
        }))],
      };
      entry = { div, plot: new uPlot(options, data, div), signature };
      state.plots.set(title, entry);
    } else {
      entry.plot.setData(data);
    }
    entry.div.dataset.points = String(data[0].length);
  }
  // keep the DOM in chart order
  for (const title of chartOrder(state.plots.keys())) container.appendChild(state.plots.get(title).div);
}

// ---- configs and logs ----

async function renderConfigs() {
  const container = document.getElementById("configs");
  const parts = [];
  for (const run of state.selected) {
    const configs = await getJSON(runURL(run, "configs"));
    const names = Object.keys(configs);
    parts.push(`<h2>${escapeHTML(run)}</h2>` + (names.length ? "" : "<p>no configs/ in this run</p>") +
      names.map((n) => `<div class="config"><h3>${escapeHTML(n)}.toml</h3><pre>${escapeHTML(configs[n])}</pre></div>`).join(""));
  }
  container.innerHTML = parts.join("");
}

async function renderLogs() {
  const run = document.getElementById("log-run").value;
  if (!run) return;
  const { logs } = await getJSON(runURL(run, "logs"));
  if (!logs.includes(state.logName)) state.logName = logs[0] || null;
  const names = document.getElementById("log-names");
  names.innerHTML = logs.map((n) => `<button class="${n === state.logName ? "active" : ""}">${escapeHTML(n)}</button>`).join("");
  names.querySelectorAll("button").forEach((b) => b.addEventListener("click", () => { state.logName = b.textContent; renderLogs(); }));
  const text = document.getElementById("log-text");
  if (!state.logName) { text.textContent = "no logs/ in this run"; return; }
  const stick = text.scrollTop + text.clientHeight >= text.scrollHeight - 5;
  text.textContent = (await getJSON(`${runURL(run, "logs")}?name=${encodeURIComponent(state.logName)}`)).text;
  if (stick) text.scrollTop = text.scrollHeight;
}

// ---- rollout viewer ----

const COLOURINGS = {
  advantage: {
    legend: () => `<span class="key" style="background:rgba(40,160,70,.6)">advantage &gt; 0</span><span class="key" style="background:rgba(210,50,50,.6)">advantage &lt; 0</span>the sampled tokens, shaded by |advantage|; prompt and environment tokens are out of the loss`,
    colour: (t, record, scale) => {
      const a = record.advantage;
      if (!t.inLoss || a === null || a === undefined || a === 0) return "";
      const alpha = 0.15 + 0.6 * Math.min(1, Math.abs(a) / scale.advantage);
      return a > 0 ? `rgba(40,160,70,${alpha})` : `rgba(210,50,50,${alpha})`;
    },
  },
  logprob: {
    legend: () => `<span class="key" style="background:hsl(0,70%,75%)">p = 0</span><span class="key" style="background:hsl(60,70%,75%)">p = 0.5</span><span class="key" style="background:hsl(120,70%,75%)">p = 1</span>the probability inference sampled each token with, exp(logprob)`,
    colour: (t) => (t.logprob === null || t.logprob === undefined ? "" : `hsl(${Math.round(120 * Math.exp(t.logprob))},70%,75%)`),
  },
  mask: {
    legend: () => `<span class="key" style="background:rgba(60,120,220,.35)">in the loss</span><span class="key" style="background:rgba(0,0,0,.08)">out of the loss</span>`,
    colour: (t) => (t.inLoss ? "rgba(60,120,220,.35)" : "rgba(0,0,0,.08)"),
  },
  version: {
    legend: (scale) => scale.versions.map((v) => `<span class="key" style="background:${versionColour(v)}">v${v}</span>`).join("") + "the policy version that sampled each token",
    colour: (t) => (t.version === null || t.version === undefined ? "" : versionColour(t.version)),
  },
};

function versionColour(v) { return `hsla(${(v * 67) % 360},65%,60%,0.45)`; }

async function renderSamples(followNewest) {
  const run = document.getElementById("sample-run").value;
  if (!run) return;
  const stepSelect = document.getElementById("sample-step");
  const wanted = followNewest || !stepSelect.value ? "" : `?step=${stepSelect.value}`;
  const data = await getJSON(runURL(run, "samples") + wanted);
  const colourBy = document.querySelector("input[name=colour]:checked").value;
  const key = `${run}|${data.step}|${data.records.length}|${data.steps.length}|${colourBy}`;
  if (key === state.samplesKey) return;  // nothing new: keep the page (and the reader's place) as it is
  state.samplesKey = key;
  stepSelect.innerHTML = data.steps.map((s) => `<option>${s}</option>`).join("");
  stepSelect.value = String(data.step);
  const colouring = COLOURINGS[colourBy];
  const scale = {
    advantage: Math.max(1e-9, ...data.records.map((r) => Math.abs(r.advantage || 0))),
    versions: [...new Set(data.records.flatMap((r) => (r.samples || []).flatMap((s) => s.policy_versions.filter((v) => v !== null))))].sort((a, b) => a - b),
  };
  document.getElementById("legend").innerHTML = colouring.legend(scale);
  const container = document.getElementById("samples");
  container.innerHTML = data.records.length ? "" : "<p>no samples.jsonl lines for this run yet</p>";
  for (const record of data.records) container.appendChild(sampleCard(record, colouring, scale));
}

function sampleCard(record, colouring, scale) {
  const card = document.createElement("div");
  card.className = "sample";
  const versions = record.policy_versions ? ` · policy versions ${record.policy_versions[0]}–${record.policy_versions[1]}` : "";
  card.innerHTML = `<div class="head"><b>${escapeHTML(record.env || "")}</b> · reward <b>${format(record.reward)}</b>` +
    (record.advantage !== undefined ? ` · advantage <b>${format(record.advantage)}</b>` : "") +
    ` · ${record.turns ?? 1} turn(s)${versions}` + (record.is_truncated ? " · truncated" : "") +
    (record.error ? ` · <span style="color:#c00">error: ${escapeHTML(record.error)}</span>` : "") +
    (record.answer ? ` · answer <code>${escapeHTML(String(record.answer))}</code>` : "") + "</div>";
  if (!record.samples) {  // a line written before samples.jsonl kept tokens: text only
    card.innerHTML += `<div class="segment"><div class="role">prompt</div><div class="text">${escapeHTML(record.prompt || "")}</div></div>` +
      `<div class="segment"><div class="role">completion</div><div class="text">${escapeHTML(record.completion || "")}</div></div>`;
    return card;
  }
  record.samples.forEach((sample, index) => {
    let turn = 0;
    for (const segment of sample.segments) {
      if (segment.role === "assistant") turn += 1;
      const row = document.createElement("div");
      row.className = "segment";
      const label = segment.role === "assistant" ? `assistant, turn ${turn}` : segment.role;
      row.innerHTML = `<div class="role">${record.samples.length > 1 ? `sample ${index + 1}: ` : ""}${label}</div>`;
      const tokens = document.createElement("div");
      tokens.className = "tokens";
      for (let i = segment.start; i < segment.end; i++) {
        const t = { id: sample.token_ids[i], piece: sample.pieces[i], logprob: sample.logprobs[i], inLoss: sample.loss_mask[i], version: sample.policy_versions[i] };
        const span = document.createElement("span");
        span.className = "tok" + (t.inLoss ? "" : " outside");
        span.textContent = t.piece.replace(/\n/g, "↵\n");
        const background = colouring.colour(t, record, scale);
        if (background) span.style.background = background;
        span.title = `token ${t.id}` + (t.inLoss ? ` · logprob ${t.logprob.toFixed(3)} (p ${Math.exp(t.logprob).toFixed(3)}) · policy v${t.version} · in the loss` : " · out of the loss");
        tokens.appendChild(span);
      }
      row.appendChild(tokens);
      card.appendChild(row);
    }
  });
  return card;
}

// ---- helpers and the loop ----

function escapeHTML(text) {
  return String(text).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}

function format(value) {
  if (value === undefined || value === null) return "";
  if (typeof value !== "number") return escapeHTML(value);
  return Math.abs(value) >= 1000 || value === Math.round(value) ? String(Math.round(value * 1000) / 1000) : value.toPrecision(4);
}

function axisLabel(value) {  // axis labels: 3 significant digits, so 1e-3 and 1.5e-3 do not both print as "0.001"
  if (value === null || value === undefined) return "";
  return Math.abs(value) >= 1000 || value === 0 ? String(value) : String(Number(value.toPrecision(3)));
}

function ago(time) {
  const seconds = Math.max(0, Date.now() / 1000 - time);
  return seconds < 120 ? `${Math.round(seconds)} s ago` : seconds < 7200 ? `${Math.round(seconds / 60)} min ago` : `${Math.round(seconds / 3600)} h ago`;
}

function showTab(tab) {
  state.tab = tab;
  document.querySelectorAll("#tabs button").forEach((b) => b.classList.toggle("active", b.dataset.tab === tab));
  document.querySelectorAll(".tab").forEach((s) => s.classList.toggle("active", s.id === tab));
  refreshTab(true);
}

async function refreshTab(changed) {
  if (state.tab === "charts") renderCharts();
  else if (state.tab === "configs" && changed) await renderConfigs();
  else if (state.tab === "logs") await renderLogs();
  else if (state.tab === "rollouts" && (changed || document.getElementById("sample-follow").checked)) {
    await renderSamples(document.getElementById("sample-follow").checked);
  }
}

async function tick() {
  try {
    await refreshRuns();
    await Promise.all([...state.runs.map((r) => r.name)].map(pollMetrics));
    renderRunTable();
    await refreshTab(false);
    document.getElementById("status").textContent = `updated ${new Date().toLocaleTimeString()}`;
  } catch (error) {
    document.getElementById("status").textContent = `not updated: ${error.message}`;
  }
  setTimeout(tick, POLL_MS);
}

async function start() {
  state.panelOrder = await getJSON("/api/panels");
  document.querySelectorAll("#tabs button").forEach((b) => b.addEventListener("click", () => showTab(b.dataset.tab)));
  document.getElementById("log-run").addEventListener("change", renderLogs);
  document.getElementById("sample-run").addEventListener("change", () => renderSamples(document.getElementById("sample-follow").checked));
  document.getElementById("sample-step").addEventListener("change", () => {
    document.getElementById("sample-follow").checked = false;
    renderSamples(false);
  });
  document.querySelectorAll("input[name=colour]").forEach((r) => r.addEventListener("change", () => renderSamples(false)));
  tick();
}

start();
