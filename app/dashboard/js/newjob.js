// The form that starts a job, built from POST /jobs's request schema in /openapi.json: the typed job spec's
// fields, bounds and defaults (a free-form hyperparameters object is a JSON box). Datasets are picked from a list.
import { api } from "./api.js";
import { errorBox, h } from "./dom.js";
import { bodyField } from "./schema.js";

let specDoc = null;

// The OpenAPI document and POST /jobs's body schema in it (public, like /docs; fetched once per page load).
export async function jobSchema() {
  if (!specDoc) {
    const response = await fetch("/openapi.json");
    if (!response.ok) throw new Error(`/openapi.json: HTTP ${response.status}`);
    specDoc = await response.json();
  }
  const schema = specDoc.paths?.["/jobs"]?.post?.requestBody?.content?.["application/json"]?.schema;
  if (!schema) throw new Error("/openapi.json describes no body for POST /jobs");
  return { doc: specDoc, schema };
}

export function newJobForm(signal) {
  const error = h("div");
  const fieldsBox = h("div.grid-contents");
  let body = null;
  let datasets = [];
  const columns = h("datalist", { id: "dataset-columns" });
  const widgets = {
    train_dataset: (f) => datasetField(f, false),
    eval_dataset: (f) => datasetField(f, true),
    text_column: (f) => columnField(f),
    label_column: (f) => columnField(f),
  };
  function datasetField({ path, required, label }, optional) {
    const select = h("select", { name: path, required, onchange: () => pickColumns(select.value) });
    select.optional = optional || !required;
    fill(select);
    return { el: h("label", {}, label, select), value: () => select.value || undefined };
  }
  function columnField({ path, schema, required, label }) {
    const input = h("input", { name: path, required, list: "dataset-columns", value: schema.default ?? "",
      maxLength: schema.maxLength });
    return { el: h("label", {}, label, input),
      value: () => (input.value === "" || input.value === schema.default ? undefined : input.value) };
  }
  function fill(select) {
    const keep = select.value;
    select.replaceChildren(...(select.optional ? [h("option", { value: "" }, "none")] : []),
      ...datasets.map((d) => h("option", { value: d.id }, `${d.name} (${d.id})`)));
    if (keep) select.value = keep;
  }
  // The chosen training set's columns are offered for the column fields; a text column it lacks is replaced.
  function pickColumns(datasetId) {
    const chosen = datasets.find((d) => d.id === datasetId);
    if (!chosen || select("train_dataset")?.value !== datasetId) return;
    columns.replaceChildren(...chosen.columns.map((c) => h("option", { value: c })));
    const text = form.querySelector("[name=text_column]");
    if (text && !chosen.columns.includes(text.value)) text.value = chosen.columns[0];
  }
  const select = (name) => form.querySelector(`select[name=${name}]`);
  const form = h("form.card.grid", { id: "new-job", onsubmit: async (e) => {
    e.preventDefault();
    error.replaceChildren();
    try {
      const job = await api("/jobs", { method: "POST", body: body.value() });
      location.hash = `#/jobs/${job.id}`;
    } catch (err) {
      error.replaceChildren(errorBox(err));
    }
  } }, fieldsBox, columns, h("div.wide.row", {}, h("button", { type: "submit" }, "Start job"), error));

  form.load = async () => {
    try {
      if (!body) {
        const { doc, schema } = await jobSchema();
        body = bodyField(doc, schema, widgets);
        fieldsBox.replaceChildren(...[body.el].flat());
        // A change of kind re-renders the fields: new dataset pickers are filled from the list already loaded.
        fieldsBox.addEventListener("change", (e) => {
          if (!e.target.dataset.union) return;
          refill();
          pickColumns(select("train_dataset")?.value);
        });
      }
      datasets = (await api("/datasets?limit=100", { signal })).data;
      refill();
      pickColumns(select("train_dataset")?.value);
      form.dataset.ready = "true";
    } catch (err) {
      error.replaceChildren(errorBox(err));
    }
  };
  const refill = () => form.querySelectorAll("select[name$=_dataset]").forEach(fill);
  return form;
}
