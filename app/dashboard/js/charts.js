// Line charts on uPlot: several series on one x axis (step or wall time), EMA smoothing with the raw
// curve faded behind, log scale, and vertical markers (resume boundaries). Data only ever grows.
import { h, num } from "./dom.js";

export const PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#be185d", "#4d7c0f"];

// TensorBoard's debiased exponential moving average: the first points are not pulled towards zero.
export function smooth(values, weight) {
  let last = 0;
  let count = 0;
  return values.map((v) => {
    if (v === null || !Number.isFinite(v)) return null;
    last = last * weight + (1 - weight) * v;
    count += 1;
    return last / (1 - weight ** count);
  });
}

// Tick labels `incr` apart with the fewest decimals that print every tick exactly, in exponent form where fixed
// notation would print 0 or a long row of digits (a learning rate of 5e-5). Log scales label each power alone.
export function tickLabels(splits, incr, log = false) {
  const finite = (v) => v !== null && v !== undefined && Number.isFinite(v);
  if (log) return splits.map((v) => (finite(v) ? String(Number(v.toPrecision(3))) : ""));
  const magnitude = Math.max(0, ...splits.filter(finite).map(Math.abs));
  const exponent = magnitude > 0 && (magnitude < 1e-3 || magnitude >= 1e6);
  const format = (v, digits) => (exponent ? v.toExponential(digits) : v.toFixed(digits));
  const exact = (v, digits) => v === 0 || Math.abs(Number(format(v, digits)) - v)
    <= 1e-6 * Math.min(Math.abs(incr) || Math.abs(v), Math.abs(v));
  let digits = 0;
  while (digits < 12 && !splits.filter(finite).every((v) => exact(v, digits))) digits += 1;
  return splits.map((v) => (!finite(v) ? "" : v === 0 ? "0" : format(v, digits)));
}

// Steps are whole numbers: their axis never splits below 1.
export const STEP_INCRS = [1, 2, 5].flatMap((m) => [1, 10, 100, 1e3, 1e4, 1e5, 1e6, 1e7].map((p) => m * p))
  .sort((a, b) => a - b);

function fade(hex, alpha) {
  const n = parseInt(hex.slice(1), 16);
  return `rgba(${n >> 16},${(n >> 8) & 255},${n & 255},${alpha})`;
}

export class MetricChart {
  // series: [{key, label, color}]; options: {title, xMode, log, smoothing}
  constructor(parent, title, series, options) {
    this.title = title;
    this.series = series;
    this.options = options;
    this.points = new Map(series.map((s) => [s.key, []]));  // key -> [{x_step, x_time, v}], x ascending
    this.markers = [];
    this.plot = null;
    this.pending = null;
    this.box = h("div.plot");
    this.empty = h("div.empty", {}, "waiting for points…");
    this.el = h("div.chart", { "data-chart": title, "data-points": 0 }, h("h3", {}, title), this.empty, this.box);
    parent.append(this.el);
    new ResizeObserver(() => this.plot?.setSize(this.size())).observe(this.box);
  }

  size() { return { width: Math.max(this.box.clientWidth || this.el.clientWidth - 16, 200), height: 220 }; }

  // points: [{key, step, time, value}], time in seconds from the series' origin; keeps x ascending.
  add(points) {
    for (const p of points) {
      const list = this.points.get(p.key);
      if (!list) continue;
      const last = list[list.length - 1];
      if (last && p.step <= last.step) continue;  // replayed or already drawn
      list.push({ step: p.step, time: p.time, v: p.value });
    }
    this.schedule();
  }

  setMarkers(markers) { this.markers = markers; this.schedule(); }

  setOptions(options) { this.options = { ...this.options, ...options }; this.plot?.destroy(); this.plot = null; this.draw(); }

  schedule() {
    if (this.pending) return;
    this.pending = setTimeout(() => { this.pending = null; this.draw(); }, 200);
  }

  data() {
    const axis = this.options.xMode === "time" ? "time" : "step";
    const xs = [...new Set([...this.points.values()].flatMap((list) => list.map((p) => p[axis])))].sort((a, b) => a - b);
    const index = new Map(xs.map((x, i) => [x, i]));
    const columns = [xs];
    for (const s of this.series) {
      const raw = new Array(xs.length).fill(null);
      for (const p of this.points.get(s.key)) {
        raw[index.get(p[axis])] = this.options.log && p.v <= 0 ? null : p.v;
      }
      columns.push(raw, smooth(raw, this.options.smoothing));
    }
    return columns;
  }

  config() {
    const smoothing = this.options.smoothing > 0;
    const series = [{ label: this.options.xMode === "time" ? "seconds" : "step" }];
    for (const s of this.series) {
      const value = (u, v) => (v === null || v === undefined ? "--" : num(v));
      series.push({ label: `${s.label} (raw)`, stroke: smoothing ? fade(s.color, 0.25) : s.color, width: 1,
        spanGaps: true, show: true, value });
      series.push({ label: s.label, stroke: s.color, width: 2, spanGaps: true, show: smoothing, value });
    }
    const markers = () => this.markers;
    const xMode = () => this.options.xMode;
    const steps = this.options.xMode !== "time";
    // The labels drawn last are kept on the element (data-x-ticks, data-y-ticks): the canvas has no text to read.
    const values = (axis, log) => (u, splits, i, space, incr) => {
      const labels = tickLabels(splits, incr, log);
      this.el.dataset[`${axis}Ticks`] = JSON.stringify(labels);
      return labels;
    };
    const width = (u, labels) => Math.max(40, 16 + 7 * Math.max(0, ...(labels || []).map((l) => String(l).length)));
    return {
      ...this.size(), series, legend: { live: true },
      scales: { x: { time: false }, y: { distr: this.options.log ? 3 : 1 } },
      axes: [{ label: steps ? "step" : "wall time (s)", values: values("x", false), ...(steps ? { incrs: STEP_INCRS } : {}) },
        { size: width, values: values("y", this.options.log) }],
      plugins: [{ hooks: { draw: (u) => drawMarkers(u, markers(), xMode()) } }],
    };
  }

  draw() {
    const count = [...this.points.values()].reduce((n, list) => n + list.length, 0);
    this.el.dataset.points = count;
    if (!count) return;
    this.empty.hidden = true;
    const data = this.data();
    if (!this.plot) this.plot = new uPlot(this.config(), data, this.box);
    else this.plot.setData(data);
  }
}

function drawMarkers(u, markers, xMode) {
  const ctx = u.ctx;
  ctx.save();
  ctx.strokeStyle = "#d97706";
  ctx.fillStyle = "#d97706";
  ctx.setLineDash([5, 4]);
  ctx.font = `${11 * devicePixelRatio}px system-ui`;
  for (const m of markers) {
    const value = xMode === "time" ? m.time : m.step;
    if (value === null || value === undefined) continue;
    const x = u.valToPos(value, "x", true);
    if (x < u.bbox.left || x > u.bbox.left + u.bbox.width) continue;
    ctx.beginPath();
    ctx.moveTo(x, u.bbox.top);
    ctx.lineTo(x, u.bbox.top + u.bbox.height);
    ctx.stroke();
    ctx.fillText(m.label, x + 4, u.bbox.top + 12 * devicePixelRatio);
  }
  ctx.restore();
}

// Chart controls shared by the job and compare pages; `onChange` gets {smoothing, log, xMode}.
export function chartControls(onChange) {
  const state = { smoothing: 0.6, log: false, xMode: "step" };
  const value = h("span.muted", {}, state.smoothing.toFixed(2));
  return {
    state,
    el: h("div.row.card", {},
      h("label", {}, "smoothing ", h("input", { type: "range", id: "smoothing", min: 0, max: 0.99, step: 0.01,
        value: state.smoothing, oninput: (e) => { state.smoothing = Number(e.target.value);
          value.textContent = state.smoothing.toFixed(2); onChange(state); } }), " ", value),
      h("label", {}, h("input", { type: "checkbox", id: "log-scale",
        onchange: (e) => { state.log = e.target.checked; onChange(state); } }), " log scale"),
      h("label", {}, "x axis ", h("select", { id: "x-axis", onchange: (e) => { state.xMode = e.target.value;
        onChange(state); } }, h("option", { value: "step" }, "step"), h("option", { value: "time" }, "wall time")))),
  };
}
