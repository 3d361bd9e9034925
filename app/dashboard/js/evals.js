// Evals: each eval's runs with pass rates, one run's items (answer and every grade), two runs side by side,
// and model aliases with their targets, lineage and history.
import { api } from "./api.js";
import { badge, h, num, table } from "./dom.js";

const rate = (run) => (run.result_counts.total ? run.result_counts.passed / run.result_counts.total : 0);
const pct = (value) => `${Math.round(value * 100)}%`;
const short = (value, length = 80) => {
  const text = typeof value === "string" ? value : JSON.stringify(value);
  return text.length > length ? `${text.slice(0, length - 1)}…` : text;
};

async function allItems(evalId, runId, signal) {
  const items = [];
  let after = "";
  for (;;) {
    const page = await api(`/v1/evals/${evalId}/runs/${runId}/output_items?limit=100${after}`, { signal });
    items.push(...page.data);
    if (!page.has_more) return items;
    after = `&after=${page.last_id}`;
  }
}

export async function renderEvals(root, parts, params, signal) {
  const [evalId, what, runId] = parts;
  if (evalId && what === "runs" && runId) return renderRun(root, evalId, runId, signal);
  if (evalId && what === "compare") return renderRunPair(root, evalId, (params.get("runs") || "").split(","), signal);
  root.append(h("h1", {}, "Evals"));
  const evals = await api("/v1/evals?limit=100", { signal });
  if (!evals.data.length) root.append(h("p.muted", {}, "No evals yet: create one with POST /v1/evals."));
  for (const evaluation of evals.data) {
    const runs = await api(`/v1/evals/${evaluation.id}/runs?limit=100`, { signal });
    const criteria = evaluation.testing_criteria.map((c) => c.name);
    const form = h("form", { onsubmit: (e) => {
      e.preventDefault();
      const chosen = [...form.querySelectorAll("input:checked")].map((i) => i.value);
      location.hash = `#/evals/${evaluation.id}/compare?runs=${chosen.slice(0, 2).join(",")}`;
    } }, table(["", "run", "model", "status", "pass rate", ...criteria], runs.data.map((run) => {
      const byName = Object.fromEntries(run.per_testing_criteria_results.map((r) => [r.testing_criteria, r]));
      return h("tr", { "data-run": run.id },
        h("td", {}, h("input", { type: "checkbox", value: run.id, "aria-label": `compare ${run.name}` })),
        h("td", {}, h("a", { href: `#/evals/${evaluation.id}/runs/${run.id}` }, run.name),
          h("div.muted", {}, run.role ? `${run.role} of ${run.job_id}` : run.id)),
        h("td", {}, run.model), h("td", {}, badge(run.status)),
        h("td.num", {}, `${pct(rate(run))} (${run.result_counts.passed}/${run.result_counts.total})`),
        criteria.map((name) => h("td.num", {}, byName[name] ? `${byName[name].passed} passed` : "")));
    })), h("p", {}, h("button", { type: "submit" }, "Compare two runs")));
    root.append(h("div.card", { "data-eval": evaluation.id }, h("h2", {}, `${evaluation.name} `,
      h("span.muted", {}, evaluation.id)), form));
  }
}

function gradeCells(item, criteria) {
  const byName = Object.fromEntries((item?.results || []).map((r) => [r.name, r]));
  return criteria.map((name) => {
    const result = byName[name];
    if (!result) return h("td", {}, "");
    return h(`td.num.${result.passed ? "pass" : "fail"}`, { title: (result.errors || []).join(", ") },
      `${result.passed ? "✓" : "✗"} ${num(result.score, 3)}`);
  });
}

const answer = (item) => (item?.sample?.error ? `error: ${item.sample.error.message}`
  : item?.sample?.output?.[0]?.content ?? "");

async function renderRun(root, evalId, runId, signal) {
  const [evaluation, run] = await Promise.all([api(`/v1/evals/${evalId}`, { signal }),
    api(`/v1/evals/${evalId}/runs/${runId}`, { signal })]);
  const criteria = evaluation.testing_criteria.map((c) => c.name);
  const items = await allItems(evalId, runId, signal);
  root.append(h("h1", {}, `${evaluation.name}: ${run.name}`),
    h("p", {}, badge(run.status), ` ${run.model} · ${pct(rate(run))} passed (${run.result_counts.passed}/`,
      `${run.result_counts.total}, ${run.result_counts.errored} errored) · batch ${run.batch_id || "—"}`),
    h("div.card", { id: "run-items" }, table(["#", "item", "answer", "status", ...criteria], items.map((item) =>
      h("tr", {}, h("td.num", {}, item.datasource_item_id), h("td", {}, short(item.datasource_item)),
        h("td", {}, answer(item)), h("td", {}, badge(item.status)), gradeCells(item, criteria))))));
}

async function renderRunPair(root, evalId, runIds, signal) {
  const evaluation = await api(`/v1/evals/${evalId}`, { signal });
  const criteria = evaluation.testing_criteria.map((c) => c.name);
  const runs = await Promise.all(runIds.filter(Boolean).map((id) => api(`/v1/evals/${evalId}/runs/${id}`, { signal })));
  root.append(h("h1", {}, `${evaluation.name}: runs side by side`));
  if (runs.length !== 2) {
    root.append(h("p.muted", {}, "Pick two runs on the evals page."));
    return;
  }
  const [a, b] = await Promise.all(runs.map((run) => allItems(evalId, run.id, signal)));
  const byIndex = (items) => new Map(items.map((item) => [item.datasource_item_id, item]));
  const left = byIndex(a);
  const right = byIndex(b);
  const indexes = [...new Set([...left.keys(), ...right.keys()])].sort((x, y) => x - y);
  const head = (run) => `${run.name} (${run.model}): ${pct(rate(run))}`;
  root.append(h("div.card", { id: "run-pair" }, table(
    ["#", "item", head(runs[0]), ...criteria, head(runs[1]), ...criteria],
    indexes.map((index) => h("tr", {}, h("td.num", {}, index),
      h("td", {}, short((left.get(index) || right.get(index)).datasource_item)),
      h("td", {}, answer(left.get(index))), gradeCells(left.get(index), criteria),
      h("td", {}, answer(right.get(index))), gradeCells(right.get(index), criteria))))));
}

export async function renderAliases(root, signal) {
  root.append(h("h1", {}, "Model aliases"));
  const aliases = await api("/aliases", { signal });
  if (!aliases.data.length) root.append(h("p.muted", {}, "No aliases yet: create one with POST /aliases."));
  for (const alias of aliases.data) {
    const history = await api(`/aliases/${encodeURIComponent(alias.name)}/history`, { signal });
    const lineage = alias.lineage.job
      ? [`base ${alias.lineage.base_model}`, alias.lineage.dataset ? `dataset ${alias.lineage.dataset.name}` : null,
        `job ${alias.lineage.job.id}`, `${alias.lineage.checkpoints.length} artifacts`].filter(Boolean).join(" → ")
      : alias.lineage.model;
    root.append(h("div.card", { "data-alias": alias.name },
      h("h2", {}, `${alias.name} → ${alias.target}`),
      h("p.muted", {}, lineage, alias.gate_eval_id ? ` · moves gated by eval ${alias.gate_eval_id}` : ""),
      table(["when", "from", "to", "by", "gate"], history.data.map((move) => h("tr", {},
        h("td.muted", {}, new Date(move.moved_at * 1000).toLocaleString()), h("td", {}, move.from_target || "—"),
        h("td", {}, move.to_target), h("td", {}, move.moved_by),
        h("td", {}, move.gate ? `${pct(move.gate.score)} vs ${pct(move.gate.baseline_score)} on ${move.gate.eval_id}`
          : ""))))));
  }
}
