// The settings panel: the common samplers, the system prompt and extra request fields.
//
// Keys follow llama-server's web UI (systemMessage, temperature, top_k, ..., custom), so a
// --ui-config written for llama-server sets the same defaults here. A blank field sends nothing
// and the default applies, shown as the placeholder: --ui-config's value, else the server's
// sampling default from /props.
// Values: the user's saved settings over /props.ui_settings (--ui-config) over blank.

export const FIELDS = [
  { key: "systemMessage", label: "System prompt", kind: "text" },
  { key: "temperature", label: "Temperature", kind: "number", step: "0.05", param: "temperature" },
  { key: "top_k", label: "Top-k", kind: "integer", param: "top_k" },
  { key: "top_p", label: "Top-p", kind: "number", step: "0.01", param: "top_p" },
  { key: "min_p", label: "Min-p", kind: "number", step: "0.01", param: "min_p" },
  { key: "max_tokens", label: "Max tokens", kind: "integer", param: "n_predict" },
  { key: "repeat_penalty", label: "Repeat penalty", kind: "number", step: "0.05", param: "repeat_penalty" },
  { key: "presence_penalty", label: "Presence penalty", kind: "number", step: "0.05", param: "presence_penalty" },
  { key: "frequency_penalty", label: "Frequency penalty", kind: "number", step: "0.05", param: "frequency_penalty" },
  { key: "seed", label: "Seed", kind: "integer", param: "seed" },
  { key: "mcpServers", label: "MCP servers (one URL per line; needs --ui-mcp-proxy)", kind: "text" },
  { key: "custom", label: "Extra request fields (JSON object)", kind: "json" },
];

function parseField(field, raw) {
  const text = String(raw ?? "").trim();
  if (text === "") return undefined;
  if (field.kind === "text") return String(raw);
  if (field.kind === "json") {
    const value = JSON.parse(text);
    if (value === null || typeof value !== "object" || Array.isArray(value)) throw new Error("not a JSON object");
    return value;
  }
  const value = Number(text);
  if (!Number.isFinite(value) || (field.kind === "integer" && !Number.isInteger(value))) throw new Error(`not ${field.kind === "integer" ? "an integer" : "a number"}`);
  return value;
}

export class Settings {
  constructor(saved, serverProps) {
    this.saved = saved || {};
    this.server = serverProps || {};
  }

  get values() {
    return { ...(this.server.ui_settings || {}), ...this.saved };
  }

  serverDefault(field) {
    const params = this.server.default_generation_settings?.params || {};
    if (!field.param || params[field.param] === undefined) return "";
    const value = params[field.param];
    if (field.key === "max_tokens" && value === -1) return "no limit";
    return typeof value === "number" ? String(Math.round(value * 1e6) / 1e6) : String(value);
  }

  // The request fields these settings add to a chat body (the system prompt is not one).
  requestFields() {
    const out = {};
    const values = this.values;
    for (const field of FIELDS) {
      if (field.key === "systemMessage" || field.key === "custom" || field.key === "mcpServers") continue;
      let value;
      try { value = parseField(field, values[field.key]); } catch { value = undefined; }
      if (value !== undefined) out[field.key] = value;
    }
    let custom;
    try { custom = parseField(FIELDS.at(-1), typeof values.custom === "object" ? JSON.stringify(values.custom) : values.custom); } catch { custom = undefined; }
    return { ...out, ...(custom || {}) };
  }

  // The MCP server URLs of the settings, one per line.
  get mcpServers() {
    return String(this.values.mcpServers || "").split("\n").map((u) => u.trim()).filter(Boolean);
  }

  get systemMessage() {
    return String(this.values.systemMessage || "");
  }

  // Fill the panel's form: the user's own values; the placeholders show what applies without
  // them (--ui-config's value, else the server's sampling default).
  fill(container) {
    container.replaceChildren();
    const values = this.saved;
    const configured = this.server.ui_settings || {};
    for (const field of FIELDS) {
      const label = document.createElement("label");
      label.textContent = field.label;
      const input = document.createElement(field.kind === "text" || field.kind === "json" ? "textarea" : "input");
      input.name = field.key;
      input.id = `setting-${field.key}`;
      if (input.tagName === "INPUT") {
        input.type = "text";
        input.inputMode = "decimal";
      } else {
        input.rows = field.kind === "text" ? 3 : 2;
      }
      const value = values[field.key];
      input.value = value === undefined ? "" : typeof value === "object" ? JSON.stringify(value) : String(value);
      const preset = configured[field.key];
      input.placeholder = preset !== undefined ? (typeof preset === "object" ? JSON.stringify(preset) : String(preset))
        : field.kind === "json" ? '{"ignore_eos": false}' : this.serverDefault(field);
      label.append(input);
      container.append(label);
    }
  }

  // Read the form; throws an Error naming the first bad field.
  read(container) {
    const saved = {};
    for (const field of FIELDS) {
      const raw = container.querySelector(`[name="${field.key}"]`).value;
      try {
        if (parseField(field, raw) !== undefined) saved[field.key] = field.kind === "text" ? raw : raw.trim();
      } catch (error) {
        throw new Error(`${field.label}: ${error.message}`);
      }
    }
    return saved;
  }
}
