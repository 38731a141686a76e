// The server's built-in tools (--tools) as the page uses them, like llama-server's web UI:
// GET /tools says which exist (403: the server has none), their definitions go into the chat
// request's `tools`, and each call the model makes runs through POST /tools; its result goes
// back to the model as a `tool` message and the model answers again, for at most MAX_ROUNDS
// rounds per answer (a request that forces tool calls, tool_choice "required", would loop).

import { ApiError } from "./api.js";

export const MAX_ROUNDS = 5;

export class Tools {
  constructor(api) {
    this.api = api;
    this.list = []; // GET /tools entries: {tool, display_name, definition, permissions, ...}
  }

  async load() {
    try {
      this.list = await this.api.get("tools");
    } catch (error) {
      if (!(error instanceof ApiError) || (error.status !== 403 && error.status !== 404)) throw error;
      this.list = [];
    }
    return this.list;
  }

  get available() {
    return this.list.length > 0;
  }

  definitions() {
    return this.list.map((t) => t.definition);
  }

  displayName(name) {
    return this.list.find((t) => t.tool === name)?.display_name || name;
  }

  // Run one call ({id, function: {name, arguments}}); the text the model gets back.
  async run(call) {
    let params;
    try {
      params = call.function.arguments ? JSON.parse(call.function.arguments) : {};
    } catch {
      return JSON.stringify({ error: "the tool call's arguments are not valid JSON" });
    }
    let result;
    try {
      result = await this.api.post("tools", { tool: call.function.name, params });
    } catch (error) {
      return JSON.stringify({ error: error.message });
    }
    return typeof result?.plain_text_response === "string" ? result.plain_text_response : JSON.stringify(result);
  }
}

// Merge one stream delta's tool_calls fragments into `calls` (by index, arguments appended).
export function mergeToolCalls(calls, fragments) {
  for (const f of fragments || []) {
    const i = f.index ?? calls.length;
    const call = calls[i] || (calls[i] = { id: "", type: "function", function: { name: "", arguments: "" } });
    if (f.id) call.id = f.id;
    if (f.function?.name) call.function.name += f.function.name;
    if (f.function?.arguments) call.function.arguments += f.function.arguments;
  }
  return calls;
}
