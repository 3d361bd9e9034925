// Playground: stream a completion from /generate, token by token, for any model this key can use, or chat
// with a model that has a chat template (chat.js).
import { api, sse } from "./api.js";
import { chatPanel } from "./chat.js";
import { errorBox, h } from "./dom.js";

export async function renderPlayground(root, signal) {
  const models = await api("/v1/models", { signal });
  if (!models.data.length) {
    root.append(h("h1", {}, "Playground"),
      h("p.muted", {}, "No servable model yet: a succeeded causal-lm job, or a model folder under var/models/."));
    return;
  }
  const picker = h("select", { name: "model", required: true, id: "model", "aria-label": "model" },
    models.data.map((m) => h("option", { value: m.id }, `${m.id} (${m.owned_by})`)));
  const output = h("pre.output", { id: "completion", "aria-live": "polite" });
  const stats = h("span.muted", { id: "completion-stats" });
  const error = h("div");
  let running = null;
  const input = (name, value, attrs = {}) => h("label", {}, name,
    h("input", { name, value, type: "number", step: "any", ...attrs }));
  const form = h("form.card.grid", { id: "playground", onsubmit: async (e) => {
    e.preventDefault();
    const data = new FormData(form);
    const body = { model: picker.value, prompt: data.get("prompt"), stream: true,
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
  input("max_new_tokens", 64, { min: 1, step: 1 }), input("temperature", 0.8, { min: 0 }),
  input("top_k", 40, { min: 0, step: 1 }),
  h("label.wide", {}, "prompt", h("textarea", { name: "prompt", rows: 3, required: true }, "ROMEO:")),
  h("div.wide.row", {}, h("button", { type: "submit" }, "Generate"),
    h("button.secondary", { type: "button", onclick: () => running?.abort() }, "Stop"), stats));
  const completion = h("div", { id: "completion-panel" }, form, error, output);
  const modes = modeSwitch(models.data, picker, completion, signal);
  root.append(h("div.row", {}, h("h1.grow", {}, "Playground"), h("label", {}, "model ", picker), modes.el),
    modes.note, completion, modes.chat);
}

// Completion or chat. A model card's `chat_template` (when the server sends it) says whether chat is offered;
// without it chat is tried, and a 422 naming the model (no template) or a missing route falls back to completion.
function modeSwitch(models, picker, completion, signal) {
  const noChat = new Set(models.filter((m) => m.chat_template === false).map((m) => m.id));
  const note = h("p.muted", { id: "mode-note" });
  const chat = chatPanel(() => picker.value, (model, error) => {
    if (error.status === 422) noChat.add(model);
    else models.forEach((m) => noChat.add(m.id));  // no chat route on this server
    note.textContent = `${model}: ${error.message} (chat is not available; completion mode instead)`;
    set("completion");
  }, signal);
  const tab = (mode, text) => h("button.secondary", { type: "button", role: "tab", "data-mode": mode,
    onclick: () => { note.textContent = ""; set(mode); } }, text);
  const tabs = [tab("completion", "Completion"), tab("chat", "Chat")];
  function set(mode) {
    const chatOk = !noChat.has(picker.value);
    const chosen = mode === "chat" && chatOk ? "chat" : "completion";
    tabs.forEach((t) => t.setAttribute("aria-selected", String(t.dataset.mode === chosen)));
    tabs[1].disabled = !chatOk;
    tabs[1].title = chatOk ? "" : "this model has no chat template";
    completion.hidden = chosen !== "completion";
    chat.hidden = chosen !== "chat";
  }
  picker.addEventListener("change", () => set(chat.hidden ? "completion" : "chat"));
  set(location.hash.includes("mode=chat") ? "chat" : "completion");
  return { el: h("div.row.tabs", { role: "tablist" }, tabs), note, chat };
}
