// Jobs list (live, filtered by status, with a compare selection) and the form that starts a job.
import { api, sleep } from "./api.js";
import { badge, bestMetric, duration, errorBox, h, modelName, progressBar, table } from "./dom.js";

const STATUSES = ["", "queued", "running", "succeeded", "failed", "cancelled"];

export async function renderJobs(root, params, signal) {
  const status = params.get("status") || "";
  const selected = new Set();
  const filter = h("select", { id: "status-filter", "aria-label": "Filter by status",
    onchange: (e) => { location.hash = e.target.value ? `#/jobs?status=${e.target.value}` : "#/jobs"; } },
    STATUSES.map((s) => h("option", { value: s, selected: s === status }, s || "all statuses")));
  const compare = h("button.secondary", { id: "compare-selected", disabled: true,
    onclick: () => { location.hash = `#/compare?ids=${[...selected].join(",")}`; } }, "Compare selected");
  const body = h("tbody");
  const error = h("div");
  root.append(h("div.row", {}, h("h1.grow", {}, "Jobs"), filter, compare,
    h("button", { id: "new-job-toggle", onclick: () => {
      form.hidden = !form.hidden;
      if (!form.hidden) form.loadDatasets();
    } }, "New job")));
  const form = newJobForm(signal);
  form.hidden = true;
  root.append(form, error, h("div.card", {}, table(
    ["", "job", "status", "progress", "ETA", "model", "best", h("span.hide-narrow", {}, "created")], body)));

  const row = (job) => h("tr", { "data-job": job.id },
    h("td", {}, h("input", { type: "checkbox", "aria-label": `select ${job.id}`, checked: selected.has(job.id),
      onchange: (e) => { e.target.checked ? selected.add(job.id) : selected.delete(job.id);
        compare.disabled = selected.size < 2; } })),
    h("td", {}, h("a", { href: `#/jobs/${job.id}` }, job.id), h("div.muted", {}, job.task)),
    h("td", {}, badge(job.status)),
    h("td", {}, progressBar(job.progress.fraction), " ",
      h("span.muted", {}, `${job.progress.step}/${job.progress.total_steps ?? "?"}`)),
    h("td.num", {}, duration(job.eta_seconds)),
    h("td", {}, modelName(job)),
    h("td.num", {}, bestMetric(job)),
    h("td.muted.hide-narrow", {}, new Date(job.created_at).toLocaleString()));

  while (!signal.aborted) {
    try {
      const page = await api(`/jobs?limit=100${status ? `&status=${status}` : ""}`, { signal });
      body.replaceChildren(...page.data.map(row));
      if (!page.data.length) body.append(h("tr", {}, h("td", { colSpan: 8 }, h("span.muted", {}, "No jobs yet."))));
      error.replaceChildren();
    } catch (e) {
      if (signal.aborted) return;
      error.replaceChildren(errorBox(e));
    }
    await sleep(2000, signal);  // a list of many jobs has no single stream to follow: poll it
  }
}

function newJobForm(signal) {
  const datasets = h("select", { name: "train_dataset", required: true });
  const evalSets = h("select", { name: "eval_dataset" });
  const error = h("div");
  const field = (label, input) => h("label", {}, label, input);
  const task = h("select", { name: "task" }, h("option", {}, "text-classification"), h("option", {}, "causal-lm"));
  const form = h("form.card.grid", { id: "new-job", onsubmit: async (e) => {
    e.preventDefault();
    const data = new FormData(form);
    try {
      const body = {
        task: data.get("task"), train_dataset: data.get("train_dataset"),
        text_column: data.get("text_column") || "text",
        hyperparameters: JSON.parse(data.get("hyperparameters") || "{}"),
      };
      if (data.get("base_model")) body.base_model = data.get("base_model");
      if (data.get("eval_dataset")) body.eval_dataset = data.get("eval_dataset");
      if (data.get("label_column") && body.task !== "causal-lm") body.label_column = data.get("label_column");
      if (data.get("model_config")) body.model_config = JSON.parse(data.get("model_config"));
      const job = await api("/jobs", { method: "POST", body });
      location.hash = `#/jobs/${job.id}`;
    } catch (err) {
      error.replaceChildren(errorBox(err));
    }
  } },
  field("task", task),
  field("base model", h("input", { name: "base_model", placeholder: "minilm-l6" })),
  field("train dataset", datasets),
  field("eval dataset", evalSets),
  field("text column", h("input", { name: "text_column", value: "sentence" })),
  field("label column", h("input", { name: "label_column", value: "label" })),
  h("label.wide", {}, "hyperparameters (JSON)",
    h("textarea", { name: "hyperparameters", rows: 2 }, '{"epochs": 1, "batch_size": 16, "eval_steps": 20}')),
  h("label.wide", {}, "model_config (JSON, causal-lm from scratch)",
    h("textarea", { name: "model_config", rows: 1, placeholder: '{"n_layer": 4, "n_embd": 128, "n_head": 4}' })),
  h("div.wide.row", {}, h("button", { type: "submit" }, "Start job"), error));
  form.loadDatasets = () => api("/datasets?limit=100", { signal }).then((page) => {
    datasets.replaceChildren(...page.data.map((d) => h("option", { value: d.id }, `${d.name} (${d.id})`)));
    evalSets.replaceChildren(h("option", { value: "" }, "none"),
      ...page.data.map((d) => h("option", { value: d.id }, `${d.name} (${d.id})`)));
  }).catch((e) => error.replaceChildren(errorBox(e)));
  return form;
}
