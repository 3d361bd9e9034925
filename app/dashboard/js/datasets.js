// Datasets: upload, list, and one dataset's first rows with its column summary.
import { api } from "./api.js";
import { errorBox, h, table } from "./dom.js";

export async function renderDatasets(root, datasetId, signal) {
  const error = h("div");
  const form = h("form.card.row", { id: "upload", onsubmit: async (e) => {
    e.preventDefault();
    const button = form.querySelector("button");
    button.disabled = true;
    try {
      const dataset = await api("/datasets", { method: "POST", body: new FormData(form) });
      location.hash = `#/datasets/${dataset.id}`;
    } catch (err) {
      error.replaceChildren(errorBox(err));
    } finally {
      button.disabled = false;
    }
  } }, h("input", { type: "file", name: "file", required: true, accept: ".csv,.tsv,.jsonl,.ndjson,.txt",
    "aria-label": "dataset file" }),
  h("input", { name: "name", placeholder: "name (optional)", "aria-label": "dataset name" }),
  h("button", { type: "submit" }, "Upload"));
  const detail = h("div", { id: "dataset-detail" });
  const list = h("tbody");
  root.append(h("h1", {}, "Datasets"), form, error, detail, h("div.card", {}, table(
    ["dataset", "rows", "columns", h("th.hide-narrow", {}, "size"), h("th.hide-narrow", {}, "created")], list)));
  const page = await api("/datasets?limit=100", { signal });
  list.replaceChildren(...page.data.map((d) => h("tr", {},
    h("td", {}, h("a", { href: `#/datasets/${d.id}` }, d.name), h("div.muted", {}, d.id)),
    h("td.num", {}, d.rows), h("td", {}, d.columns.join(", ")),
    h("td.num.hide-narrow", {}, `${(d.size_bytes / 1024).toFixed(1)} KiB`),
    h("td.muted.hide-narrow", {}, new Date(d.created_at).toLocaleString()))));
  if (datasetId) await showDataset(detail, datasetId, signal);
}

async function showDataset(box, datasetId, signal) {
  const [dataset, preview] = await Promise.all([api(`/datasets/${datasetId}`, { signal }),
    api(`/datasets/${datasetId}/preview?rows=20`, { signal })]);
  const cell = (v) => (v === null || v === undefined ? "" : String(v));
  const summary = dataset.columns.map((c) => {
    const stats = dataset.column_stats[c] || {};
    const values = stats.values ? Object.entries(stats.values).sort((a, b) => b[1] - a[1]) : null;
    return h("tr", {}, h("td", {}, c), h("td.num", {}, stats.empty ?? ""),
      h("td", {}, values ? `${values.length} distinct: ${values.slice(0, 8).map(([v, n]) => `${v} (${n})`).join(", ")}`
        : h("span.muted", {}, "free text (too many distinct values for a label)")));
  });
  box.replaceChildren(h("div.card", {},
    h("h2", {}, `${dataset.name} `, h("span.muted", {}, `${dataset.id} · ${dataset.format} · ${dataset.rows} rows`)),
    h("h2", {}, "Columns"), h("div", { id: "column-summary" }, table(["column", "empty", "values"], summary)),
    h("h2", {}, `First ${preview.rows.length} rows`),
    h("div", { id: "preview" }, table(preview.columns, preview.rows.map((r) => h("tr", {},
      preview.columns.map((c) => h("td", {}, cell(r[c])))))))));
}
