// Small DOM helpers: elements from tags, escaping by construction (text is never parsed as HTML).
export function h(tag, attrs = {}, ...children) {
  const [name, ...classes] = tag.split(".");
  const el = document.createElement(name || "div");
  if (classes.length) el.className = classes.join(" ");
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key.startsWith("on")) el.addEventListener(key.slice(2), value);
    else if (key === "dataset") Object.assign(el.dataset, value);
    // Through the CSSOM: the Content-Security-Policy refuses style attributes (style-src without 'unsafe-inline').
    else if (key === "style") el.style.cssText = value;
    else if (key in el && typeof value !== "string") el[key] = value;
    else el.setAttribute(key, value === true ? "" : value);
  }
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : String(child));
  }
  return el;
}

export const badge = (status) => h(`span.badge.${status}`, { "data-status": status }, status);

export function progressBar(fraction) {
  const pct = Math.round((fraction || 0) * 100);
  return h("span.progress", { title: `${pct}%`, role: "progressbar", "aria-valuenow": pct },
    h("span", { style: `width:${pct}%` }));
}

export function duration(seconds) {
  if (seconds === null || seconds === undefined) return "";
  const s = Math.round(seconds);
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m ${s % 60}s`;
  return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`;
}

export const num = (v, digits = 4) => (typeof v === "number" ? Number(v.toPrecision(digits)).toString() : v ?? "");

export function modelName(job) {
  if (job.base_model) return job.base_model.split("/").filter(Boolean).pop();
  const c = job.model_config;
  return c ? `gpt2 ${c.n_layer}x${c.n_embd}` : "";
}

export function bestMetric(job) {
  const b = job.best_metrics || {};
  for (const name of ["eval_accuracy", "eval_f1", "eval_loss", "perplexity"]) {
    if (name in b) return `${name.replace("eval_", "")} ${num(b[name])}`;
  }
  return "";
}

export function errorBox(error) {
  const where = error?.body?.field ? ` (${error.body.field})` : "";
  return h("p.error", { role: "alert" }, `${error?.message || error}${where}`);
}

export function table(headers, rows) {
  return h("div.scroll", {}, h("table", {}, h("thead", {}, h("tr", {}, headers.map((t) => h("th", {}, t)))),
    h("tbody", {}, rows)));
}
