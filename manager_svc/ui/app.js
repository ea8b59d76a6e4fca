// The rlboost dashboard. Contract: plain JS over the manager's REST API, every call with the
// bearer token the page asked for once (sessionStorage: this tab only). The run list polls
// GET /v1/runs; a run page loads its step records and instance events once, then follows
// GET /v1/runs/{id}/stream (server-sent events read with fetch, so the Authorization header
// goes along) and applies each frame incrementally: charts get their new points (uPlot
// redraws one canvas), the instance timeline is one canvas redrawn at most once per frame, and
// the tables hold a bounded number of rows, so 1,000 steps and 100 instances stay cheap.
// window.rlboost exposes the page's state for tests and the curious.
"use strict";

const $ = (id) => document.getElementById(id);
const TOKEN_KEY = "rlboost.token";
const TERMINAL = ["succeeded", "failed", "cancelled"];
const STEP_ROWS = 12; // rows of the latest-steps table

const state = {
  token: sessionStorage.getItem(TOKEN_KEY) || "",
  auth: undefined, // whether the manager wants a token (GET /healthz)
  view: null, // "runs" | "run"
  runId: null,
  run: null,
  steps: [],
  events: [],
  lastEvent: null,
  instances: new Map(), // id -> {id, kind, joins, version, last, spans: [{start, end, fate, versions}]}
  charts: {},
  renders: { full: 0, incremental: 0 },
  ready: false,
  abort: null,
  timer: null,
};
window.rlboost = state;

// --- the API ------------------------------------------------------------------------------

class Unauthorized extends Error {}

function headers() {
  return state.token ? { Authorization: "Bearer " + state.token } : {};
}

async function api(path, method = "GET") {
  const resp = await fetch(path, { method, headers: headers() });
  if (resp.status === 401) throw new Unauthorized();
  const body = await resp.json();
  if (!resp.ok) throw new Error(typeof body.detail === "string" ? body.detail : resp.statusText);
  return body;
}

// Server-sent events over fetch: EventSource cannot send an Authorization header.
async function follow(path, onFrame, signal) {
  const resp = await fetch(path, { headers: headers(), signal });
  if (resp.status === 401) throw new Unauthorized();
  if (!resp.ok || !resp.body) throw new Error("stream: " + resp.status);
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return false;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      let event = "message", data = "";
      for (const line of block.split("\n")) {
        if (line.startsWith("event: ")) event = line.slice(7);
        else if (line.startsWith("data: ")) data += line.slice(6);
      }
      if (data && onFrame(event, JSON.parse(data)) === "end") return true;
    }
  }
}

// --- routing and login --------------------------------------------------------------------

function show(id) {
  for (const s of ["login", "runs", "run"]) $(s).hidden = s !== id;
  $("logout").hidden = id === "login" || !state.token;
}

function leave() {
  if (state.abort) state.abort.abort();
  state.abort = null;
  clearTimeout(state.timer);
  for (const c of Object.values(state.charts)) c.plot && c.plot.destroy();
  state.charts = {};
}

async function route() {
  leave();
  if (!state.token && state.auth === undefined) {
    state.auth = (await (await fetch("/healthz")).json()).auth; // an open manager needs none
  }
  if (!state.token && state.auth) return askToken("");
  const m = location.hash.match(/^#\/runs\/([\w-]+)/);
  try {
    if (m) await openRun(m[1]);
    else await openRuns();
  } catch (err) {
    if (err instanceof Unauthorized) return askToken(state.token ? "That token was refused." : "");
    throw err;
  }
}

function askToken(message) {
  show("login");
  $("where").textContent = "";
  $("login-error").textContent = message || "";
  $("token").focus();
}

$("login-form").addEventListener("submit", (e) => {
  e.preventDefault();
  state.token = $("token").value.trim();
  sessionStorage.setItem(TOKEN_KEY, state.token);
  route();
});
$("logout").addEventListener("click", () => {
  sessionStorage.removeItem(TOKEN_KEY);
  state.token = "";
  askToken("");
});
window.addEventListener("hashchange", route);

// --- the run list -------------------------------------------------------------------------

function fmtTime(t) {
  return new Date(t * 1000).toLocaleString();
}

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else if (k === "dataset") Object.assign(node.dataset, v);
    else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c instanceof Node ? c : String(c));
  return node;
}

async function openRuns() {
  state.view = "runs";
  const runs = await api("/v1/runs");
  show("runs");
  $("where").textContent = "runs";
  const rows = runs.map((r) => {
    const bar = el("span", { class: "mini" }, el("i"));
    bar.firstChild.style.width = (100 * r.step / Math.max(1, r.steps)).toFixed(1) + "%";
    const tr = el("tr", { class: "clickable", dataset: { run: r.id } },
      el("td", {}, el("a", { href: "#/runs/" + r.id }, r.id)),
      el("td", {}, el("span", { class: "state " + r.state }, r.state)),
      el("td", {}, bar, `${r.step}/${r.steps}`),
      el("td", {}, r.spec.model), el("td", {}, fmtTime(r.created_at)));
    tr.addEventListener("click", () => { location.hash = "#/runs/" + r.id; });
    return tr;
  });
  $("runs-body").replaceChildren(...rows);
  $("runs-empty").hidden = runs.length > 0;
  state.ready = true;
  state.timer = setTimeout(() => state.view === "runs" && route(), 2000);
}

// --- one run --------------------------------------------------------------------------------

async function openRun(runId) {
  state.view = "run";
  Object.assign(state, { runId, run: null, steps: [], events: [], lastEvent: null,
                         instances: new Map(), ready: false });
  const [run, steps] = await Promise.all([api(`/v1/runs/${runId}`), api(`/v1/runs/${runId}/steps`)]);
  let events = [];
  for (let page = await api(`/v1/runs/${runId}/events`); page.length;) {
    events = events.concat(page);
    page = await api(`/v1/runs/${runId}/events?after=${page[page.length - 1].id}`);
  }
  show("run");
  $("where").textContent = "run " + runId;
  $("run-title").textContent = runId;
  onRun(run);
  onSteps(steps);
  onEvents(events);
  state.ready = true;
  if (!TERMINAL.includes(run.state)) live(runId);
}

async function live(runId) {
  const ctrl = new AbortController();
  state.abort = ctrl;
  while (!ctrl.signal.aborted && state.runId === runId) {
    const q = `steps_from=${state.steps.length}` + (state.lastEvent ? `&events_after=${state.lastEvent}` : "");
    try {
      const ended = await follow(`/v1/runs/${runId}/stream?${q}`, (event, data) => {
        if (event === "run") onRun(data);
        else if (event === "steps") onSteps(data.records.slice(state.steps.length - data.from));
        else if (event === "events") onEvents(data);
        else if (event === "end") return "end";
        return null;
      }, ctrl.signal);
      if (ended) return;
    } catch (err) {
      if (ctrl.signal.aborted) return;
      if (err instanceof Unauthorized) return askToken("That token was refused.");
    }
    await new Promise((r) => setTimeout(r, 1000)); // the manager restarting: reconnect
  }
}

function onRun(run) {
  state.run = run;
  const s = $("run-state");
  s.textContent = run.state;
  s.className = "state " + run.state;
  $("cancel").hidden = TERMINAL.includes(run.state);
  const p = run.progress || {};
  const part = p.responses_total ? p.responses_done / p.responses_total : 0;
  const frac = TERMINAL.includes(run.state) && run.state === "succeeded" ? 1
    : Math.min(1, (run.step + (run.state === "running" ? part : 0)) / Math.max(1, run.steps));
  $("run-bar").style.width = (100 * frac).toFixed(1) + "%";
  $("run-progress").textContent = `step ${Math.min(run.step, run.steps)}/${run.steps}` +
    (run.state === "running" && p.responses_total ? ` · ${p.responses_done}/${p.responses_total} responses` : "");
  $("run-warnings").replaceChildren(...(run.warnings || []).map((w) => el("li", {}, w)));
  $("run-error").textContent = run.error || "";
  cards();
}

$("cancel").addEventListener("click", async () => {
  if (!state.runId || !confirm(`Cancel ${state.runId}?`)) return;
  onRun({ ...state.run, ...(await api(`/v1/runs/${state.runId}/cancel`, "POST")),
          progress: state.run.progress, warnings: state.run.warnings });
});

// --- figures --------------------------------------------------------------------------------

const num = (v) => (typeof v === "number" && isFinite(v) ? v : null);
const rate = (r) => (r.step_s > 0 ? r.tokens / r.step_s : null);
const CHARTS = [
  { id: "reward", series: [["reward_mean", "reward", "#3867d6"], ["eval_reward_mean", "eval reward", "#e17b00"]] },
  { id: "throughput", series: [[rate, "tokens/s", "#20a36b"]] },
  { id: "time", series: [["step_s", "step", "#1d2430"], ["seeding_window_s", "seeding window", "#8e44ad"],
    ["rollout_s", "rollout", "#20a36b"], ["train_s", "train", "#3867d6"], ["publish_s", "weight publish", "#e17b00"],
    ["trainer_idle_s", "trainer idle", "#b0b7c3"], ["rollout_idle_s", "rollout idle", "#d63838"]] },
  { id: "faults", series: [["migrations", "migrations", "#8e44ad"], ["preemptions", "preemptions", "#d63838"],
    ["tokens_regenerated", "regenerated tokens", "#e17b00", "right"]] },
  { id: "train", figure: "fig-train", series: [["loss", "loss", "#1d2430"], ["kl", "kl", "#d63838"],
    ["entropy", "entropy", "#20a36b"], ["clip_fraction", "clip fraction", "#8e44ad"], ["grad_norm", "grad norm", "#e17b00", "right"]] },
];

function pick(key, r) {
  return num(typeof key === "function" ? key(r) : r[key]);
}

// The series a chart shows: only those some record has (fields others add appear by themselves).
function present(spec) {
  return spec.series.filter(([key]) => typeof key === "function" || state.steps.some((r) => num(r[key]) !== null));
}

function chartData(series) {
  return [state.steps.map((r) => r.step), ...series.map(([key]) => state.steps.map((r) => pick(key, r)))];
}

function drawChart(spec) {
  const series = present(spec);
  const box = $("chart-" + spec.id);
  const have = state.charts[spec.id];
  const keys = series.map((s) => s[1]).join("|");
  if (spec.figure) $(spec.figure).hidden = series.length === 0;
  if (!series.length) return;
  if (have && have.keys === keys) {
    have.plot.setData(chartData(series)); // new points only: uPlot redraws its canvas
    state.renders.incremental++;
    return;
  }
  if (have) have.plot.destroy();
  const right = series.some((s) => s[3] === "right");
  const opts = {
    width: Math.max(300, box.clientWidth || 520), height: 220,
    scales: { x: { time: false } },
    legend: { live: false },
    axes: [{ label: "step", incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000] }, { scale: "y" }, ...(right ? [{ scale: "r", side: 1, grid: { show: false } }] : [])],
    series: [{ label: "step" }, ...series.map(([, label, color, side]) => ({
      label, stroke: color, width: 1.5, spanGaps: true, scale: side === "right" ? "r" : "y",
      points: { show: state.steps.length < 200 },
    }))],
  };
  box.replaceChildren();
  state.charts[spec.id] = { keys, plot: new uPlot(opts, chartData(series), box) };
  state.renders.full++;
}

let frameQueued = false;
function redraw() {
  if (frameQueued) return;
  frameQueued = true;
  requestAnimationFrame(() => {
    frameQueued = false;
    if (state.view !== "run") return;
    for (const spec of CHARTS) drawChart(spec);
    drawTimeline();
  });
}

function onSteps(records) {
  if (!records.length) return;
  state.steps.push(...records);
  redraw();
  const rows = state.steps.slice(-STEP_ROWS).reverse().map((r) => el("tr", { dataset: { step: r.step } },
    el("td", { class: "num" }, r.step), el("td", { class: "num" }, fix(r.reward_mean, 3)),
    el("td", { class: "num" }, fix(r.eval_reward_mean, 3)), el("td", { class: "num" }, r.tokens),
    el("td", { class: "num" }, fix(rate(r), 0)), el("td", { class: "num" }, fix(r.step_s, 2)),
    el("td", { class: "num" }, r.migrations ?? ""), el("td", { class: "num" }, r.preemptions ?? ""),
    el("td", { class: "num" }, r.tokens_regenerated ?? "")));
  $("steps-body").replaceChildren(...rows);
  $("last-record").textContent = JSON.stringify(state.steps[state.steps.length - 1], null, 1);
  cards();
}

function fix(v, d) {
  return num(v) === null ? "" : v.toFixed(d);
}

function sum(key) {
  return state.steps.reduce((a, r) => a + (num(r[key]) || 0), 0);
}

function cards() {
  const run = state.run;
  if (!run) return;
  const last = state.steps[state.steps.length - 1] || {};
  const recent = state.steps.slice(-5);
  const stepS = recent.reduce((a, r) => a + r.step_s, 0) / Math.max(1, recent.length);
  const left = Math.max(0, run.steps - state.steps.length);
  const eta = run.state === "running" && recent.length ? `${Math.round(left * stepS)} s` : "–";
  const kinds = { reserved: 0, spot: 0 };
  for (const i of state.instances.values()) if (i.alive) kinds[i.kind] = (kinds[i.kind] || 0) + 1;
  const items = [["reward", fix(last.reward_mean, 3)], ["eval reward", fix(last.eval_reward_mean, 3)],
    ["tokens/s", fix(rate(last), 0)], ["ETA", eta], ["instances", `${kinds.reserved} reserved · ${kinds.spot} spot`],
    ["migrations", sum("migrations")], ["preemptions", sum("preemptions")],
    ["regenerated tokens", sum("tokens_regenerated")]];
  $("cards").replaceChildren(...items.map(([k, v]) => el("div", { class: "card", dataset: { card: k } },
    el("b", {}, v === "" ? "–" : v), el("span", {}, k))));
}

// --- the instance timeline ------------------------------------------------------------------

const FATE = { preempt: "preempted", shutdown: "left", abort: "left" };

function onEvents(events) {
  if (!events.length) return;
  state.lastEvent = events[events.length - 1].id;
  const touched = new Set();
  for (const e of events) {
    let inst = state.instances.get(e.instance);
    if (!inst) {
      inst = { id: e.instance, kind: e.kind || "spot", joins: 0, version: null, last: "", alive: false, spans: [],
               quarantined: null };
      state.instances.set(e.instance, inst);
    }
    if (e.kind) inst.kind = e.kind;
    const span = inst.spans[inst.spans.length - 1];
    if (e.type === "join") {
      if (span && span.end === null) span.end = e.t; // a new process under the same id
      inst.spans.push({ start: e.t, end: null, fate: null, versions: e.version === null ? [] : [[e.t, e.version]] });
      inst.joins++;
      inst.alive = true;
    } else if (e.type === "version" && span) {
      span.versions.push([e.t, e.version]);
    } else if ((e.type === "leave" || e.type === "death") && span && span.end === null) {
      span.end = e.t;
      span.fate = e.type === "death" ? "died" : FATE[e.reason] || "left";
      inst.alive = false;
    }
    if (e.version !== null && e.version !== undefined) inst.version = e.version;
    if (e.type === "quarantine") inst.quarantined = e.reason; // no more work in this run
    inst.last = e.type === "leave" ? `${FATE[e.reason] || "left"} ${fmtClock(e.t)}`
      : e.type === "death" ? `died ${fmtClock(e.t)}`
      : e.type === "quarantine" ? `quarantined ${fmtClock(e.t)}: ${e.reason}` : `${e.type} ${fmtClock(e.t)}`;
    touched.add(inst);
  }
  for (const inst of touched) instanceRow(inst);
  $("inst-summary").textContent = `${state.instances.size} seen · ${[...state.instances.values()].filter((i) => i.alive).length} alive`;
  cards();
  redraw();
}

function fmtClock(t) {
  return new Date(t * 1000).toLocaleTimeString();
}

function instanceRow(inst) {
  const fates = inst.spans.map((s) => s.fate).filter(Boolean);
  const fate = [...fates, ...(inst.quarantined ? ["quarantined"] : [])].join(" ") || "alive";
  const row = el("tr", { dataset: { instance: inst.id, kind: inst.kind, fate } },
    el("td", {}, inst.id), el("td", {}, inst.kind), el("td", { class: "num" }, inst.joins),
    el("td", { class: "num" }, inst.version ?? ""), el("td", {}, inst.last));
  const old = document.querySelector(`#inst-body tr[data-instance="${CSS.escape(inst.id)}"]`);
  if (old) old.replaceWith(row);
  else $("inst-body").append(row);
}

function ordered() {
  const rank = (i) => (i.kind === "reserved" ? 0 : 1);
  return [...state.instances.values()].sort((a, b) => rank(a) - rank(b) || a.spans[0].start - b.spans[0].start);
}

function drawTimeline() {
  const canvas = $("timeline");
  const rows = ordered();
  const ROW = 16, LABEL = 130, dpr = window.devicePixelRatio || 1;
  const width = canvas.parentElement.clientWidth || 800, height = Math.max(1, rows.length) * ROW + 18;
  canvas.width = width * dpr;
  canvas.height = height * dpr;
  canvas.style.height = height + "px";
  const g = canvas.getContext("2d");
  g.scale(dpr, dpr);
  g.clearRect(0, 0, width, height);
  if (!rows.length) return;
  const run = state.run || {};
  const t0 = Math.min(...rows.map((i) => i.spans[0].start)); // from the first join
  const done = TERMINAL.includes(run.state);
  const t1 = Math.max(done ? run.updated_at : Date.now() / 1000, ...rows.flatMap((i) => i.spans.map((s) => s.end || s.start)));
  const x = (t) => LABEL + (width - LABEL - 10) * ((t - t0) / Math.max(1e-6, t1 - t0));
  const css = getComputedStyle(document.documentElement);
  g.font = "11px system-ui, sans-serif";
  rows.forEach((inst, r) => {
    const y = r * ROW + 2;
    g.fillStyle = css.getPropertyValue("--" + inst.kind) || "#555";
    g.fillText(inst.id.slice(0, 20), 4, y + 11);
    for (const span of inst.spans) {
      const end = span.end ?? t1;
      g.fillStyle = inst.kind === "reserved" ? "#c7d5f5" : "#c5ead9";
      g.fillRect(x(span.start), y, Math.max(1, x(end) - x(span.start)), ROW - 4);
      span.versions.forEach(([t, v], k) => { // shade = weight version
        const until = k + 1 < span.versions.length ? span.versions[k + 1][0] : end;
        const hue = inst.kind === "reserved" ? 222 : 153;
        g.fillStyle = `hsl(${hue}, 55%, ${62 - (v % 4) * 9}%)`;
        g.fillRect(x(t), y, Math.max(1, x(until) - x(t)), ROW - 4);
        if (x(until) - x(t) > 18) { g.fillStyle = "#fff"; g.fillText("v" + v, x(t) + 2, y + 10); }
      });
      if (span.fate) {
        const xe = x(end);
        g.fillStyle = span.fate === "preempted" ? "#d63838" : "#1d2430";
        g.fillText(span.fate === "preempted" ? "\u25BC" : span.fate === "died" ? "\u2715" : "|", xe - 3, y + 11);
      }
    }
  });
  g.fillStyle = "#6b7585";
  g.fillText(`${(t1 - t0).toFixed(1)} s`, width - 50, height - 4);
}

window.addEventListener("resize", () => {
  for (const [id, c] of Object.entries(state.charts)) {
    const box = $("chart-" + id);
    c.plot.setSize({ width: Math.max(300, box.clientWidth), height: 220 });
  }
  if (state.view === "run") redraw();
});

route();
