// Playground: stream a completion from /generate, token by token, for any model this key can use.
import { api, sse } from "./api.js";
import { errorBox, h } from "./dom.js";

export async function renderPlayground(root, signal) {
  const models = await api("/v1/models", { signal });
  const output = h("pre.output", { id: "completion", "aria-live": "polite" });
  const stats = h("span.muted", { id: "completion-stats" });
  const error = h("div");
  let running = null;
  const input = (name, value, attrs = {}) => h("label", {}, name,
    h("input", { name, value, type: "number", step: "any", ...attrs }));
  const form = h("form.card.grid", { id: "playground", onsubmit: async (e) => {
    e.preventDefault();
    const data = new FormData(form);
    const body = { model: data.get("model"), prompt: data.get("prompt"), stream: true,
      max_new_tokens: Number(data.get("max_new_tokens")), temperature: Number(data.get("temperature")),
      top_k: Number(data.get("top_k")) || 0 };
    running?.abort();
    running = new AbortController();
    signal.addEventListener("abort", () => running?.abort(), { once: true });
    output.textContent = data.get("prompt");
    error.replaceChildren();
    const started = performance.now();
    let tokens = 0;
    let first = null;
    try {
      for await (const m of sse("/generate", { method: "POST", body, signal: running.signal })) {
        if (m.data === "[DONE]") break;
        const payload = JSON.parse(m.data);
        if (m.event === "error") throw new Error(`${payload.error?.code}: ${payload.error?.message}`);
        if (payload.choices) {
          stats.textContent = `${payload.usage?.completion_tokens ?? tokens} tokens, finish: ${payload.choices[0].finish_reason}, `
            + `first token ${((first - started) / 1000).toFixed(2)} s, total ${((performance.now() - started) / 1000).toFixed(2)} s`;
          form.dataset.done = "true";
        } else {
          first ??= performance.now();
          tokens += 1;
          output.append(payload.text);
        }
      }
    } catch (err) {
      if (!running.signal.aborted) error.replaceChildren(errorBox(err));
    }
  } },
  h("label", {}, "model", h("select", { name: "model", required: true, id: "model" },
    models.data.map((m) => h("option", { value: m.id }, `${m.id} (${m.owned_by})`)))),
  input("max_new_tokens", 64, { min: 1, step: 1 }), input("temperature", 0.8, { min: 0 }),
  input("top_k", 40, { min: 0, step: 1 }),
  h("label.wide", {}, "prompt", h("textarea", { name: "prompt", rows: 3, required: true }, "ROMEO:")),
  h("div.wide.row", {}, h("button", { type: "submit" }, "Generate"),
    h("button.secondary", { type: "button", onclick: () => running?.abort() }, "Stop"), stats));
  root.append(h("h1", {}, "Playground"), models.data.length ? form
    : h("p.muted", {}, "No servable model yet: a succeeded causal-lm job, or a model folder under var/models/."),
  error, output);
}
