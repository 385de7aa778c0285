// The API reference page: this server's /openapi.json rendered as a list of operations (method,
// path, description, request body, responses) and the schemas they refer to, each schema a
// table of its properties. Fetched with the API key the playground stored.

import { apiKey, describeError, getJSON, setApiKey } from "./api.js";

const REF_PREFIX = "#/components/schemas/";

// A new element: el("td", {className: "x"}, child, "text", ...).
function el(tag, props = {}, ...children) {
  const node = Object.assign(document.createElement(tag), props);
  node.append(...children.filter((c) => c !== null && c !== undefined));
  return node;
}

function refName(ref) {
  return ref.startsWith(REF_PREFIX) ? ref.slice(REF_PREFIX.length) : ref;
}

// A link to the schema `name` further down the page.
function schemaLink(name) {
  return el("a", { href: `#schema-${name}`, className: "ref" }, name);
}

// A schema's type in one line: refs as links, unions joined with " | ".
function typeOf(schema) {
  if (schema === true || schema === undefined) return "any";
  if (schema.$ref) return schemaLink(refName(schema.$ref));
  const union = schema.anyOf || schema.oneOf;
  if (union) {
    const out = el("span");
    union.forEach((s, i) => out.append(...(i ? [" | "] : []), typeOf(s)));
    return out;
  }
  if (schema.enum) return `one of ${schema.enum.map((v) => JSON.stringify(v)).join(", ")}`;
  if ("const" in schema) return JSON.stringify(schema.const);
  const type = Array.isArray(schema.type) ? schema.type.join(" | ") : schema.type;
  if (type === "array" && schema.items) return el("span", {}, "array of ", typeOf(schema.items));
  if (type === "object" && schema.additionalProperties && schema.additionalProperties !== true) {
    return el("span", {}, "object of ", typeOf(schema.additionalProperties));
  }
  return type || "any";
}

// Limits worth showing beside the type.
function limitsOf(schema) {
  const names = ["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minLength", "maxLength", "minItems",
    "maxItems", "pattern", "format"];
  return names.filter((n) => n in schema).map((n) => `${n} ${schema[n]}`).join(", ");
}

function schemaTable(schema) {
  const required = new Set(schema.required || []);
  const rows = Object.entries(schema.properties || {}).map(([name, prop]) =>
    el(
      "tr",
      {},
      el("td", {}, el("code", {}, name), required.has(name) ? el("span", { className: "required" }, " required") : null),
      el("td", {}, typeOf(prop), limitsOf(prop) ? el("div", { className: "limits" }, limitsOf(prop)) : null),
      el("td", {}, "default" in prop ? el("code", {}, JSON.stringify(prop.default)) : ""),
      el("td", {}, prop.description || ""),
    ),
  );
  const head = el("tr", {}, ...["field", "type", "default", "description"].map((h) => el("th", {}, h)));
  return el("table", {}, el("thead", {}, head), el("tbody", {}, ...rows));
}

function renderSchema(name, schema) {
  const body = schema.properties ? schemaTable(schema) : el("p", {}, typeOf(schema));
  const json = el("details", {}, el("summary", {}, "JSON"), el("pre", {}, JSON.stringify(schema, null, 2)));
  return el("section", { id: `schema-${name}`, className: "schema" }, el("h3", {}, name), body, json);
}

function renderOperation(path, method, op) {
  const parts = [];
  if (op.description) parts.push(el("p", { className: "description" }, op.description));
  for (const p of op.parameters || []) {
    parts.push(el("p", {}, "path parameter ", el("code", {}, p.name), ": ", typeOf(p.schema)));
  }
  const body = op.requestBody?.content?.["application/json"]?.schema;
  if (body) parts.push(el("p", {}, "request body (JSON): ", typeOf(body)));
  const responses = el("ul", { className: "responses" });
  for (const [status, response] of Object.entries(op.responses || {})) {
    const media = Object.entries(response.content || {}).map(([type, c]) =>
      el("span", {}, " ", el("code", {}, type), ...(c.schema ? [" ", typeOf(c.schema)] : [])),
    );
    responses.append(el("li", {}, el("strong", {}, status), ` ${response.description}`, ...media));
  }
  parts.push(responses);
  const summary = el(
    "summary",
    {},
    el("span", { className: `method ${method}` }, method.toUpperCase()),
    " ",
    el("code", { className: "path" }, path),
  );
  const item = el("details", { className: "operation" }, summary, ...parts);
  item.dataset.path = path;
  item.dataset.method = method;
  return item;
}

function render(doc) {
  const ops = $("operations");
  const entries = Object.entries(doc.paths).sort(([a], [b]) => a.localeCompare(b));
  for (const [path, item] of entries) {
    for (const [method, op] of Object.entries(item)) ops.append(renderOperation(path, method, op));
  }
  const schemas = $("schemas");
  for (const [name, schema] of Object.entries(doc.components?.schemas || {})) schemas.append(renderSchema(name, schema));
  $("title").textContent = `${doc.info.title} ${doc.info.version}`;
  $("description").textContent = doc.info.description || "";
  if (window.location.hash) document.getElementById(window.location.hash.slice(1))?.scrollIntoView();
}

function $(id) {
  return document.getElementById(id);
}

function filter(text) {
  const needle = text.trim().toLowerCase();
  for (const op of document.querySelectorAll(".operation")) {
    op.hidden = needle !== "" && !`${op.dataset.method} ${op.dataset.path}`.toLowerCase().includes(needle);
  }
}

$("api-key").value = apiKey();
$("save-key").addEventListener("click", () => {
  setApiKey($("api-key").value.trim());
  window.location.reload();
});
$("filter").addEventListener("input", (e) => filter(e.target.value));

getJSON("/openapi.json").then(render, (err) => {
  const box = $("notice");
  box.textContent = describeError(err);
  box.hidden = false;
});
