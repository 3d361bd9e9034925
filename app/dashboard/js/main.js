// Hash router and the API-key prompt; each page renders into #view and stops its streams on abort.
import { api, forgetKey, getKey, setKey, whenUnauthorized } from "./api.js";
import { renderCompare } from "./compare.js";
import { renderDatasets } from "./datasets.js";
import { errorBox } from "./dom.js";
import { renderAliases, renderEvals } from "./evals.js";
import { renderJob } from "./job.js";
import { renderJobs } from "./jobs.js";
import { renderPlayground } from "./playground.js";

const view = document.getElementById("view");
const login = document.getElementById("login");
let current = null;

function route() {
  const [path, query = ""] = location.hash.replace(/^#/, "").split("?");
  const parts = path.split("/").filter(Boolean);
  const params = new URLSearchParams(query);
  if (parts[0] === "jobs" && parts[1]) return ["jobs", (root, s) => renderJob(root, parts[1], s)];
  if (parts[0] === "compare") return ["compare", (root, s) => renderCompare(root, params, s)];
  if (parts[0] === "datasets") return ["datasets", (root, s) => renderDatasets(root, parts[1], s)];
  if (parts[0] === "playground") return ["playground", (root, s) => renderPlayground(root, s)];
  if (parts[0] === "evals") return ["evals", (root, s) => renderEvals(root, parts.slice(1), params, s)];
  if (parts[0] === "aliases") return ["aliases", (root, s) => renderAliases(root, s)];
  return ["jobs", (root, s) => renderJobs(root, params, s)];
}

async function show() {
  current?.abort();
  if (!getKey()) return askKey();
  current = new AbortController();
  const [name, render] = route();
  document.querySelectorAll("[data-nav]").forEach((a) => a.classList.toggle("active", a.dataset.nav === name));
  view.replaceChildren();
  try {
    await render(view, current.signal);
  } catch (error) {
    if (!current.signal.aborted) view.append(errorBox(error));
  }
}

function askKey(message = "") {
  document.getElementById("login-error").textContent = message;
  if (!login.open) login.showModal();
}

document.getElementById("login-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  setKey(document.getElementById("login-key").value);
  try {
    await api("/jobs?limit=1");
    login.close();
    show();
  } catch (error) {
    forgetKey();
    askKey(error.status === 401 ? "That key was not accepted." : String(error.message));
  }
});
document.getElementById("logout").addEventListener("click", () => { forgetKey(); current?.abort(); askKey(); });
whenUnauthorized(() => { forgetKey(); current?.abort(); askKey("The key was refused; enter another."); });
window.addEventListener("hashchange", show);
show();
