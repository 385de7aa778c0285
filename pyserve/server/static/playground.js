// The chat playground page: wires the settings, the API key field, the conversation and the
// status panel together.

import { apiKey, describeError, getJSON, setApiKey } from "./api.js";
import { chatRequest, runChat } from "./chat.js";
import { ConversationView } from "./conversation.js";
import { StatusPanel } from "./status.js";

const $ = (id) => document.getElementById(id);

const view = new ConversationView($("messages"), $("stats"));
const history = []; // the messages sent with the next request (the system prompt apart)
let controller = null; // the running request's AbortController

function notice(text, kind = "error") {
  const box = $("notice");
  box.textContent = text;
  box.dataset.kind = kind;
  box.hidden = !text;
}

async function loadModels() {
  const select = $("model");
  try {
    const models = (await getJSON("/v1/models")).data;
    select.replaceChildren(
      ...models.map((m) => {
        const option = document.createElement("option");
        option.value = option.textContent = m.id;
        return option;
      }),
    );
    notice("");
  } catch (err) {
    select.replaceChildren();
    notice(describeError(err));
  }
}

// A JSON textarea's value (null when empty); throws naming the field when it is not JSON.
function jsonField(id, label) {
  const text = $(id).value.trim();
  if (!text) return null;
  try {
    return JSON.parse(text);
  } catch (err) {
    throw new Error(`${label}: not valid JSON (${err.message})`);
  }
}

function settings() {
  return {
    model: $("model").value,
    system: $("system").value.trim(),
    temperature: Number($("temperature").value),
    topP: Number($("top-p").value),
    maxTokens: Number($("max-tokens").value),
    stream: $("stream").checked,
    schema: jsonField("schema", "JSON schema"),
    tools: jsonField("tools", "tools"),
    extra: jsonField("extra", "extra parameters"),
  };
}

async function send() {
  const text = $("prompt").value;
  if (!text.trim() || controller) return;
  let body;
  try {
    history.push({ role: "user", content: text });
    body = chatRequest(settings(), history);
  } catch (err) {
    history.pop();
    notice(err.message);
    return;
  }
  notice("");
  $("prompt").value = "";
  view.add("user", text);
  const item = view.add("assistant");
  controller = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  view.setStats("running", "…");
  try {
    const reply = await runChat(body, controller.signal, (r) => view.show(item, r));
    history.push(reply.message());
    view.showReply(reply);
  } catch (err) {
    history.pop();
    item.classList.add("failed");
    view.setStats("error", "");
    notice(describeError(err));
  } finally {
    controller = null;
    $("send").disabled = false;
    $("stop").disabled = true;
  }
}

$("api-key").value = apiKey();
$("save-key").addEventListener("click", () => {
  setApiKey($("api-key").value.trim());
  loadModels();
});
$("send").addEventListener("click", send);
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) send();
});
$("stop").addEventListener("click", () => controller?.abort());
$("clear").addEventListener("click", () => {
  controller?.abort();
  history.length = 0;
  view.clear();
});

loadModels();
new StatusPanel({
  running: $("status-running"),
  queued: $("status-queued"),
  gen: $("status-gen"),
  kv: $("status-kv"),
  cached: $("status-cached"),
  hit: $("status-hit"),
  state: $("status-state"),
}).start();
