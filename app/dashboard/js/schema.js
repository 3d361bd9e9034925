// Form fields built from a JSON Schema, as /openapi.json describes a request body: $ref, nullable anyOf,
// discriminated unions (oneOf + discriminator, or a const tag), objects with properties, enums, booleans,
// numbers and integers with their bounds, strings, and defaults. Anything else (a free-form object, an array)
// is a JSON textarea. Each field is {el, value()}; value() is undefined when the field is left out of the body:
// empty and optional, or unchanged from its default (the server applies the same default).
import { h } from "./dom.js";

// Follows $ref (a JSON pointer into the document) and single-entry allOf; keywords beside them win.
export function resolve(doc, schema) {
  let s = schema || {};
  for (let depth = 0; depth < 32; depth += 1) {
    if (s.$ref) {
      const target = s.$ref.replace(/^#\//, "").split("/").reduce((node, key) => node?.[key.replace(/~1/g, "/")
        .replace(/~0/g, "~")], doc);
      const { $ref, ...rest } = s;
      s = { ...target, ...rest };
    } else if (s.allOf?.length === 1) {
      const { allOf, ...rest } = s;
      s = { ...allOf[0], ...rest };
    } else return s;
  }
  throw new Error(`schema references nest too deep at ${schema.$ref}`);
}

// {schema, optional}: a nullable anyOf/oneOf or type list is the other branch, made optional.
function unwrapNull(doc, schema) {
  const s = resolve(doc, schema);
  const branches = s.anyOf || s.oneOf;
  if (Array.isArray(s.type) && s.type.includes("null")) {
    const rest = s.type.filter((t) => t !== "null");
    return { schema: { ...s, type: rest.length === 1 ? rest[0] : rest }, optional: true };
  }
  if (branches && !s.discriminator) {
    const kept = branches.filter((b) => resolve(doc, b).type !== "null");
    if (kept.length < branches.length && kept.length === 1) {
      const { anyOf, oneOf, ...outer } = s;
      return { schema: { ...resolve(doc, kept[0]), ...outer }, optional: true };
    }
  }
  return { schema: s, optional: false };
}

const same = (a, b) => JSON.stringify(a) === JSON.stringify(b);
const label = (name, schema, required) => h("span", { title: schema.description || null }, name,
  required ? h("span.muted", {}, " *") : null);

// The tag of each branch of a discriminated union: [{tag, schema}], or null when it is no such union.
export function unionBranches(doc, schema) {
  const branches = (schema.oneOf || schema.anyOf || []).map((b) => resolve(doc, b));
  if (branches.length < 2 || branches.some((b) => !b.properties)) return null;
  const property = schema.discriminator?.propertyName
    || Object.keys(branches[0].properties).find((key) => branches.every((b) => tagOf(doc, b, key) !== undefined));
  if (!property) return null;
  const tags = branches.map((b) => tagOf(doc, b, property));
  if (tags.some((t) => t === undefined) || new Set(tags).size !== tags.length) return null;
  return { property, branches: branches.map((b, i) => ({ tag: tags[i], schema: b })) };
}

function tagOf(doc, branch, key) {
  const p = branch.properties[key] && resolve(doc, branch.properties[key]);
  if (!p) return undefined;
  if (p.const !== undefined) return p.const;
  return p.enum?.length === 1 ? p.enum[0] : undefined;
}

// A field for `schema` at `path` (dotted, also the input's name); `widgets[path]` overrides the default input.
export function field(doc, schema, path, { required = false, widgets = {} } = {}) {
  const { schema: s, optional } = unwrapNull(doc, schema);
  const name = path.split(".").pop();
  const need = required && !optional && s.default === undefined;
  if (widgets[path]) return widgets[path]({ schema: s, path, name, required: need, label: label(name, s, need) });
  const union = unionBranches(doc, s);
  if (union) return unionField(doc, union, path, widgets);
  if (s.type === "object" && s.properties && Object.keys(s.properties).length) {
    const fields = objectFields(doc, s, path, widgets);
    // An optional object (a job's adapter) is sent only once its box is ticked: its constants alone (the
    // adapter's method) would otherwise make one out of an untouched form.
    const on = optional ? h("input", { type: "checkbox", name: path, "data-optional-object": "" }) : null;
    const set = h("fieldset.wide.grid", { "data-path": path, disabled: optional },
      h("legend", {}, on ? h("label.check", {}, on, " ", label(name, s, need)) : label(name, s, need)),
      fields.map((f) => f.el));
    on?.addEventListener("change", () => { set.disabled = !on.checked; });
    return { el: set, value: () => (on && !on.checked ? undefined : collect(fields)) };
  }
  if (s.const !== undefined) return { el: null, value: () => s.const };
  if (s.enum) return enumField(s, path, name, need, optional);
  // A nullable boolean (null: the server decides) has three states: left out, true or false.
  if (s.type === "boolean" && optional) return enumField({ ...s, enum: [true, false] }, path, name, false, true);
  if (s.type === "boolean") return booleanField(s, path, name);
  if (s.type === "integer" || s.type === "number") return numberField(s, path, name, need);
  if (s.type === "string") return stringField(s, path, name, need);
  return jsonField(s, path, name, need);
}

// The fields of a whole request body (an object or a discriminated union of objects) without a frame.
export function bodyField(doc, schema, widgets = {}) {
  const s = resolve(doc, schema);
  const union = unionBranches(doc, s);
  if (union) return unionField(doc, union, "", widgets);
  const fields = objectFields(doc, s, "", widgets);
  return { el: fields.map((f) => f.el).filter(Boolean), value: () => collect(fields) };
}

// Fields of an object's properties, in the schema's order; `skip` leaves out a union's tag.
export function objectFields(doc, schema, path, widgets, skip = null) {
  const required = new Set(schema.required || []);
  return Object.entries(schema.properties || {}).filter(([key]) => key !== skip).map(([key, prop]) => {
    const f = field(doc, prop, path ? `${path}.${key}` : key, { required: required.has(key), widgets });
    return { ...f, key };
  });
}

const collect = (fields) => {
  const out = {};
  for (const f of fields) {
    const v = f.value();
    if (v !== undefined) out[f.key] = v;
  }
  return out;
};

function unionField(doc, union, path, widgets) {
  const name = path ? `${path}.${union.property}` : union.property;
  const select = h("select", { name, "data-union": path || "body" },
    union.branches.map((b, i) => h("option", { value: i }, String(b.tag))));
  const box = h("div.wide.grid.union");
  let fields = [];
  const show = () => {
    // What the user changed survives a change of kind wherever the new kind has an input of the same name;
    // untouched inputs take the new kind's defaults (the kinds' defaults may differ).
    const kept = new Map([...box.querySelectorAll("[name][data-touched]")]
      .map((i) => [i.name, i.type === "checkbox" ? i.checked : i.value]));
    fields = objectFields(doc, union.branches[Number(select.value)].schema, path, widgets, union.property);
    box.replaceChildren(...fields.map((f) => f.el).filter(Boolean));
    for (const input of box.querySelectorAll("[name]")) {
      if (!kept.has(input.name)) continue;
      if (input.type === "checkbox") input.checked = kept.get(input.name);
      else input.value = kept.get(input.name);
      input.dataset.touched = "true";
    }
  };
  const touched = (e) => { if (e.target.name) e.target.dataset.touched = "true"; };
  box.addEventListener("input", touched);
  box.addEventListener("change", touched);
  select.addEventListener("change", show);
  show();
  return {
    el: h("div.wide.grid.union-field", {}, h("label", {}, union.property, select), box),
    value: () => ({ [union.property]: union.branches[Number(select.value)].tag, ...collect(fields) }),
  };
}

function enumField(s, path, name, required, optional) {
  const options = (optional || s.default === undefined ? [h("option", { value: "" }, "")] : [])
    .concat(s.enum.map((v, i) => h("option", { value: i, selected: same(v, s.default) }, String(v))));
  const select = h("select", { name: path, required }, options);
  return { el: h("label", {}, label(name, s, required), select),
    value: () => (select.value === "" || same(s.enum[Number(select.value)], s.default) ? undefined
      : s.enum[Number(select.value)]) };
}

function booleanField(s, path, name) {
  const box = h("input", { type: "checkbox", name: path, checked: s.default === true });
  return { el: h("label.check", {}, h("span", {}, box, " ", label(name, s, false))),
    value: () => (box.checked === Boolean(s.default) && s.default !== undefined ? undefined : box.checked) };
}

function numberField(s, path, name, required) {
  const integer = s.type === "integer";
  const low = s.minimum ?? s.exclusiveMinimum;
  const high = s.maximum ?? s.exclusiveMaximum;
  const input = h("input", { type: "number", name: path, required, step: integer ? 1 : "any", min: low, max: high,
    value: s.default ?? "", placeholder: s.default === undefined ? "" : null });
  // Exclusive bounds have no HTML attribute: checked here so the browser's own validation reports them.
  input.addEventListener("input", () => {
    const v = Number(input.value);
    const bad = input.value !== "" && ((s.exclusiveMinimum !== undefined && v <= s.exclusiveMinimum)
      || (s.exclusiveMaximum !== undefined && v >= s.exclusiveMaximum));
    input.setCustomValidity(bad ? `must be ${v <= s.exclusiveMinimum ? `above ${s.exclusiveMinimum}`
      : `below ${s.exclusiveMaximum}`}` : "");
  });
  return { el: h("label", {}, label(name, s, required), input),
    value: () => (input.value === "" || Number(input.value) === s.default ? undefined : Number(input.value)) };
}

function stringField(s, path, name, required) {
  const input = h("input", { name: path, required, minLength: s.minLength, maxLength: s.maxLength,
    value: s.default ?? "" });
  return { el: h("label", {}, label(name, s, required), input),
    value: () => (input.value === "" || input.value === s.default ? undefined : input.value) };
}

function jsonField(s, path, name, required) {
  const area = h("textarea", { name: path, rows: 2, required,
    placeholder: s.default === undefined ? "JSON" : JSON.stringify(s.default) });
  return { el: h("label.wide", {}, h("span", {}, label(name, s, required), h("span.muted", {}, " (JSON)")), area),
    value: () => {
      if (!area.value.trim()) return undefined;
      try {
        return JSON.parse(area.value);
      } catch (error) {
        throw new Error(`${path}: not valid JSON (${error.message})`);
      }
    } };
}
