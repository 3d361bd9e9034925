// Jobs list: live, filtered by status, with a compare selection, and the new-job form (newjob.js) above it.
import { api, sleep } from "./api.js";
import { badge, bestMetric, duration, errorBox, h, modelName, progressBar, table } from "./dom.js";
import { newJobForm } from "./newjob.js";

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
      if (!form.hidden) form.load();
    } }, "New job")));
  const form = newJobForm(signal);
  form.hidden = true;
  root.append(form, error, h("div.card", {}, table(
    ["", "job", "status", "progress", "ETA", "model", "best", h("th.hide-narrow", {}, "created")], body)));

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
