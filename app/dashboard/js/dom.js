// Small DOM helpers: elements from tags, escaping by construction (text is never parsed as HTML).
export function h(tag, attrs = {}, ...children) {
  const [name, ...classes] = tag.split(".");
  const el = document.createElement(name || "div");
  if (classes.length) el.className = classes.join(" ");
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key.startsWith("on")) el.addEventListener(key.slice(2), value);
    else if (key === "dataset") Object.assign(el.dataset, value);
    // Through the CSSOM, which a Content-Security-Policy without 'unsafe-inline' still allows.
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

// The model a job trains, and "+ LoRA r8" when it trains an adapter on it.
export function modelName(job) {
  const c = job.model_config;
  const base = job.base_model ? job.base_model.split("/").filter(Boolean).pop() : c ? `gpt2 ${c.n_layer}x${c.n_embd}` : "";
  return job.adapter ? `${base} + ${String(job.adapter.method || "lora").toUpperCase()} r${job.adapter.r}` : base;
}

// A job's settings as one flat object (nested ones as "adapter.r"): the job page lists them, compare diffs them.
export function jobSettings(job) {
  const nested = (prefix, value) => Object.entries(value || {}).map(([k, v]) => [`${prefix}.${k}`, v]);
  return { task: job.task, base_model: job.base_model, train_dataset: job.train_dataset, eval_dataset: job.eval_dataset,
    text_column: job.text_column, label_column: job.label_column,
    ...Object.fromEntries([...nested("hyperparameters", job.hyperparameters), ...nested("adapter", job.adapter),
      ...nested("method", job.method), ...nested("model_config", job.model_config)]) };
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

// `headers` are texts or <th> elements (a th.hide-narrow hides with its column's td.hide-narrow cells); `body` is
// a list of rows or a <tbody> the caller keeps to refill (a tbody inside another would lay the rows out in the
// first column, beside the header rather than under it).
export function table(headers, body) {
  const tbody = body instanceof HTMLTableSectionElement ? body : h("tbody", {}, body);
  const th = (t) => (t instanceof HTMLTableCellElement ? t : h("th", {}, t));
  return h("div.scroll", {}, h("table", {}, h("thead", {}, h("tr", {}, headers.map(th))), tbody));
}
