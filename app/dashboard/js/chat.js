// Chat mode of the playground: a message list sent to /v1/chat/completions (OpenAI's format, streamed), each
// streamed piece of the reply showing its token's logprob and the top alternatives on hover or focus, an
// optional JSON schema sent as response_format, optional tools (their calls shown as they stream) and a reasoning
// model's thinking shown apart from the reply.
import { sse } from "./api.js";
import { errorBox, h } from "./dom.js";

// The request body for the conversation so far; `schemaText` (a JSON schema) becomes response_format,
// `toolsText` (a JSON list of OpenAI function tools) the tools.
export function chatRequest({ model, messages, maxTokens, temperature, logprobs, topLogprobs, schemaText,
  toolsText = "" }) {
  const body = { model, messages, stream: true, stream_options: { include_usage: true }, max_tokens: maxTokens,
    temperature };
  if (logprobs) Object.assign(body, { logprobs: true, top_logprobs: topLogprobs });
  if (toolsText.trim()) {
    try {
      body.tools = JSON.parse(toolsText);
    } catch (error) {
      throw new Error(`tools: not valid JSON (${error.message})`);
    }
  }
  if (schemaText.trim()) {
    let schema;
    try {
      schema = JSON.parse(schemaText);
    } catch (error) {
      throw new Error(`JSON schema: not valid JSON (${error.message})`);
    }
    body.response_format = { type: "json_schema", json_schema: { name: "response", schema, strict: true } };
  }
  return body;
}

const percent = (logprob) => `${(Math.exp(logprob) * 100).toPrecision(3)}%`;
const shown = (token) => JSON.stringify(token);  // quotes make leading spaces and newlines visible

// One streamed piece of the reply: its text, and the logprobs of the tokens it came from in data attributes.
function piece(text, entries) {
  if (!entries?.length) return document.createTextNode(text);
  const lowest = Math.min(...entries.map((e) => e.logprob));
  const level = lowest < Math.log(0.1) ? "low" : lowest < Math.log(0.5) ? "mid" : "high";
  const span = h(`span.tok.p-${level}`, { tabindex: 0, "data-logprob": lowest.toFixed(4) }, text);
  span.logprobs = entries;
  return span;
}

// The hover box: for each token of the piece, its probability and the alternatives the model weighed.
function tipContent(entries) {
  return entries.map((e) => h("table", {}, h("tbody", {},
    h("tr.chosen", {}, h("td", {}, shown(e.token)), h("td.num", {}, e.logprob.toFixed(3)), h("td.num", {}, percent(e.logprob))),
    (e.top_logprobs || []).filter((t) => t.token !== e.token).map((t) => h("tr", {}, h("td", {}, shown(t.token)),
      h("td.num", {}, t.logprob.toFixed(3)), h("td.num", {}, percent(t.logprob)))))));
}

function hoverTips(list) {
  const tip = h("div.logprob-tip", { id: "logprob-tip", role: "tooltip", hidden: true });
  const show = (e) => {
    const span = e.target.closest?.(".tok");
    if (!span?.logprobs) return;
    tip.replaceChildren(...tipContent(span.logprobs));
    const box = span.getBoundingClientRect();
    tip.hidden = false;
    const left = Math.min(box.left + window.scrollX, window.scrollX + document.documentElement.clientWidth - tip.offsetWidth - 8);
    tip.style.left = `${Math.max(window.scrollX + 4, left)}px`;
    tip.style.top = `${box.bottom + window.scrollY + 4}px`;
  };
  const hide = () => { tip.hidden = true; };
  list.addEventListener("mouseover", show);
  list.addEventListener("focusin", show);
  list.addEventListener("mouseout", hide);
  list.addEventListener("focusout", hide);
  return tip;
}

// Renders the chat panel; `model()` names the chosen model, `noChat(model, error)` is told when the server
// answers that a model has no chat template (or there is no chat route), so the page can fall back.
export function chatPanel(model, noChat, signal) {
  const messages = [];
  const list = h("div.messages", { id: "chat-messages", "aria-live": "polite" });
  const stats = h("span.muted", { id: "chat-stats" });
  const error = h("div");
  let running = null;
  const number = (name, value, attrs) => h("label", {}, name, h("input", { name, value, type: "number", ...attrs }));
  const bubble = (role, ...content) => h(`div.msg.${role}`, { "data-role": role }, h("div.role", {}, role),
    h("div.text", {}, content));
  const redraw = () => list.replaceChildren(...messages.map((m) => m.el || bubble(m.role, m.content)));
  const form = h("form.card.grid", { id: "chat", onsubmit: (e) => { e.preventDefault(); send(); } },
    h("label.wide", {}, "system prompt (optional)", h("textarea", { name: "system", rows: 1 })),
    number("max_tokens", 64, { min: 1, step: 1 }), number("temperature", 0.8, { min: 0, max: 2, step: "any" }),
    h("label.check", {}, h("span", {}, h("input", { type: "checkbox", name: "logprobs", checked: true }), " logprobs")),
    number("top_logprobs", 5, { min: 0, max: 20, step: 1 }),
    h("label.wide", {}, "JSON schema for the reply (optional: sent as response_format)",
      h("textarea", { name: "schema", rows: 2, placeholder: '{"type": "object", "properties": {...}}' })),
    h("label.wide", {}, "tools (optional: a JSON list of function tools; calls always match their parameters)",
      h("textarea", { name: "tools", rows: 2,
        placeholder: '[{"type": "function", "function": {"name": "...", "parameters": {...}}}]' })),
    h("label.wide", {}, "message", h("textarea", { name: "message", rows: 2, required: true })),
    h("div.wide.row", {}, h("button", { type: "submit" }, "Send"),
      h("button.secondary", { type: "button", onclick: () => running?.abort() }, "Stop"),
      h("button.secondary", { type: "button", id: "chat-clear", onclick: () => {
        running?.abort(); messages.length = 0; redraw(); stats.textContent = ""; } }, "Clear"), stats));

  async function send() {
    const data = new FormData(form);
    const system = String(data.get("system") || "").trim();
    const user = { role: "user", content: String(data.get("message")) };
    let body;
    try {
      body = chatRequest({ model: model(), maxTokens: Number(data.get("max_tokens")),
        temperature: Number(data.get("temperature")), logprobs: data.get("logprobs") === "on",
        topLogprobs: Number(data.get("top_logprobs")), schemaText: String(data.get("schema") || ""),
        toolsText: String(data.get("tools") || ""),
        messages: [...(system ? [{ role: "system", content: system }] : []),
          ...messages.map(({ role, content, tool_calls: calls }) => (calls?.length
            ? { role, content: content || null, tool_calls: calls } : { role, content })), user] });
    } catch (err) {
      error.replaceChildren(errorBox(err));
      return;
    }
    running?.abort();
    running = new AbortController();
    signal.addEventListener("abort", () => running?.abort(), { once: true });
    error.replaceChildren();
    delete form.dataset.done;
    form.elements.message.value = "";
    const text = h("div.text");
    const thinking = h("details.reasoning", { hidden: true, open: true }, h("summary", {}, "reasoning"),
      h("div.thinking"));
    const calls = h("pre.tool-calls", { hidden: true });
    const reply = { role: "assistant", content: "", tool_calls: [], el: h("div.msg.assistant",
      { "data-role": "assistant" }, h("div.role", {}, "assistant"), thinking, text, calls) };
    messages.push(user, reply);
    redraw();
    const started = performance.now();
    try {
      await stream(body, running.signal, (content, entries) => {
        reply.content += content;
        text.append(piece(content, entries));
      }, (delta) => {
        if (delta.reasoning_content) {
          thinking.hidden = false;
          thinking.lastChild.append(delta.reasoning_content);
        }
        for (const part of delta.tool_calls || []) {  // OpenAI's streamed calls: the first piece names the call
          const call = reply.tool_calls[part.index] ||= { id: part.id, type: "function",
            function: { name: "", arguments: "" } };
          call.function.name += part.function?.name || "";
          call.function.arguments += part.function?.arguments || "";
        }
        if (delta.tool_calls) {
          calls.hidden = false;
          calls.textContent = reply.tool_calls.map((c) => `${c.function.name}(${c.function.arguments})`).join("\n");
        }
      }, (usage, finish) => {
        stats.textContent = `${usage?.completion_tokens ?? "?"} tokens, finish: ${finish}, `
          + `${((performance.now() - started) / 1000).toFixed(2)} s`;
      });
      form.dataset.done = "true";
    } catch (err) {
      if (running.signal.aborted) return;
      messages.splice(messages.length - 2, 2);  // the turn failed: the message goes back into the box
      form.elements.message.value = user.content;
      redraw();
      const unusable = err.status === 404 || err.status === 405 || (err.status === 422 && err.body?.field === "model");
      if (unusable) noChat(body.model, err);
      else error.replaceChildren(errorBox(err));
    }
  }
  return h("div", { id: "chat-panel" }, form, error, list, hoverTips(list));
}

// Reads the chat completion stream: `onPiece(text, logprobEntries)` per content delta, `onDelta(delta)` per delta
// with reasoning or tool calls, `onEnd(usage, finishReason)`.
async function stream(body, signal, onPiece, onDelta, onEnd) {
  let finish = null;
  let usage = null;
  for await (const m of sse("/v1/chat/completions", { method: "POST", body, signal })) {
    if (m.data === "[DONE]") break;
    const payload = JSON.parse(m.data);
    if (m.event === "error" || payload.error) {
      throw Object.assign(new Error(`${payload.error?.code}: ${payload.error?.message}`), { body: payload.error });
    }
    if (payload.usage) usage = payload.usage;
    const choice = payload.choices?.[0];
    if (!choice) continue;
    if (choice.delta?.content) onPiece(choice.delta.content, choice.logprobs?.content);
    if (choice.delta?.reasoning_content || choice.delta?.tool_calls) onDelta(choice.delta);
    finish = choice.finish_reason ?? finish;
  }
  onEnd(usage, finish);
}
