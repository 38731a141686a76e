// The tools the page offers the model, like llama-server's web UI: the server's built-in ones
// (GET /tools says which exist, 403: none; each call runs through POST /tools) and those of the
// MCP servers listed in Settings (mcp.js, through --ui-mcp-proxy). Definitions go into the chat
// request's `tools`; a call's result goes back to the model as a `tool` message and the model
// answers again, for at most MAX_ROUNDS rounds per answer (a request that forces tool calls,
// tool_choice "required", would loop).

import { ApiError } from "./api.js";
import { McpClient } from "./mcp.js";

export const MAX_ROUNDS = 5;

export class Tools {
  constructor(api) {
    this.api = api;
    this.mcp = new McpClient(api);
    this.list = []; // GET /tools entries {tool, display_name, definition, ...}; MCP ones add `mcp: {server, name}`
    this.errors = []; // MCP servers that could not be used, as messages
  }

  // The server's tools, then those of each MCP server URL (a name already taken is skipped).
  async load(mcpUrls = []) {
    try {
      this.list = await this.api.get("tools");
    } catch (error) {
      if (!(error instanceof ApiError) || (error.status !== 403 && error.status !== 404)) throw error;
      this.list = [];
    }
    this.errors = [];
    for (const url of mcpUrls) {
      try {
        const server = await this.mcp.connect(url);
        for (const t of server.tools) {
          if (this.list.some((e) => e.tool === t.name)) continue;
          const parameters = t.inputSchema && typeof t.inputSchema === "object" ? t.inputSchema : { type: "object", properties: {} };
          this.list.push({ tool: t.name, display_name: `${t.name} (MCP ${new URL(url).host})`, type: "mcp", mcp: { server, name: t.name },
                           definition: { type: "function", function: { name: t.name, description: t.description || "", parameters } } });
        }
      } catch (error) {
        this.errors.push(`MCP server ${url}: ${error.message}`);
      }
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
    const params = parseArguments(call);
    if (params === undefined) return JSON.stringify({ error: "the tool call's arguments are not valid JSON" });
    const mcp = this.list.find((t) => t.tool === call.function.name)?.mcp;
    if (mcp) {
      try {
        return await this.mcp.call(mcp.server, mcp.name, params);
      } catch (error) {
        return JSON.stringify({ error: error.message });
      }
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

// A call's arguments as an object (an empty string is no arguments); undefined where they are not JSON.
export function parseArguments(call) {
  try {
    return call.function.arguments ? JSON.parse(call.function.arguments) : {};
  } catch {
    return undefined;
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
