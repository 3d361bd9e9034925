// The API client: the key kept for this browser tab, JSON calls, and server-sent events read with fetch
// (EventSource cannot send an Authorization header, and keys in the query string are refused by design).
const KEY = "trainserve.apiKey";

export class ApiError extends Error {
  constructor(status, body) {
    super(body?.message || `HTTP ${status}`);
    this.status = status;
    this.body = body || {};
  }
}

export const getKey = () => sessionStorage.getItem(KEY);
export const setKey = (key) => sessionStorage.setItem(KEY, key.trim());
export const forgetKey = () => sessionStorage.removeItem(KEY);

let onUnauthorized = () => {};
export function whenUnauthorized(handler) { onUnauthorized = handler; }

function request(path, { method = "GET", body, headers = {}, signal } = {}) {
  const init = { method, signal, headers: { Authorization: `Bearer ${getKey() || ""}`, ...headers } };
  if (body instanceof FormData) init.body = body;
  else if (body !== undefined) {
    init.body = JSON.stringify(body);
    init.headers["Content-Type"] = "application/json";
  }
  return fetch(path, init);
}

async function failure(response) {
  const body = await response.json().catch(() => null);
  if (response.status === 401) onUnauthorized();
  return new ApiError(response.status, body?.error);
}

export async function api(path, options = {}) {
  const response = await request(path, options);
  if (!response.ok) throw await failure(response);
  return response.status === 204 ? null : response.json();
}

// Yields {id, event, data} for each message of an SSE response; comments (heartbeats) are skipped.
export async function* sse(path, { method = "GET", body, lastEventId, signal } = {}) {
  const headers = lastEventId ? { "Last-Event-ID": lastEventId } : {};
  const response = await request(path, { method, body, headers, signal });
  if (!response.ok) throw await failure(response);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value.replace(/\r\n/g, "\n");
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const message = { id: null, event: "message", data: "" };
      for (const line of block.split("\n")) {
        if (!line || line.startsWith(":")) continue;
        const at = line.indexOf(":");
        const field = at < 0 ? line : line.slice(0, at);
        const text = at < 0 ? "" : line.slice(at + 1).replace(/^ /, "");
        if (field === "data") message.data += (message.data ? "\n" : "") + text;
        else if (field === "id" || field === "event") message[field] = text;
      }
      if (message.data) yield message;
    }
  }
}

// Follows a job's event stream until the job ends or `signal` aborts; reconnects with Last-Event-ID.
export async function followJob(jobId, sinceStep, handlers, signal) {
  let lastEventId = null;
  while (!signal.aborted) {
    try {
      const query = `stream=true&since_step=${sinceStep}`;
      for await (const m of sse(`/jobs/${jobId}/events?${query}`, { lastEventId, signal })) {
        if (m.id) lastEventId = m.id;
        const data = JSON.parse(m.data);
        handlers[m.event]?.(data);
        if (m.event === "end") return;
      }
    } catch (error) {
      if (signal.aborted) return;
      if (error instanceof ApiError && error.status !== 429) throw error;
    }
    await sleep(2000, signal);
  }
}

export function sleep(ms, signal) {
  return new Promise((resolve) => {
    const timer = setTimeout(resolve, ms);
    signal?.addEventListener("abort", () => { clearTimeout(timer); resolve(); }, { once: true });
  });
}

// Downloads an authenticated URL (an artifact) through a blob, since a plain link cannot carry the key.
export async function download(path, filename) {
  const response = await request(path);
  if (!response.ok) throw await failure(response);
  const url = URL.createObjectURL(await response.blob());
  const link = Object.assign(document.createElement("a"), { href: url, download: filename });
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10000);
}
