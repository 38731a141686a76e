// The page's entry point: reads /props (asking for the API key when the server wants one),
// then wires the conversation list, the chat view and the dialogs together.
// When the server lists built-in tools (GET /tools, --tools) or Settings names MCP servers
// (reached through --ui-mcp-proxy), the composer's "Tools" box offers them to the model
// (tools.js runs the calls).
// Behind a router (/props says role "router"), the header's model picker lists the models of
// /v1/models with their status; the pick is kept in this browser and named by each request.

import { Api, ApiError } from "./api.js";
import { ChatView } from "./chat.js";
import { enableCopyButtons } from "./render.js";
import { Settings } from "./settings.js";
import * as store from "./store.js";
import { Tools } from "./tools.js";

const $ = (id) => document.getElementById(id);
const base = new URL(".", location.href);
let apiKey = store.loadApiKey();
const api = new Api(base, () => apiKey);
const tools = new Tools(api);
let props = {};
let settings = new Settings(store.loadSettings(), props);
let models = []; // router mode: /v1/models' entries
let picked = ""; // router mode: the model chosen in the header
const PICK_KEY = "mlxcel.model";

const view = new ChatView({
  root: $("messages"),
  api,
  settings: () => settings,
  tools,
  toolsOn: () => $("tools-on").checked,
  model: () => picked,
  onChange: () => renderList(),
  onBusy: (busy) => {
    $("send").hidden = busy;
    $("stop").hidden = !busy;
    document.body.classList.toggle("busy", busy);
    if (!busy && props.role === "router") loadModels().catch(() => {}); // the answer may have loaded a model
  },
});

function status(text, isError = false) {
  $("status").textContent = text;
  $("status").classList.toggle("error", isError);
}

// ---------------------------------------------------------------- API key and /props

function askKey(message) {
  return new Promise((resolve) => {
    const dialog = $("key-dialog");
    $("key-error").textContent = message;
    $("key-input").value = "";
    dialog.addEventListener("close", () => resolve($("key-input").value.trim()), { once: true });
    dialog.showModal();
  });
}

async function loadProps() {
  for (;;) {
    try {
      return await api.get("props");
    } catch (error) {
      if (!(error instanceof ApiError) || error.status !== 401) throw error;
      apiKey = await askKey(apiKey ? "That key was refused: " + error.message : "");
      store.saveApiKey(apiKey);
    }
  }
}

// ---------------------------------------------------------------- router mode: the model picker

async function loadModels() {
  models = (await api.get("v1/models")).data || [];
  const pick = $("model-pick");
  const known = models.map((m) => m.id);
  const saved = localStorage.getItem(PICK_KEY);
  const firstLoaded = models.find((m) => m.status?.value === "loaded")?.id;
  picked = known.includes(picked) ? picked : known.includes(saved) ? saved : firstLoaded || known[0] || "";
  pick.replaceChildren(...models.map((m) => {
    const option = document.createElement("option");
    option.value = m.id;
    const state = m.status?.failed ? "failed" : m.status?.value || "";
    option.textContent = state === "loaded" ? m.id : `${m.id} (${state})`;
    option.selected = m.id === picked;
    return option;
  }));
  pick.hidden = false;
  $("model-name").hidden = true;
  showModel();
}

$("model-pick").addEventListener("change", () => {
  picked = $("model-pick").value;
  localStorage.setItem(PICK_KEY, picked);
  showModel();
});
$("model-pick").addEventListener("focus", () => loadModels().catch(() => {})); // fresh statuses

function pickedFacts() {
  const entry = models.find((m) => m.id === picked);
  const state = entry?.status?.failed ? `failed: ${entry.status.error || ""}` : entry?.status?.value;
  return { name: picked || "mlxcel-server", nCtx: entry?.meta?.n_ctx, state };
}

function showModel() {
  if (props.role === "router") {
    const facts = pickedFacts();
    document.title = facts.name;
    view.nCtx = facts.nCtx || 0;
    $("model-facts").textContent = [facts.nCtx ? `context ${facts.nCtx} tokens` : "", facts.state || ""].filter(Boolean).join(" · ");
    return;
  }
  const name = props.model_alias || (props.model_path || "").split("/").pop() || "mlxcel-server";
  document.title = name;
  $("model-name").textContent = name;
  const n = props.default_generation_settings?.n_ctx;
  const kinds = Object.entries(props.modalities || {}).filter(([, on]) => on).map(([k]) => k);
  view.nCtx = n || 0;
  $("model-facts").textContent = [n ? `context ${n} tokens` : "", kinds.length ? `text + ${kinds.join(", ")}` : "text only"].filter(Boolean).join(" · ");
}

// ---------------------------------------------------------------- conversation list

let current = null;

function open(conversation) {
  current = conversation;
  view.show(conversation);
  renderList();
}

function renderList() {
  const list = $("conversations");
  list.replaceChildren();
  for (const c of store.listConversations()) {
    const li = document.createElement("li");
    li.dataset.id = c.id;
    li.classList.toggle("current", current && c.id === current.id);
    const title = document.createElement("button");
    title.type = "button";
    title.className = "title";
    title.dataset.action = "open";
    title.textContent = c.title;
    const rename = document.createElement("button");
    rename.type = "button";
    rename.dataset.action = "rename";
    rename.title = "Rename";
    rename.textContent = "✎";
    const remove = document.createElement("button");
    remove.type = "button";
    remove.dataset.action = "delete";
    remove.title = "Delete";
    remove.textContent = "✕";
    li.append(title, rename, remove);
    list.append(li);
  }
}

$("conversations").addEventListener("click", (event) => {
  const b = event.target.closest("button[data-action]");
  if (!b || view.busy) return;
  const id = b.closest("li").dataset.id;
  if (b.dataset.action === "open") {
    open(store.getConversation(id));
  } else if (b.dataset.action === "rename") {
    const c = store.getConversation(id);
    const title = prompt("Rename conversation", c.title);
    if (title && title.trim()) {
      store.renameConversation(id, title.trim());
      if (current?.id === id) current.title = title.trim();
      renderList();
    }
  } else if (b.dataset.action === "delete") {
    if (!confirm("Delete this conversation?")) return;
    store.deleteConversation(id);
    if (current?.id === id) open(store.listConversations()[0] || store.newConversation());
    else renderList();
  }
});

$("new-chat").addEventListener("click", () => {
  if (!view.busy) open(store.newConversation());
});

$("export").addEventListener("click", () => {
  const blob = new Blob([store.exportJson()], { type: "application/json" });
  const a = document.createElement("a");
  a.href = URL.createObjectURL(blob);
  a.download = `conversations-${new Date().toISOString().slice(0, 10)}.json`;
  a.click();
  setTimeout(() => URL.revokeObjectURL(a.href), 1000);
});

// ---------------------------------------------------------------- composer

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("input").value;
  if (!text.trim() || view.busy) return;
  $("input").value = "";
  view.send(text);
});

$("input").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});

$("stop").addEventListener("click", () => view.stop());

// ---------------------------------------------------------------- dialogs

$("open-settings").addEventListener("click", () => {
  settings.fill($("settings-fields"));
  $("settings-dialog").showModal();
});

$("settings-reset").addEventListener("click", () => {
  new Settings({}, props).fill($("settings-fields"));
});

$("settings-form").addEventListener("submit", (event) => {
  if (event.submitter?.value !== "save") return;
  try {
    const saved = settings.read($("settings-fields"));
    store.saveSettings(saved);
    const servers = settings.mcpServers.join("\n");
    settings = new Settings(saved, props);
    if (settings.mcpServers.join("\n") !== servers) loadTools();
  } catch (error) {
    event.preventDefault();
    alert(error.message);
  }
});

$("open-server").addEventListener("click", async () => {
  const info = $("server-info");
  const rows = [
    ["Model", props.model_alias], ["Path", props.model_path], ["Type", props.model_ftype],
    ["Context per slot", props.default_generation_settings?.n_ctx], ["Slots", props.total_slots],
    ["Build", props.build_info],
  ];
  try {
    const slots = await api.get("slots");
    rows.push(["Slots busy", `${slots.filter((s) => s.is_processing).length} of ${slots.length}`]);
  } catch { /* --no-slots */ }
  const table = document.createElement("table");
  for (const [k, v] of rows) {
    const tr = table.insertRow();
    tr.insertCell().textContent = k;
    tr.insertCell().textContent = v ?? "";
  }
  const links = document.createElement("p");
  for (const path of ["health", "props", "slots", "v1/models", "metrics", "openapi.json"]) {
    const a = document.createElement("a");
    a.href = new URL(path, base).href;
    a.textContent = "/" + path;
    links.append(a, " ");
  }
  info.replaceChildren(table, links);
  $("server-dialog").showModal();
});

// ---------------------------------------------------------------- start

enableCopyButtons($("messages"));

async function loadTools() {
  try {
    await tools.load(settings.mcpServers);
    if (tools.errors.length) status(tools.errors.join("; "), true);
  } catch (error) {
    status(`Cannot list the server's tools: ${error.message}`, true);
  }
  $("tools-toggle").hidden = !tools.available;
  $("tools-count").textContent = tools.available ? `(${tools.list.length})` : "";
  $("tools-toggle").title = "Offer these tools to the model: " + tools.list.map((t) => t.tool).join(", ");
}

async function start() {
  status("connecting…");
  try {
    props = await loadProps();
  } catch (error) {
    status(`Cannot reach the server: ${error.message}`, true);
    return;
  }
  settings = new Settings(store.loadSettings(), props);
  showModel();
  if (props.role === "router") {
    try {
      await loadModels();
    } catch (error) {
      status(`Cannot list the models: ${error.message}`, true);
    }
  }
  status("");
  await loadTools();
  open(store.listConversations()[0] || store.newConversation());
  document.body.dataset.ready = "1";
}

start();
