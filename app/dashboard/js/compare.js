// Compare: pick jobs, overlay their curves (one colour per job), and a table of the settings that differ.
import { api } from "./api.js";
import { MetricChart, PALETTE, chartControls } from "./charts.js";
import { badge, h, jobSettings, num, table } from "./dom.js";
import { MAX_POINTS, PANELS } from "./job.js";

export async function renderCompare(root, params, signal) {
  const ids = (params.get("ids") || "").split(",").filter(Boolean);
  const recent = await api("/jobs?limit=100", { signal });
  const picker = h("form.card", { id: "compare-picker", onsubmit: (e) => {
    e.preventDefault();
    const chosen = [...picker.querySelectorAll("input:checked")].map((i) => i.value);
    location.hash = `#/compare?ids=${chosen.join(",")}`;
  } }, h("div.row", {}, recent.data.map((job) => h("label", {}, h("input", { type: "checkbox", value: job.id,
    checked: ids.includes(job.id) }), " ", job.id, " ", badge(job.status)))),
  h("p", {}, h("button", { type: "submit" }, "Compare")));
  root.append(h("h1", {}, "Compare jobs"), picker);
  if (ids.length < 1) return;

  const jobs = await Promise.all(ids.map((id) => api(`/jobs/${id}`, { signal })));
  const color = new Map(jobs.map((j, i) => [j.id, PALETTE[i % PALETTE.length]]));
  const controls = chartControls((state) => charts.forEach((c) => c.setOptions(state)));
  const grid = h("div.charts", { id: "compare-charts" });
  const charts = PANELS.flatMap(([, names]) => names).map((name) => new MetricChart(grid, name,
    jobs.map((j) => ({ key: `${j.id}:${name}`, label: j.id.slice(-8), color: color.get(j.id) })), controls.state));

  const rows = jobs.map(jobSettings);
  const keys = [...new Set(rows.flatMap((r) => Object.keys(r)))];
  const same = (key) => rows.every((r) => JSON.stringify(r[key]) === JSON.stringify(rows[0][key]));
  const showAll = h("input", { type: "checkbox", id: "show-all-settings", onchange: () => drawTable() });
  const tableBox = h("div");
  const drawTable = () => tableBox.replaceChildren(table(["setting", ...jobs.map((j) => h("span", {
    style: `color:${color.get(j.id)}` }, j.id))], [
    h("tr", {}, h("td", {}, "status"), jobs.map((j) => h("td", {}, badge(j.status)))),
    ...Object.keys(jobs.reduce((m, j) => ({ ...m, ...j.best_metrics }), {})).map((name) => h("tr", {},
      h("td", {}, `best ${name}`), jobs.map((j) => h("td.num", {}, num(j.best_metrics[name]))))),
    ...keys.filter((k) => showAll.checked || !same(k)).map((k) => h("tr", { "data-setting": k }, h("td", {}, k),
      rows.map((r) => h("td", {}, r[k] === undefined || r[k] === null ? "—" : String(r[k]))))),
  ]));
  drawTable();
  root.append(h("div.card", { id: "compare-settings" }, h("div.row", {}, h("h2.grow", {}, "Settings that differ"),
    h("label", {}, showAll, " show all")), tableBox), controls.el, grid);

  await Promise.all(jobs.map(async (job) => {
    const origin = Date.parse(job.started_at || job.created_at);
    const history = await api(`/jobs/${job.id}/metrics?max_points=${MAX_POINTS}`, { signal });
    const points = history.data.map((p) => ({ key: `${job.id}:${p.name}`, step: p.step,
      time: (Date.parse(p.created_at) - origin) / 1000, value: p.value }));
    charts.forEach((c) => c.add(points));
  }));
  // Panels for metrics none of the jobs has are dropped once the histories are in.
  setTimeout(() => charts.forEach((c) => { if (c.el.dataset.points === "0") c.el.remove(); }), 400);
}
