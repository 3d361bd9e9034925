// Line charts on uPlot: several series on one x axis (step or wall time), EMA smoothing with the raw
// curve faded behind, log scale, and vertical markers (resume boundaries). Data only ever grows.
import { h } from "./dom.js";

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
      series.push({ label: `${s.label} (raw)`, stroke: smoothing ? fade(s.color, 0.25) : s.color, width: 1,
        spanGaps: true, show: true });
      series.push({ label: s.label, stroke: s.color, width: 2, spanGaps: true, show: smoothing });
    }
    const markers = () => this.markers;
    const xMode = () => this.options.xMode;
    return {
      ...this.size(), series, legend: { live: true },
      scales: { x: { time: false }, y: { distr: this.options.log ? 3 : 1 } },
      axes: [{ label: this.options.xMode === "time" ? "wall time (s)" : "step" }, { size: 60 }],
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
