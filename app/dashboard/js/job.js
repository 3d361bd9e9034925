// One job: live status, charts fed by the downsampled history then the event stream, events, settings,
// artifacts and cancel.
import { api, download, followJob } from "./api.js";
import { MetricChart, PALETTE, chartControls } from "./charts.js";
import { badge, duration, errorBox, h, jobSettings, modelName, num, progressBar, table } from "./dom.js";

export const PANELS = [
  ["Loss", ["train_loss", "eval_loss"]],
  ["Evaluation", ["eval_accuracy", "eval_f1", "perplexity"]],
  ["Learning rate", ["learning_rate"]],
  ["Throughput", ["samples_per_second", "tokens_per_second"]],
];
// A reinforcement job's steps also report rewards, KL to the base, clipping and completion length.
export const REINFORCEMENT_PANELS = [
  ["Reward", ["reward_mean", "reward_std", "eval_reward"]],
  ["Policy", ["kl", "clip_fraction"]],
  ["Completions", ["completion_length"]],
];
export const MAX_POINTS = 2000;  // per metric: the server keeps each bucket's min and max beyond this

const seconds = (iso, origin) => (Date.parse(iso) - origin) / 1000;

export async function renderJob(root, jobId, signal) {
  let job = await api(`/jobs/${jobId}`, { signal });
  const origin = Date.parse(job.started_at || job.created_at);
  const header = h("div.card");
  const error = h("div");
  const controls = chartControls((state) => charts.forEach((c) => c.setOptions(state)));
  const grid = h("div.charts");
  const panels = job.method?.method === "reinforcement" ? [...REINFORCEMENT_PANELS, ...PANELS] : PANELS;
  const charts = panels.map(([title, names]) => new MetricChart(grid, title,
    names.map((name, i) => ({ key: name, label: name, color: PALETTE[i] })), controls.state));
  const eventsBox = h("div.events.card", { id: "events" });
  const settingsBox = h("div");
  const artifactsBox = h("div");
  root.append(h("h1", {}, job.id), header, error, controls.el, grid,
    h("h2", {}, "Events"), eventsBox, h("div.charts", {}, h("div", {}, h("h2", {}, "Settings"), settingsBox),
      h("div", {}, h("h2", {}, "Artifacts"), artifactsBox)));

  const events = [];
  // A resumed attempt starts at its checkpoint's step: the boundary is drawn there, the curve is not repeated.
  const markers = () => events.filter((e) => e.kind === "started" && e.data?.resumed_from_step).map((e) => ({
    step: e.data.resumed_from_step, time: seconds(e.created_at, origin), label: `resumed @${e.data.resumed_from_step}`,
  }));
  const addPoints = (points) => {
    const mapped = points.map((p) => ({ key: p.name, step: p.step, time: seconds(p.created_at, origin),
      value: p.value }));
    charts.forEach((c) => c.add(mapped));
  };
  const addEvent = (e) => {
    events.push(e);
    eventsBox.append(h(`div.${e.level}`, { "data-kind": e.kind },
      `${new Date(e.created_at).toLocaleTimeString()}  ${e.kind.padEnd(16)} ${e.message}`));
    eventsBox.scrollTop = eventsBox.scrollHeight;
    charts.forEach((c) => c.setMarkers(markers()));
  };

  const renderHeader = () => {
    const cancel = h("button.danger", { id: "cancel", onclick: async () => {
      cancel.disabled = true;
      try { job = await api(`/jobs/${jobId}/cancel`, { method: "POST" }); renderHeader(); }
      catch (e) { error.replaceChildren(errorBox(e)); cancel.disabled = false; }
    } }, "Cancel");
    header.replaceChildren(h("div.row", {},
      h("span", { id: "job-status" }, badge(job.status)), progressBar(job.progress.fraction),
      h("span", {}, `step ${job.progress.step}/${job.progress.total_steps ?? "?"}, epoch ${num(job.progress.epoch, 3)}`),
      job.eta_seconds ? h("span", {}, `ETA ${duration(job.eta_seconds)}`) : null,
      h("span.muted", {}, `${job.task} · ${modelName(job)} · ${job.device || "no device yet"} · attempt ${job.attempts}`),
      h("span.grow"), ["queued", "running"].includes(job.status) && !job.cancel_requested ? cancel : null,
      job.cancel_requested && !["cancelled", "failed", "succeeded"].includes(job.status)
        ? h("span.muted", {}, "cancel requested") : null),
    ...(job.error ? [h("p.error", {}, `${job.error.code}: ${job.error.message}`)] : []),
    h("div.row.muted", {}, Object.entries(job.metrics || {}).map(([k, v]) => h("span", {}, `${k} ${num(v)}`))));
  };
  const renderDetails = () => {
    const settings = { ...jobSettings(job), labels: job.labels?.length ? job.labels.join(", ") : null };
    settingsBox.replaceChildren(h("div.card.kv", { id: "settings" }, table(["setting", "value"],
      Object.entries(settings).filter(([, v]) => v !== null && v !== undefined)
        .map(([k, v]) => h("tr", {}, h("td", {}, k), h("td", {}, typeof v === "object" ? JSON.stringify(v) : String(v)))))));
    artifactsBox.replaceChildren(h("div.card", { id: "artifacts" }, job.artifacts.length ? table(["kind", "step", "size", ""],
      job.artifacts.map((a) => h("tr", {}, h("td", {}, a.kind), h("td", {}, a.step ?? ""),
        h("td", {}, `${(a.size_bytes / 1e6).toFixed(1)} MB`),
        h("td", {}, h("button.secondary", { onclick: () => download(a.download_url, `${job.id}-${a.id}.tar`)
          .catch((e) => error.replaceChildren(errorBox(e))) }, "Download")))))
      : h("span.muted", {}, "none yet")));
  };
  renderHeader();
  renderDetails();

  const history = await api(`/jobs/${jobId}/metrics?max_points=${MAX_POINTS}`, { signal });
  addPoints(history.data);
  const lastStep = history.data.reduce((m, p) => Math.max(m, p.step), -1);
  // The stream sends every event and the points after the loaded history: the charts append, never refetch.
  await followJob(jobId, lastStep + 1, {
    job_event: addEvent,
    metrics: (data) => addPoints(data.points),
    state: (state) => {
      const finished = state.status !== job.status && ["succeeded", "failed", "cancelled"].includes(state.status);
      job = { ...job, status: state.status, eta_seconds: state.eta_seconds, metrics: state.metrics,
        error: state.error, attempts: state.attempts, device: state.device,
        progress: { ...job.progress, step: state.step, total_steps: state.total_steps, epoch: state.epoch,
          fraction: state.status === "succeeded" ? 1 : state.total_steps ? Math.min(state.step / state.total_steps, 1) : 0 } };
      renderHeader();
      if (finished) api(`/jobs/${jobId}`, { signal }).then((j) => { job = j; renderHeader(); renderDetails(); });
    },
  }, signal);
}
